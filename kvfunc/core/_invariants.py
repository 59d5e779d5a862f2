"""``check_invariants``: everything a reachable state satisfies (tests call it every step)."""

from __future__ import annotations

from collections import Counter

from kvfunc.core._rows import Row, row_table
from kvfunc.core._state import NULL_BLOCK, GroupState, KVState, check_state

__all__ = ["check_invariants"]


def check_invariants(state: KVState) -> None:
    """Assert the invariants of a state; an ``AssertionError`` names the first broken one.

    * the null block is never free; every other id is free, held, or
      detached: ``free + held + detached == num_blocks - 1``;
    * a table never holds an id out of range, and (without prefix caching)
      never an id twice, nor one another table holds;
    * null entries only in tables of policies that skip tokens, as a prefix;
    * with prefix caching: reference counts equal table membership, the hash
      index finds every cached block, stacked free blocks hold nothing
      cached, and each row's ``shared`` and ``stored`` counters are sound.

    >>> from kvfunc.core._policy import FullAttention
    >>> check_invariants(KVState.create({"f": FullAttention(num_blocks=5, block_size=4)}, 64))
    """
    check_state(state)
    keys = state.manager_keys
    assert len(set(keys)) == len(keys), f"duplicate manager keys {keys}"
    slots = state.groups[0].slots if state.groups else None
    for g in state.groups:
        assert g.slots is slots, f"{g.key}: the groups do not share one slot map"
        _check_group(g)


def _check_group(g: GroupState) -> None:
    n = g.policy.num_blocks
    free = g.free_block_ids()
    assert len(free) == g.num_free, f"{g.key}: {len(free)} free ids, count {g.num_free}"
    assert NULL_BLOCK not in free, f"{g.key}: null block in the free queue"
    assert len(set(free)) == len(free), f"{g.key}: a block is free twice"
    rows = [r for r in g.rows if r is not None]
    assert len(rows) == g.num_rows, f"{g.key}: {len(rows)} rows, count {g.num_rows}"
    held: Counter[int] = Counter()
    skips = g.policy.window is not None or g.policy.may_skip
    for row in rows:
        _check_row(g, row, skips)
        held.update(b for b in row_table(row) if b)
    if g.cache is None:
        assert all(c == 1 for c in held.values()), f"{g.key}: a block is held twice"
    else:
        _check_cache(g, rows, held, free)
    assert not set(held) & set(free), f"{g.key}: a block is free and held"
    assert all(0 < b < n for b in [*held, *free]), f"{g.key}: block id out of range"
    total = len(free) + len(held) + g.num_detached
    assert total == n - 1, (f"{g.key}: conservation broken: free {len(free)} + held "
                            f"{len(held)} + detached {g.num_detached} != {n - 1}")


def _check_row(g: GroupState, row: Row, skips: bool) -> None:
    assert 0 <= row.nulls <= row.length <= len(row.ids), f"{g.key}: a row's counts {row[1:]}"
    table = row_table(row)
    assert NULL_BLOCK not in table[row.nulls:], f"{g.key}: a null entry after a real one"
    assert skips or not row.nulls, f"{g.key}: a null entry where every token is kept"


def _check_cache(g: GroupState, rows: list[Row], held: Counter[int], free: tuple[int, ...]
                 ) -> None:
    """Reference counts equal table membership; the hash index and the counters are sound."""
    cache = g.cache
    assert cache is not None
    counts = [0] * g.policy.num_blocks
    for b, c in held.items():
        counts[b] = c
    assert list(cache.refs) == counts, f"{g.key}: reference counts differ from the tables"
    hashes = {b: h for b, h in enumerate(cache.hash_of) if h is not None}
    assert cache.num_cached_blocks == len(hashes), f"{g.key}: cached block count differs"
    missing = [b for b, h in hashes.items() if b not in cache.by_hash.get(h, ())]
    assert not missing, f"{g.key}: cached blocks {missing} missing from the hash index"
    stacked = cache.stack_ids()
    assert all(b not in hashes for b in stacked), f"{g.key}: a stacked free block is cached"
    for row in rows:
        ids = row.ids
        done = max(row.stored, row.nulls)
        assert all(ids[p] in hashes for p in range(row.nulls, min(done, row.length))), (
            f"{g.key}: a row's stored counter covers an uncached block")
        assert all(counts[ids[p]] <= 1 for p in range(max(row.shared, row.nulls), row.length)), (
            f"{g.key}: a row's shared counter misses a shared block")
