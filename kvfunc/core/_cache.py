"""A caching group's extra state: reference counts, the hash store, the eviction order.

Theory of operation
-------------------
With prefix caching a block can sit in several tables (a shared prefix, a
forked request), so a group counts references: ``refs[b]`` is the number of
table entries that hold ``b``.  A block whose count drops to 0 is free again.
If it holds a cached full block it keeps its hash while it waits, so a later
request can still hit it, until the block is handed out again: then it is
*evicted*.  Eviction happens only when a block is needed.

The free blocks wait in two places, and the order they are handed out in is
the eviction order:

1. ``stack``: free blocks that hold nothing cached, handed out first, the
   most recently freed first (the initial pool is stacked so that blocks
   ``1, 2, 3, ...`` come out in order);
2. the group's ring (``_pool``): free blocks that hold a cached block, in
   least-recently-freed order, evicted as they are handed out.

A hit on a free cached block takes it out of the *middle* of the ring.  The
ring only moves at its ends, so the entry is not removed: it turns *stale*.
``stale[b]`` counts the ring entries of ``b`` that are not its live one;
blocks only enter the ring at its tail, so a block's entries are in time
order and the live one is the last, and popping an entry of ``b`` while
``stale[b] > 0`` just drops a stale entry.  ``ring_entries`` counts live and
stale entries; the ring has twice the room of the pool and is compacted when
full, so a stale entry costs O(1) amortised.

``hash_of`` is the truth about what is cached.  Finding a block by its hash
goes through ``by_hash``, a plain dict ``{hash: [block ids]}`` of
*candidates* that every state of one lineage shares and that only ever
grows: storing ``b`` under ``h`` appends ``b`` to ``h``'s list once, and
evicting ``b`` only clears ``hash_of[b]``.  A state's blocks for ``h`` are
the candidates ``b`` with ``hash_of[b] == h``, ascending, so old states are
not changed by what later states store.  When the candidates outnumber the
blocks twice over, a transition starts a fresh dict of its valid entries
(older states keep the old one); a cache reset starts an empty one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
from pyrsistent import PVector, pvector

__all__ = ["GroupCache", "HashIndex", "index_of", "live_ring_ids", "valid_blocks"]

HashIndex = dict[bytes, list[int]]


def index_of(hash_of: Any) -> HashIndex:
    """A fresh candidate index holding exactly the blocks ``hash_of`` caches.

    >>> index_of([None, b"x", None, b"x"])
    {b'x': [1, 3]}
    """
    index: HashIndex = {}
    for b, h in enumerate(hash_of):
        if h is not None:
            have = index.get(h)
            if have is None:
                index[h] = [b]
            else:
                have.append(b)
    return index


def valid_blocks(index: HashIndex, hash_of: Any, block_hash: bytes) -> tuple[int, ...]:
    """The candidates of ``block_hash`` that ``hash_of`` still caches under it, ascending.

    >>> valid_blocks({b"x": [3, 1]}, [None, b"x", None, b"y"], b"x")
    (1,)
    """
    found = index.get(block_hash)
    if found is None:
        return ()
    if len(found) == 1:
        b = found[0]
        return (b,) if hash_of[b] == block_hash else ()
    valid = [b for b in found if hash_of[b] == block_hash]
    # ascending: a hit takes the lowest id, live or replayed; set: two transitions of one
    # lineage racing on the shared dict may both append a block
    return tuple(sorted(set(valid))) if len(valid) > 1 else tuple(valid)


def live_ring_ids(chunk: Callable[[int], Sequence[int]], chunk_size: int, head: int, cap: int,
                  num_entries: int, stale: Any) -> Iterator[int]:
    """The live entries of a ring holding stale ones (see the module docstring).

    ``chunk(i)`` reads the ring's ``i``-th chunk; ``stale[b]`` counts the
    entries of ``b`` to skip (they come before its live one).

    >>> list(live_ring_ids(lambda i: (5, 6, 5, 7), 4, 0, 4, 4, [0, 0, 0, 0, 0, 1, 0, 0]))
    [6, 5, 7]
    """
    seen: dict[int, int] = {}
    for i in range(num_entries):
        p = (head + i) % cap
        b = chunk(p // chunk_size)[p % chunk_size]
        s = stale[b]
        if s:
            n = seen.get(b, 0)
            if n < s:
                seen[b] = n + 1
                continue
        yield b


@attrs.frozen(slots=True, eq=False)
class GroupCache:
    """Reference counts, cached hashes and the eviction order of one group.

    Attributes:
        refs: per block id, the number of table entries holding it.
        hash_of: per block id, the hash of the full block it caches, or None.
        by_hash: the shared candidate index ``{hash: [block ids]}`` (it only
            grows; ``hash_of`` decides which candidates are cached).
        stale: per block id, its stale ring entries.
        ring_entries: ring entries from the head, live and stale.
        stack: the free blocks that hold nothing cached; the top is at
            ``stack_top - 1`` and is handed out first.
        stack_top: how many blocks the stack holds.
        num_cached_blocks: blocks whose ``hash_of`` is set.
        num_candidates: an upper bound on ``by_hash``'s candidates (a fresh
            index is built when it passes twice the blocks).
    """

    refs: PVector[int]
    hash_of: PVector[bytes | None]
    by_hash: HashIndex
    stale: PVector[int]
    ring_entries: int
    stack: PVector[int]
    stack_top: int
    num_cached_blocks: int = 0
    num_candidates: int = 0

    @classmethod
    def create(cls, num_blocks: int) -> GroupCache:
        """Nothing held, nothing cached: every block but the null one on the stack, 1 on top.

        >>> c = GroupCache.create(4)
        >>> c.stack_top, list(c.stack), c.num_cached_blocks
        (3, [3, 2, 1], 0)
        """
        zeros = pvector([0] * num_blocks)
        stack = pvector(range(num_blocks - 1, 0, -1))
        return cls(zeros, pvector([None] * num_blocks), {}, zeros, 0, stack, num_blocks - 1)

    def stack_ids(self) -> list[int]:
        """The stacked free blocks in hand-out order (top first)."""
        return [self.stack[i] for i in range(self.stack_top - 1, -1, -1)]

    def cached(self) -> dict[bytes, tuple[int, ...]]:
        """The cached blocks as ``{hash: block ids ascending}`` (for checks and tests)."""
        return {h: tuple(blocks) for h, blocks in index_of(self.hash_of).items()}

    def identity(self) -> tuple[Any, ...]:
        """What equality compares (the ring layout and stale entries do not count)."""
        return (tuple(self.refs), tuple(self.hash_of))  # the index is a function of hash_of
