"""The tiered core and the naive tier model, driven side by side by Hypothesis.

Theory of operation
-------------------
:class:`TieredStateMachine` keeps a :class:`kvfunc.TieredState` and a
:class:`~kvfunc.testing.NaiveTiers`.  Requests draw their prompts from a few
shared prefixes, so they hit each other's blocks in every tier.  Rules admit
a request with its cross-tier hit, run a request on (decode, or recompute
after a failed load), free a request, settle a random subset of the pending
moves as done or failed, and feed hostile move ids to ``complete_moves``.
After every step the invariants compare the tiers with the model (hits,
priorities, free host blocks, pending moves, the remote directory), run
:func:`kvfunc.check_tiered_invariants`, and replay the whole log of
:class:`kvfunc.TierDelta` from the first state.
"""

from __future__ import annotations

from typing import Any

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import kvfunc as kf
from kvfunc import BlockHashes, TieredState
from kvfunc.testing._tier_model import NaiveTiers

__all__ = ["TieredStateMachine"]

_PREFIXES = (tuple(range(100, 112)), tuple(range(200, 212)), tuple(range(100, 106)),
             tuple(range(300, 316)))


class TieredStateMachine(RuleBasedStateMachine):
    """Runs the tiers of :mod:`kvfunc` and :class:`NaiveTiers` side by side."""

    def __init__(self) -> None:
        super().__init__()
        self.state = self.initial = TieredState.create(
            kf.KVState.create({"f": kf.FullAttention(num_blocks=4, block_size=4)}, 64,
                              enable_prefix_caching=True))
        self.model = NaiveTiers(host_blocks=0, remote=False, remote_blocks=None,
                                write_policy="write-back")
        self.deltas: list[kf.TierDelta] = []
        self.tokens: dict[Any, list[int]] = {}
        self.computed: dict[Any, int] = {}
        self.count = 0

    @initialize(num_blocks=st.integers(4, 7), block_size=st.sampled_from([2, 4]),
                host_blocks=st.integers(0, 6), remote=st.booleans(),
                remote_blocks=st.none() | st.integers(1, 6),
                write_policy=st.sampled_from(kf.WRITE_POLICIES))
    def setup(self, num_blocks: int, block_size: int, host_blocks: int, remote: bool,
              remote_blocks: int | None, write_policy: str) -> None:
        """Draw the device and the tiers."""
        remote_blocks = remote_blocks if remote else None
        device = kf.KVState.create({"f": kf.FullAttention(num_blocks=num_blocks,
                                                           block_size=block_size)},
                                   128, enable_prefix_caching=True)
        self.state = self.initial = TieredState.create(
            device, host_blocks=host_blocks, remote=remote, remote_blocks=remote_blocks,
            write_policy=write_policy)
        self.model = NaiveTiers(host_blocks=host_blocks, remote=remote,
                                remote_blocks=remote_blocks, write_policy=write_policy)

    def _commit(self, state: TieredState, delta: kf.TierDelta) -> None:
        self.state = state
        self.deltas.append(delta)
        if delta.moved_ids:
            event(f"moves started: {sorted(set(delta.moved_directions))}")

    # -- rules -------------------------------------------------------------------------------
    @rule(prefix=st.sampled_from(_PREFIXES), tail=st.lists(st.integers(0, 1), max_size=3),
          priority=st.integers(0, 2), finish=st.booleans())
    def admit(self, prefix: tuple[int, ...], tail: list[int], priority: int,
              finish: bool) -> None:
        """Admit a request with its cross-tier hit (and free it at once if ``finish``)."""
        tokens = [*prefix, *tail]
        rid = self.count
        self.count += 1
        h = BlockHashes.of(tokens, self.state.block_size)
        hit = kf.lookup_tiers(self.state, h, max_tokens=len(tokens) - 1)
        table = hit.device.block_ids["f"]
        bs = self.state.block_size
        n, sources, blocks = self.model.lookup(table, h.hashes, hit.query_tokens // bs)
        assert (hit.device.num_tokens // bs, list(hit.sources), list(hit.host_block_ids)) == (
            n, sources, blocks)
        if hit.sources:
            event(f"a hit from {sorted(set(hit.sources))}")
        entry = (rid, hit.num_tokens, len(tokens) - hit.num_tokens, 0, 0, None, h, hit)
        res = kf.allocate_tiered(self.state, [entry], priorities={rid: priority})
        if res.refused:
            assert res.state.device is self.state.device and not res.delta.order
            return
        self.model.priorities[rid] = priority
        self.model.device_did(res.delta.device)
        dev_table = kf.get_block_ids(res.state.device, rid)["f"]
        self.model.admitted(rid, dev_table, n, sources, blocks, list(hit.hashes))
        self.model.follow()
        self._commit(res.state, res.delta)
        self.tokens[rid] = tokens
        self.computed[rid] = len(tokens)
        if finish and not kf.loads_pending(self.state, rid):
            self._free(rid)

    def _idle(self) -> list[Any]:
        return sorted(r for r in self.tokens if not kf.loads_pending(self.state, r))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), new=st.integers(1, 6))
    def run_on(self, data: st.DataObject, new: int) -> None:
        """A request with no loads in flight computes on (from where a failed load left it)."""
        idle = self._idle()
        if not idle:
            return
        rid = data.draw(st.sampled_from(idle))
        tokens = self.tokens[rid] + [7] * new
        c = self.computed[rid]
        h = BlockHashes.of(tokens, self.state.block_size)
        res = kf.allocate_tiered(self.state, [(rid, c, len(tokens) - c)],
                                 block_hashes={rid: h})
        if res.refused:
            return
        self.model.device_did(res.delta.device)
        self.model.follow()
        self._commit(res.state, res.delta)
        self.tokens[rid] = tokens
        self.computed[rid] = len(tokens)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        """Free a request whose loads have settled."""
        idle = self._idle()
        if not idle:
            return
        self._free(data.draw(st.sampled_from(idle)))

    def _free(self, rid: Any) -> None:
        state, delta = kf.free_tiered(self.state, rid)
        self.model.device_did(delta.device)
        self.model.follow()
        self.model.priorities.pop(rid, None)
        self._commit(state, delta)
        del self.tokens[rid], self.computed[rid]

    @precondition(lambda self: self.state.moves)
    @rule(data=st.data())
    def complete(self, data: st.DataObject) -> None:
        """Settle some pending moves: each done, failed or left pending."""
        fates = data.draw(st.lists(st.sampled_from(["done", "failed", "pending"]),
                                   min_size=len(self.state.moves),
                                   max_size=len(self.state.moves)))
        ids = sorted(self.state.moves)
        done = [i for i, f in zip(ids, fates, strict=True) if f == "done"]
        failed = [i for i, f in zip(ids, fates, strict=True) if f == "failed"]
        res = kf.complete_moves(self.state, done=done, failed=failed)
        self.model.settle(done, failed)
        for rid, tokens in res.recompute_from.items():
            event("a failed load: recompute")
            self.computed[rid] = min(self.computed[rid], tokens)
        self._commit(res.state, res.delta)

    @precondition(lambda self: self.state.moves)
    @rule()
    def complete_all(self) -> None:
        """Every pending move is done."""
        done = sorted(self.state.moves)
        res = kf.complete_moves(self.state, done=done)
        self.model.settle(done, [])
        assert not res.recompute_from
        self._commit(res.state, res.delta)

    @rule(bad=st.one_of(st.integers(-3, 200), st.booleans(), st.text(max_size=2), st.none()),
          twice=st.booleans())
    def hostile_ids(self, bad: object, twice: bool) -> None:
        """Junk, unknown or repeated move ids are typed errors and change nothing."""
        before = self.state
        ids: Any = [bad]
        if twice and self.state.moves:
            first = min(self.state.moves)
            ids = [first, first]
        elif isinstance(bad, int) and not isinstance(bad, bool) and bad in self.state.moves:
            return
        try:
            kf.complete_moves(self.state, done=ids)
        except kf.KVFuncError:
            pass
        else:
            raise AssertionError(f"complete_moves took {ids!r}")
        assert self.state is before

    # -- invariants --------------------------------------------------------------------------
    @invariant()
    def tiers_agree_with_the_model(self) -> None:
        """The tiers hold what the model holds, and their books balance."""
        kf.check_tiered_invariants(self.state)
        s, m = self.state, self.model
        host = {} if s.host is None else {d: (e.block, e.priority)
                                          for d, e in s.host.index.entries.items()}
        assert host == m.host_view()
        if s.host is not None:
            assert sorted(s.host.free[:s.host.num_free]) == sorted(m.free)
        remote = {} if s.remote is None else {d: e.priority
                                              for d, e in s.remote.index.entries.items()}
        assert remote == m.remote_view()
        moves = {i: (mv.direction, mv.digest, mv.src, mv.dst) for i, mv in s.moves.items()}
        assert moves == m.moves_view()

    @invariant()
    def the_log_replays(self) -> None:
        """Replaying every delta from the first state gives the current state."""
        if len(self.deltas) % 4 == 0:
            assert kf.replay_tiered(self.initial, self.deltas) == self.state
