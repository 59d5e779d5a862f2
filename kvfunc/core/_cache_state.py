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

``by_hash`` maps a block hash to the blocks cached under it, in the order
they were stored.  It is a two-level table of ``FANOUT x FANOUT`` small
plain dicts, indexed by the hash's first two bytes (a hash is a uniform
digest); a transition copies, on first write, the outer tuple, one inner
tuple and one dict, so a write costs a few hundred nanoseconds whatever the
cache size, and reads run at dict speed, unlike a persistent map.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import attrs
from pyrsistent import PVector, pvector

__all__ = ["FANOUT", "GroupCache", "HashIndex", "empty_index", "live_ids"]

FANOUT = 64
_MASK = FANOUT - 1
HashIndex = tuple[tuple[dict[bytes, tuple[int, ...]], ...], ...]


def empty_index() -> HashIndex:
    """An index with nothing cached (fresh dicts: a published index is never edited)."""
    return tuple(tuple({} for _ in range(FANOUT)) for _ in range(FANOUT))


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


def shard_of(index: HashIndex, block_hash: bytes) -> dict[bytes, tuple[int, ...]]:
    """The dict of ``index`` that holds ``block_hash``."""
    return index[block_hash[0] & _MASK][block_hash[1] & _MASK]


@attrs.frozen(slots=True, eq=False)
class GroupCache:
    """Reference counts, block hashes and the hash index of one group.

    Attributes:
        refs: per block id, the number of table entries holding it.
        hash_of: per block id, the hash of the full block it caches, or None.
        by_hash: the hash index, ``FANOUT x FANOUT`` dicts ``{hash: (block ids...)}``;
            published dicts are never changed.
        stale: per block id, its stale ring entries.
        num_entries: ring entries from the head, live and stale.
    """

    refs: PVector[int]
    hash_of: PVector[bytes | None]
    by_hash: HashIndex
    stale: PVector[int]
    num_entries: int

    @classmethod
    def create(cls, num_blocks: int) -> GroupCache:
        """Nothing held, nothing cached; the ring holds ``num_blocks - 1`` live entries.

        >>> GroupCache.create(4).num_cached()
        0
        """
        zeros = pvector([0] * num_blocks)
        return cls(zeros, pvector([None] * num_blocks), empty_index(), zeros, num_blocks - 1)

    def blocks_for(self, block_hash: bytes) -> tuple[int, ...]:
        """Blocks cached under ``block_hash`` (oldest first); ``()`` when none."""
        return shard_of(self.by_hash, block_hash).get(block_hash, ())

    def num_cached(self) -> int:
        """Blocks that hold a cached full block (held or evictable)."""
        return sum(len(v) for row in self.by_hash for shard in row for v in shard.values())

    def cached(self) -> dict[bytes, tuple[int, ...]]:
        """The whole hash index as one dict (for checks and tests)."""
        out: dict[bytes, tuple[int, ...]] = {}
        for row in self.by_hash:
            for shard in row:
                out.update(shard)
        return out

    def live_entries(self, ring: PVector[tuple[int, ...]], head: int, cap: int) -> Iterator[int]:
        """The live ring entries from ``head``: the free queue in hand-out order."""
        from kvfunc.core._state import FREE_CHUNK

        return live_ids(lambda c: ring[c], FREE_CHUNK, head, cap, self.num_entries, self.stale)

    def identity(self) -> tuple[Any, ...]:
        """What equality compares (the ring layout and stale entries do not count)."""
        cached: Mapping[bytes, tuple[int, ...]] = self.cached()
        return (tuple(self.refs), tuple(self.hash_of), cached)
