"""Prefix caching against a model of the cache's *contents*.

The machine drives a caching state with admissions (lookup + hit), decode
steps, forks, frees and resets, and keeps its own record of what each block
holds, written the way an engine writes KV (copies first, then the step's
tokens into the request's blocks).  After every step it checks:

* ``check_invariants`` (reference counts equal table membership, the hash
  index matches the blocks, conservation) and ``replay(s0, deltas) == state``;
* a hit never hands out a block whose tokens differ from the request's (a
  saved state must be the state after exactly the hit's tokens);
* no step writes a block that another request also holds (copy-on-write);
* evictions follow LRU order within retention priorities: the evicted blocks
  are, in order, the cached blocks of the lowest priority that became free the
  longest ago (by the model's own rules; frees draw a priority);
* old states are never changed.
"""

from __future__ import annotations

from typing import Any

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import kvfunc as kf
from kvfunc.testing import shared_sizes

HBS = 4  # hash block size
PROMPTS = [tuple(range(100, 100 + n)) for n in (6, 13, 16, 20)]  # shared system prompts


def _configs() -> st.SearchStrategy[dict[str, Any]]:
    full = st.builds(lambda n: kf.FullAttention(num_blocks=n, block_size=HBS),
                     st.integers(8, 24))
    swa = st.builds(lambda n, w: kf.SlidingWindow(num_blocks=n, block_size=HBS, sliding_window=w),
                    st.integers(6, 16), st.integers(1, 12))
    mamba = st.builds(lambda n: kf.Mamba(num_blocks=n, block_size=2 * HBS),
                      st.integers(6, 16))
    return st.one_of(
        st.builds(lambda f: {"full": f}, full),
        st.builds(lambda f, w: {"full": f, "swa": w}, full, swa),
        st.builds(lambda f, m: {"full": f, "mamba": m}, full, mamba),
    )


class PrefixCacheMachine(RuleBasedStateMachine):
    """A caching state next to a model of block contents, references and LRU order."""

    def __init__(self) -> None:
        super().__init__()
        self.state: kf.KVState
        self.tokens: dict[int, list[int]] = {}  # running request -> its tokens
        self.computed: dict[int, int] = {}
        self.content: dict[tuple[str, int], Any] = {}  # (group, block) -> {slot: token} / state
        self.lru: dict[str, list[int]] = {}  # cached free blocks, evicted first first (model)
        self.priority: dict[tuple[str, int], int] = {}  # (pool, block) in an LRU: its priority
        self.history: list[tuple[kf.KVState, Any]] = []
        self.next_id = 0

    @initialize(groups=_configs(), layout=st.sampled_from(["per-type", "shared"]))
    def create(self, groups: dict[str, Any], layout: str) -> None:
        groups = shared_sizes(groups, layout)
        self.state = self.s0 = kf.KVState.create(groups, 64, enable_prefix_caching=True,
                                                 layout=layout)
        self.deltas: list[kf.BlocksChanged] = []
        self.pool = {k: self.state.pool_of(k).name for k in groups}  # group -> its pool
        self.lru = {p: [] for p in self.pool.values()}  # per pool: one eviction order
        self.cached: dict[str, set[int]] = {k: set() for k in groups}  # the model's

    # -- helpers ---------------------------------------------------------------------
    def _hashes(self, rid: int) -> kf.BlockHashes:
        return kf.BlockHashes.of(self.tokens[rid], HBS)

    def _refs(self, key: str) -> dict[int, int]:
        refs: dict[int, int] = {}
        for table in self.state.group(key).tables.values():
            for b in table:
                if b:
                    refs[b] = refs.get(b, 0) + 1
        return refs

    def _cached(self, key: str) -> set[int]:
        return {b for blocks in self.state.pool_of(key).cached(key).values() for b in blocks}

    def _commit(self, state: kf.KVState, delta: kf.BlocksChanged) -> None:
        """Fold ``delta``'s operations into the model (LRU order, block contents), in order.

        A freed block that holds a cached block joins the LRU's young end; a hit
        takes it out; an eviction must take the LRU's old end; a copy carries its
        source's contents; a new block is zeroed by the shell.
        """
        level = 0  # a Retained row's priority, for the Freed rows after it
        for op in delta.operations():
            kind = type(op).__name__
            event(kind)
            lru = self.lru[self.pool[op.key]] if hasattr(op, "key") else []
            if isinstance(op, kf.core.Retained):
                level = op.priority
            elif isinstance(op, kf.core.Freed) and any(
                    op.block_id in self.cached[k] for k in self.pool
                    if self.pool[k] == self.pool[op.key]):
                # behind every cached free block of the same or a lower priority
                pool = self.pool[op.key]
                at = sum(self.priority[pool, b] <= level for b in lru)
                lru.insert(at, op.block_id)
                self.priority[pool, op.block_id] = level
            elif isinstance(op, kf.core.Shared) and op.block_id in lru:
                lru.remove(op.block_id)
            elif isinstance(op, kf.core.Evicted):
                assert lru and lru[0] == op.block_id, f"{op.key}: evicted {op.block_id}, {lru}"
                lru.pop(0)
                self.cached[op.key].discard(op.block_id)
            elif isinstance(op, kf.core.Stored):
                self.cached[op.key].add(op.block_id)
            elif isinstance(op, kf.core.Cleared):
                self.lru[self.pool[op.key]], self.cached[op.key] = [], set()
            elif isinstance(op, kf.core.Copied):  # in order, as the shell copies
                self.content[(op.key, op.dst_block_id)] = self.content.get(
                    (op.key, op.src_block_id))
                event({kf.COPY_SAVED: "saved state", kf.COPY_INTO_NEW: "state hit"}.get(
                    op.position, "cow"))
            elif isinstance(op, kf.core.Appended) and op.block_id:
                self.content[(op.key, op.block_id)] = None  # a new block: the shell zeroes it
        if delta.hit_tokens and delta.hit_tokens[0]:
            event("prefix hit")
        self.history.append((state, repr(get_all(state))))
        self.state = state
        self.deltas.append(delta)

    @staticmethod
    def _cached_after(state: kf.KVState, key: str) -> set[int]:
        return {b for blocks in state.pool_of(key).cached(key).values() for b in blocks}

    def _write(self, rid: int, start: int, end: int) -> None:
        """The engine writes tokens ``start .. end-1`` of ``rid``: no shared block is written."""
        toks = self.tokens[rid]
        for g in self.state.groups:
            table = g.tables.get(rid, ())
            refs = self._refs(g.key)
            if not g.policy.grows_with_tokens:
                if table:
                    assert refs[table[0]] == 1, f"{g.key}: writes state block {table[0]} it shares"
                    self.content[(g.key, table[0])] = tuple(toks[:end])
                continue
            bs = g.policy.block_size
            for t in range(start, end):
                p = t // bs
                if p < len(table) and table[p]:
                    b = table[p]
                    assert refs[b] == 1, f"{g.key}: {rid} writes block {b} that others hold"
                    slots = dict(self.content.get((g.key, b)) or {})
                    slots[t % bs] = toks[t]
                    self.content[(g.key, b)] = slots

    def _check_hit(self, hit: kf.PrefixHit, toks: list[int]) -> None:
        for g in self.state.groups:
            entries = hit.block_ids[g.key]
            if not g.policy.grows_with_tokens:
                if hit.num_tokens:
                    got = self.content.get((g.key, entries[0]))
                    assert got == tuple(toks[:hit.num_tokens]), f"{g.key}: saved state differs"
                continue
            bs = g.policy.block_size
            for p, b in enumerate(entries):
                if b:
                    want = {i: toks[p * bs + i] for i in range(bs)}
                    assert self.content.get((g.key, b)) == want, f"{g.key}: block {b} differs"

    def _released(self, key: str, before: kf.KVState, rid: int) -> list[tuple[str, int]]:
        """Blocks whose last holder is ``rid`` in ``key``, in the order they are freed."""
        table = before.group(key).tables.get(rid, ())
        refs = {}
        for t in before.group(key).tables.values():
            for b in t:
                refs[b] = refs.get(b, 0) + 1
        return [(key, b) for b in reversed(table) if b and refs[b] == 1]

    # -- rules -----------------------------------------------------------------------
    @rule(prompt=st.sampled_from(PROMPTS), suffix=st.lists(st.integers(0, 3), max_size=9))
    def admit(self, prompt: tuple[int, ...], suffix: list[int]) -> None:
        rid = self.next_id
        self.next_id += 1
        toks = list(prompt) + suffix
        h = kf.BlockHashes.of(toks, HBS)
        hit = kf.lookup_prefix(self.state, h, max_tokens=len(toks) - 1)
        self._check_hit(hit, toks)
        self._run(rid, toks, hit.num_tokens, kf.allocate_slots(
            self.state, rid, hit.num_tokens, len(toks) - hit.num_tokens, block_hashes=h,
            prefix_hit=hit))

    def _run(self, rid: int, toks: list[int], start: int, res: kf.AllocationResult) -> None:
        """Publish one request's allocation (a refusal changes nothing) and write its tokens."""
        if not res.ok:
            assert res.state is self.state
            return
        self.tokens[rid] = toks
        self.computed[rid] = len(toks)
        self._commit(res.state, res.delta)
        self._write(rid, start, len(toks))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), new=st.lists(st.integers(0, 3), min_size=1, max_size=5))
    def decode(self, data: st.DataObject, new: list[int]) -> None:
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        start = self.computed[rid]
        toks = self.tokens[rid] + new
        h = kf.BlockHashes.of(toks, HBS)
        self._run(rid, toks, start,
                  kf.allocate_slots(self.state, rid, start, len(new), block_hashes=h))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), prompt=st.sampled_from(PROMPTS),
          suffix=st.lists(st.integers(0, 3), max_size=9))
    def step(self, data: st.DataObject, prompt: tuple[int, ...], suffix: list[int]) -> None:
        """A scheduler step: decode some running requests, admit one; batch == sequential."""
        running = data.draw(st.lists(st.sampled_from(sorted(self.tokens)), unique=True,
                                     min_size=1))
        news = {rid: data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=5))
                for rid in running}
        rid = self.next_id
        self.next_id += 1
        toks = list(prompt) + suffix
        h = kf.BlockHashes.of(toks, HBS)
        hit = kf.lookup_prefix(self.state, h, max_tokens=len(toks) - 1)
        reqs: list[Any] = [
            (r, self.computed[r], len(n), 0, 0, None,
             kf.BlockHashes.of(self.tokens[r] + n, HBS), None) for r, n in news.items()]
        reqs.insert(data.draw(st.integers(0, len(reqs))),
                    kf.SlotRequest(rid, hit.num_tokens, len(toks) - hit.num_tokens, 0, 0,
                                   None, h, hit))
        batch = kf.allocate_batch(self.state, reqs)
        seq, refused = self.state, []
        for req in reqs:
            r = kf.allocate_slots(seq, req[0], req[1], req[2], block_hashes=req[6],
                                  prefix_hit=req[7])
            if r.ok:
                seq = r.state
            else:
                refused.append(req[0])
        assert batch.refused == tuple(refused), (batch.refused, refused)
        assert get_all(batch.state) == get_all(seq), (reqs, get_all(self.state),
                                                      get_all(batch.state), get_all(seq))
        written = {r: (self.computed[r], self.computed[r] + len(n)) for r, n in news.items()}
        for r, n in news.items():
            if r not in refused:
                self.tokens[r] = self.tokens[r] + n
                self.computed[r] = len(self.tokens[r])
        if rid not in refused:
            self.tokens[rid], self.computed[rid] = toks, len(toks)
            written[rid] = (hit.num_tokens, len(toks))
        self._commit(batch.state, batch.delta)
        for r, (start, end) in written.items():
            if r not in refused:
                self._write(r, start, end)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        child = self.next_id
        self.next_id += 1
        state, delta = kf.fork_request(self.state, parent, child)
        self.tokens[child] = list(self.tokens[parent])
        self.computed[child] = self.computed[parent]
        self._commit(state, delta)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        priority = data.draw(st.sampled_from([0, 0, 0, -1, 2, 5]), label="priority")
        order = [kb for g in self.state.groups for kb in self._released(g.key, self.state, rid)]
        state, delta = kf.free_request(self.state, rid, priority=priority)
        assert list(zip(delta.freed_keys, delta.freed_block_ids, strict=True)) == order
        del self.tokens[rid], self.computed[rid]
        self._commit(state, delta)

    @rule()
    def reset(self) -> None:
        state, delta = kf.reset_prefix_cache(self.state)
        self._commit(state, delta)
        assert all(kf.num_cached_blocks(state, k) == 0 for k in state.manager_keys)

    # -- invariants ------------------------------------------------------------------
    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "s0"):
            return
        kf.check_invariants(self.state)
        assert kf.replay(self.s0, self.deltas) == self.state

    @invariant()
    def old_states_unchanged(self) -> None:
        for state, text in self.history[-3:]:
            assert repr(get_all(state)) == text

    @invariant()
    def lru_matches_free_cached_blocks(self) -> None:
        """The model's cached set and LRU are the state's; uncached free blocks come first."""
        if not hasattr(self, "s0"):
            return
        for g in self.state.groups:
            assert self.cached[g.key] == self._cached(g.key)
        for pool in self.state.pools:
            free = pool.free_block_ids()
            cached = set().union(*(self._cached(k) for k in pool.members))
            cached_free = [b for b in free if b in cached]
            lru = self.lru[pool.name]
            assert cached_free == lru, f"{pool.name}: {cached_free} != {lru}"
            first = [b in cached for b in free]
            assert first == sorted(first), f"{pool.name}: cached free before uncached"


def get_all(state: kf.KVState) -> Any:
    """Everything observable about a state, for the unchanged-history check."""
    return [state.identity(), [p.free_block_ids() for p in state.pools]]


TestPrefixCacheMachine = PrefixCacheMachine.TestCase
