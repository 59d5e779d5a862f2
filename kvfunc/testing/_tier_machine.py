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

The device is one full-attention group, or (``hybrid``) a full-attention
group and a sliding window sharing one pool.  :class:`_Contents` follows
what each block *holds*, as a shell running the deltas would fill it: the
forward pass writes the blocks of the tokens it computes, a move copies
when it starts, in the delta's row order (a write-back store before the
forward pass, a write-through one after it), and a load that is reported
failed leaves junk.  A request admitted with loads computes nothing until
they settle: its first ``run_on`` computes from the end of its hit (or from
where a failed load left it); with ``cache_loaded`` (drawn) the driver runs
the loads and the forward pass at admission instead, as it promises.  Every
block a tier offers as a hit must hold the KV of its key: a device block
cached under a hash, a host block in the index, a hash in the remote
directory.
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

_JUNK = b"junk"  # what a failed load leaves in its block


class _Contents:
    """What each device block, host block and remote key holds: the tier key of its KV."""

    def __init__(self) -> None:
        self.device: dict[int, bytes | None] = {}
        self.host: dict[int, bytes | None] = {}
        self.remote: dict[bytes, bytes | None] = {}

    def apply(self, before: TieredState, after: TieredState, delta: kf.TierDelta,
              forward: tuple[Any, int, int, BlockHashes] | None) -> None:
        """Fill the blocks as a shell running ``delta`` (and the forward pass) would: moves in
        row order, a load writing its block when it runs (junk if it is reported failed)."""
        for code, row in delta.rows():
            if code == "K" and row[1] == "failed":
                m = before.moves[row[0]]
                if m.direction in ("host->device", "remote->device"):
                    self.device[m.dst] = _JUNK
        write_back = after.write_policy == "write-back"
        moves = list(delta.moves())
        for _, direction, digest, src, dst, *_ in moves:
            if direction == "device->host" and write_back:
                self.host[dst] = self.device.get(src)
            elif direction == "host->remote":
                self.remote[digest] = self.host.get(src)
            elif direction == "host->device":
                self.device[dst] = self.host.get(src)
            elif direction == "remote->device":
                self.device[dst] = self.remote.get(digest)
        if forward is not None:
            self._forward(after, *forward)
        for _, direction, _, src, dst, *_ in moves:
            if direction == "device->host" and not write_back:
                self.host[dst] = self.device.get(src)

    def _forward(self, state: TieredState, rid: Any, start: int, end: int,
                 hashes: BlockHashes) -> None:
        """The forward pass of tokens ``start .. end - 1`` writes their blocks in every group."""
        bs, tables = state.block_size, kf.get_block_ids(state.device, rid)
        for key, table in tables.items():
            for p in range(start // bs, -(-end // bs)):
                b = table[p]
                if b and b not in state.device_pending:
                    full = (p + 1) * bs <= end
                    self.device[b] = state.tier_key(key, hashes.hashes[p]) if full else None

    def check(self, state: TieredState) -> None:
        """Every hit a tier offers holds the KV of its key."""
        for b, k in enumerate(state.device.pools[0].hash_of or ()):
            if k is not None and b not in state.device_pending:
                assert self.device.get(b) == k, f"device block {b} cached as {k!r} holds junk"
        if state.host is not None:
            for k, e in state.host.index.entries.items():
                assert self.host.get(e.block) == k, f"host block {e.block} holds junk"
        if state.remote is not None:
            for k in state.remote.index.entries:
                assert self.remote.get(k) == k, f"remote key {k!r} holds junk"

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
                                write_policy="write-back", keys=("f",))
        self.deltas: list[kf.TierDelta] = []
        self.contents = _Contents()
        self.tokens: dict[Any, list[int]] = {}
        self.computed: dict[Any, int] = {}
        self.count = 0
        self.cache_loaded = False

    @initialize(num_blocks=st.integers(4, 7), block_size=st.sampled_from([2, 4]),
                host_blocks=st.integers(0, 6), remote=st.booleans(),
                remote_blocks=st.none() | st.integers(1, 6),
                write_policy=st.sampled_from(kf.WRITE_POLICIES), hybrid=st.booleans(),
                cache_loaded=st.booleans())
    def setup(self, num_blocks: int, block_size: int, host_blocks: int, remote: bool,
              remote_blocks: int | None, write_policy: str, hybrid: bool,
              cache_loaded: bool) -> None:
        """Draw the device (one full-attention group, or a full-attention group and a window
        of two blocks sharing a pool twice the size) and the tiers."""
        remote_blocks = remote_blocks if remote else None
        groups: dict[str, Any] = {"f": kf.FullAttention(num_blocks=num_blocks * (1 + hybrid),
                                                        block_size=block_size)}
        if hybrid:
            groups["w"] = kf.SlidingWindow(num_blocks * 2, block_size, 2 * block_size)
        device = kf.KVState.create(groups, 128, enable_prefix_caching=True,
                                   layout="shared" if hybrid else "per-type")
        self.state = self.initial = TieredState.create(
            device, host_blocks=host_blocks * (1 + hybrid), remote=remote,
            remote_blocks=remote_blocks, write_policy=write_policy)
        self.cache_loaded = cache_loaded
        self.model = NaiveTiers(host_blocks=host_blocks * (1 + hybrid), remote=remote,
                                remote_blocks=remote_blocks, write_policy=write_policy,
                                keys=tuple(groups))

    def _commit(self, state: TieredState, delta: kf.TierDelta,
                forward: tuple[Any, int, int, BlockHashes] | None = None) -> None:
        self.contents.apply(self.state, state, delta, forward)
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
        bs = self.state.block_size
        dev = kf.lookup_prefix(self.state.device, h, max_tokens=len(tokens) - 1)
        while (cut := self.model.first_loading(dev.block_ids)) is not None:
            dev = kf.lookup_prefix(self.state.device, h, max_tokens=cut * bs)
            event("a device hit cut before a block being loaded")
        assert (hit.device.num_tokens, hit.device.block_ids) == (dev.num_tokens, dev.block_ids)
        n = dev.num_tokens // bs
        sources, blocks, keys = self.model.lookup(n, h.hashes, hit.query_tokens // bs)
        assert (list(hit.sources), list(hit.host_block_ids), list(hit.hashes)) == (
            sources, blocks, keys)
        if hit.sources:
            event(f"a hit from {sorted(set(hit.sources))} ({len(self.state.keys)} groups)")
        entry = (rid, hit.num_tokens, len(tokens) - hit.num_tokens, 0, 0, None, h, hit)
        res = kf.allocate_tiered(self.state, [entry], priorities={rid: priority},
                                 cache_loaded=self.cache_loaded)
        if res.refused:
            assert res.state.device is self.state.device and not res.delta.order
            return
        self.model.priorities[rid] = priority
        self.model.device_did(res.delta.device)
        tables = kf.get_block_ids(res.state.device, rid)
        if (self.state.write_policy == "write-back" and keys
                and res.delta.device.evicted_block_ids):  # stores first, then the loads
            event("stores of evicted blocks before a hit's loads")
            self.model.hold(sources, keys, 1)
            self.model.follow()
            self.model.admitted(rid, tables, n, sources, blocks, keys)
            self.model.hold(sources, keys, -1)
        else:
            self.model.admitted(rid, tables, n, sources, blocks, keys)
            self.model.follow()
        # A request with loads in flight computes nothing until they settle (run_on does),
        # unless the driver promises its loads and forward pass run at once (cache_loaded).
        loading = kf.loads_pending(res.state, rid) > 0 and not self.cache_loaded
        self._commit(res.state, res.delta,
                     None if loading else (rid, hit.num_tokens, len(tokens), h))
        self.tokens[rid] = tokens
        self.computed[rid] = hit.num_tokens if loading else len(tokens)
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
        self._commit(res.state, res.delta, (rid, c, len(tokens), h))
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
        assert all(s.tier_key(mv.key, s.split_key(mv.digest)[1]) == mv.digest
                   for mv in s.moves.values())
        self.contents.check(s)

    @invariant()
    def the_log_replays(self) -> None:
        """Replaying every delta from the first state gives the current state."""
        if len(self.deltas) % 4 == 0:
            assert kf.replay_tiered(self.initial, self.deltas) == self.state
