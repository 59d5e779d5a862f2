"""A caching group's extra state: reference counts and the prefix cache.

Theory of operation
-------------------
With prefix caching a block can sit in several tables (a shared prefix, a
forked request), so a group counts references: ``refs[b]`` is the number of
table entries that hold ``b``.  A block whose count drops to 0 goes to the
tail of the free queue as before; if it holds a full cached block it keeps
its hash there, so a later request can still hit it, until the block is
handed out again (then it is *evicted*).  The free queue is therefore the
LRU order of evictable blocks, and eviction happens only when a block is
needed.

A hit on a free block takes it out of the *middle* of the queue.  The queue
is a ring that only moves at its ends, so the entry is not removed: it turns
*stale*.  ``stale[b]`` counts the ring entries of ``b`` that are not its live
one; entries of a block are in time order and the live one is always the
last, so popping an entry of ``b`` while ``stale[b] > 0`` just drops a stale
entry.  ``num_entries`` counts live and stale entries; the ring has twice
the room a plain group's has and is compacted when full, so a stale entry
costs O(1) amortised.

``hash_of`` is the truth about what is cached.  Finding a block by its
hash goes through ``by_hash``, a plain dict ``{hash: [block ids]}`` of
*candidates* that every state of one lineage shares and that only ever
grows: storing ``b`` under ``h`` appends ``b`` to ``h``'s list (once), and
evicting ``b`` only clears ``hash_of[b]``.  A state's blocks for ``h`` are
the candidates ``b`` with ``hash_of[b] == h``, ascending, so a lookup reads
only that state's own (persistent) ``hash_of`` and old states are not
changed by what later states store: a candidate a later state added is
rejected by the old ``hash_of``.  Stores and evictions cost a dict append
and a vector write, with no copying.  When the candidates outnumber the
blocks twice over (``num_candidates`` bounds this lineage's own, and a list
grown long counts as many), a transition starts a fresh dict of its valid
entries (older states keep the old one); a transition that finds the dict
grown past that by others (transitions that were thrown away) starts its
own before its first write, so the dict stays bounded.  A cache reset
starts an empty one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
from pyrsistent import PVector, pvector

__all__ = ["GroupCache", "HashIndex", "index_of", "live_ids", "valid_blocks"]

HashIndex = dict[bytes, list[int]]


def index_of(hash_of: Any) -> HashIndex:
    """A fresh candidate index holding exactly the blocks ``hash_of`` caches."""
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
    """The candidates of ``block_hash`` that ``hash_of`` still caches under it, ascending."""
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


def live_ids(chunk: Callable[[int], Sequence[int]], chunk_size: int, head: int, cap: int,
             num_entries: int, stale: Any) -> Iterator[int]:
    """The live entries of a ring holding stale ones (see the module docstring).

    ``chunk(i)`` reads the ring's ``i``-th chunk; ``stale[b]`` counts the
    entries of ``b`` to skip (they come before its live one).
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
    """Reference counts, block hashes and the hash index of one group.

    Attributes:
        refs: per block id, the number of table entries holding it.
        hash_of: per block id, the hash of the full block it caches, or None.
        by_hash: the shared candidate index ``{hash: [block ids]}`` (it only
            grows; ``hash_of`` decides which candidates are cached).
        stale: per block id, its stale ring entries.
        num_entries: ring entries from the head, live and stale.
        num_cached_blocks: blocks whose ``hash_of`` is set.
        num_candidates: an upper bound on ``by_hash``'s candidates: the cached
            blocks it was built with plus the stores since (a fresh index is
            built when it passes twice the blocks).
    """

    refs: PVector[int]
    hash_of: PVector[bytes | None]
    by_hash: HashIndex
    stale: PVector[int]
    num_entries: int
    num_cached_blocks: int = 0
    num_candidates: int = 0

    @classmethod
    def create(cls, num_blocks: int) -> GroupCache:
        """Nothing held, nothing cached; the ring holds ``num_blocks - 1`` live entries.

        >>> GroupCache.create(4).num_cached()
        0
        """
        zeros = pvector([0] * num_blocks)
        return cls(zeros, pvector([None] * num_blocks), {}, zeros, num_blocks - 1)

    def num_cached(self) -> int:
        """Blocks that hold a cached full block (held or evictable)."""
        return self.num_cached_blocks

    def cached(self) -> dict[bytes, tuple[int, ...]]:
        """The cached blocks as one dict ``{hash: block ids ascending}`` (for checks and tests)."""
        return {h: tuple(blocks) for h, blocks in index_of(self.hash_of).items()}

    def live_entries(self, ring: PVector[tuple[int, ...]], head: int, cap: int) -> Iterator[int]:
        """The live ring entries from ``head``: the free queue in hand-out order."""
        from kvfunc.core._state import FREE_CHUNK

        return live_ids(lambda c: ring[c], FREE_CHUNK, head, cap, self.num_entries, self.stale)

    def identity(self) -> tuple[Any, ...]:
        """What equality compares (the ring layout and stale entries do not count)."""
        return (tuple(self.refs), tuple(self.hash_of))  # the index is a function of hash_of
