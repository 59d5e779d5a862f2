"""``check_invariants``: everything a reachable state satisfies (tests call it every step)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from kvfunc.core._group import GroupState
from kvfunc.core._policy import KEEPS_ALL
from kvfunc.core._pool import PoolState
from kvfunc.core._state import NULL_BLOCK, KVState, check_state
from kvfunc.core._tier_state import TieredState

__all__ = ["check_invariants"]


def check_invariants(state: KVState | TieredState) -> None:
    """Assert the invariants of a state; an ``AssertionError`` names the first broken one.

    * each group draws from one pool, and each pool's members are its groups;
    * the null block is never free; every other id of a pool is free, held by
      a table of its groups, or detached: ``free + held + detached ==
      num_blocks - 1``;
    * a table never holds an id out of range, and (without reference counts)
      never an id twice, nor one another table holds;
    * null entries only in tables of policies that skip tokens, as a prefix;
    * with reference counts: they equal table membership plus detached
      holders, and the free blocks are exactly those nobody holds;
    * with prefix caching: the hash index finds exactly the cached blocks, in
      both directions, and each row's ``shared`` and ``stored`` counters are
      sound;
    * for a :class:`~kvfunc.TieredState`, its device's and its tiers' books
      (:func:`~kvfunc.check_tiered_invariants`).

    >>> from kvfunc.core._policies import FullAttention
    >>> check_invariants(KVState.create({"f": FullAttention(num_blocks=5, block_size=4)}, 64))
    """
    if isinstance(state, TieredState):
        from kvfunc.core._tier_checks import check_tiered_invariants  # it imports this module

        check_tiered_invariants(state)
        return
    check_state(state)
    keys = state.manager_keys
    assert len(set(keys)) == len(keys), f"duplicate manager keys {keys}"
    for j, pool in enumerate(state.pools):
        members = [g for g in state.groups if g.pool == j]
        assert tuple(g.key for g in members) == pool.members, (
            f"pool {pool.name!r}: members {pool.members} are not its groups")
        _check_pool(pool, members)


def _check_pool(pool: PoolState, groups: list[GroupState]) -> None:
    n, name = pool.num_blocks, pool.name
    free = pool.free_block_ids()
    assert len(free) == pool.num_free, f"{name}: {len(free)} free ids, count {pool.num_free}"
    assert NULL_BLOCK not in free, f"{name}: null block in the free queue"
    assert len(set(free)) == len(free), f"{name}: a block is free twice"
    held: Counter[int] = Counter()
    for g in groups:
        for row in g.rows.values():
            _check_row(g, row)
            held.update(row.blocks)
    detached = dict(pool.detached.items())
    assert all(c > 0 for c in detached.values()), f"{name}: a detached count is not positive"
    assert all(0 < b < n for b in [*held, *free, *detached]), f"{name}: block id out of range"
    assert not set(held) & set(free), f"{name}: a block is free and held"
    assert not set(detached) & set(free), f"{name}: a block is free and detached"
    if not pool.linked:
        assert all(c == 1 for c in held.values()), f"{name}: a block is held twice"
        assert all(c == 1 for c in detached.values()), f"{name}: a block is detached twice"
        assert not set(held) & set(detached), f"{name}: a block is held and detached"
    else:
        with pool.reading() as store:  # one read of the arrays serves every check
            _check_refs(pool, store.refs, held, detached, free)
            _check_links(pool, store.prev, store.next)
            if pool.caching:
                _check_cache(pool, store.refs, store.hash_of, store.by_key, groups)
    total = len(free) + len(set(held) | set(detached))
    assert total == n - 1, (f"{name}: conservation broken: free {len(free)} + held or "
                            f"detached {total - len(free)} != {n - 1}")


def _check_row(g: GroupState, row: Any) -> None:
    assert row.nulls >= 0, f"{g.key}: a row's null count {row.nulls}"
    assert type(row.ids) is list and row.nulls <= row.length <= len(row.ids), (
        f"{g.key}: a row's length {row.length} does not fit its list")
    assert NULL_BLOCK not in row.blocks, f"{g.key}: a null entry after a real one"
    assert g.traits[2] != KEEPS_ALL or not row.nulls, (
        f"{g.key}: a null entry where every token is kept")


def _check_refs(pool: PoolState, refs: list[int], held: Counter[int], detached: dict[int, int],
                free: tuple[int, ...]) -> None:
    want = [0] * pool.num_blocks
    for b, c in held.items():
        want[b] += c
    for b, c in detached.items():
        want[b] += c
    assert list(refs) == want, f"{pool.name}: reference counts differ from the holders"
    nobody = {b for b in range(1, pool.num_blocks) if not want[b]}
    assert nobody == set(free), f"{pool.name}: the free blocks are not those nobody holds"


def _check_links(pool: PoolState, prev: list[int], nxt: list[int]) -> None:
    """A linked queue's links agree both ways; its markers come in priority order."""
    q = pool.queue
    s = q.sentinel
    assert s == pool.num_blocks, f"{pool.name}: the sentinel is {s}, not {pool.num_blocks}"
    walk, b = [s], nxt[s]
    while b != s and len(walk) <= len(nxt):
        assert prev[b] == walk[-1], f"{pool.name}: node {b}'s prev link is broken"
        walk.append(b)
        b = nxt[b]
    assert b == s and prev[s] == walk[-1], f"{pool.name}: the free queue is not one ring"
    marks = {m: p for p, m in q.levels}
    assert all(s < m < len(nxt) for m in marks), f"{pool.name}: a marker node out of range"
    order = [marks[m] for m in walk if m > s]
    assert order == sorted(order) and len(order) == len(marks), (
        f"{pool.name}: retention markers out of order: {order}")
    assert not marks or 0 in marks.values(), f"{pool.name}: markers without priority 0's"


def _check_cache(pool: PoolState, refs: list[int], hash_of: list[Any], index: dict[bytes, Any],
                 groups: list[GroupState]) -> None:
    """The index and ``hash_of`` agree; every row's counters are sound."""
    cached = {b: k for b, k in enumerate(hash_of) if k is not None}
    assert pool.num_cached == len(cached), f"{pool.name}: cached block count differs"
    indexed: dict[int, bytes] = {}
    for key, found in index.items():
        blocks = found if type(found) is tuple else (found,)
        assert len(blocks) == len(set(blocks)) and (type(found) is int or len(blocks) > 1), (
            f"{pool.name}: a malformed index entry {found!r}")
        for b in blocks:
            indexed[b] = key
    assert indexed == cached, f"{pool.name}: the hash index and the cached blocks differ"
    for g in groups:
        for row in g.rows.values():
            nulls, ids = row.nulls, row.ids
            done = min(max(row.stored, nulls), row.length)
            assert all(hash_of[ids[p]] is not None for p in range(nulls, done)), (
                f"{g.key}: a row's stored counter covers an uncached block")
            assert all(refs[ids[p]] <= 1
                       for p in range(max(row.shared, nulls), row.length)), (
                f"{g.key}: a row's shared counter misses a shared block")
