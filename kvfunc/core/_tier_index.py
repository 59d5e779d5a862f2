"""A lower tier's index: block hash -> entry, and an eviction order by retention priority.

Theory of operation
-------------------
A :class:`TierIndex` is one tier's directory of the blocks it holds: each
block hash maps to a :class:`TierEntry` (its block in the tier, or ``-1`` in
a tier without block ids, its retention priority, its last-use tick and its
pins).  The eviction order takes the lowest priority first and, within one
priority, the least recently used::

    order   priority 0:  tick 3 -> h7   tick 9 -> h2      <- evicted first (h7)
            priority 5:  tick 4 -> h1

Each priority keeps its own persistent map from tick to hash and a *head*,
the lowest tick that may still be present: a victim is found by walking up
from the head, and the head stays where the walk stopped, so the walk costs
each tick once over a lineage of states.  A pinned entry (a move is reading
it) is out of the order until its last pin goes, when it re-enters as used
now.  Every operation returns a new index; nothing is mutated.
"""

from __future__ import annotations

from typing import NamedTuple

import immutables

__all__ = ["TierEntry", "TierIndex"]

_EMPTY_MAP: immutables.Map[int, bytes] = immutables.Map()


class TierEntry(NamedTuple):
    """One block of a tier: where it is, what it is worth keeping, when it was last used.

    >>> TierIndex.create().add(b"h", 7, 2).get(b"h")
    TierEntry(block=7, priority=2, tick=0, pins=0)
    """

    block: int
    priority: int
    tick: int
    pins: int


class TierIndex(NamedTuple):
    """Hash -> entry, and per priority the evictable entries by last use (see the module).

    >>> ix = TierIndex.create().add(b"a", 1, 0).add(b"b", 2, 5).add(b"c", 3, 0)
    >>> ix.victim(), ix.remove(b"a").victim(), ix.pin(b"a").victim()
    (b'a', b'c', b'c')
    >>> ix.pin(b"a").unpin(b"a").victim()      # used again: now the newest of priority 0
    b'c'
    """

    entries: immutables.Map[bytes, TierEntry]
    order: immutables.Map[int, immutables.Map[int, bytes]]
    heads: immutables.Map[int, int]
    clock: int

    @classmethod
    def create(cls) -> TierIndex:
        """An empty index."""
        return cls(immutables.Map(), immutables.Map(), immutables.Map(), 0)

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, digest: bytes) -> TierEntry | None:
        """The entry of ``digest``, or None."""
        return self.entries.get(digest)

    def add(self, digest: bytes, block: int, priority: int) -> TierIndex:
        """``digest`` held in ``block`` at ``priority``, evictable, used now (must be absent)."""
        assert digest not in self.entries, digest
        entry = TierEntry(block, priority, self.clock, 0)
        return self._enter(self.entries.set(digest, entry), digest, entry)

    def remove(self, digest: bytes) -> TierIndex:
        """The index without ``digest`` (which must be present)."""
        entry = self.entries[digest]
        order, heads = self.order, self.heads
        if not entry.pins:
            order, heads = _leave(order, heads, entry)
        return TierIndex(self.entries.delete(digest), order, heads, self.clock)

    def pin(self, digest: bytes) -> TierIndex:
        """One more reader of ``digest``: out of the eviction order until unpinned."""
        entry = self.entries[digest]
        order, heads = self.order, self.heads
        if not entry.pins:
            order, heads = _leave(order, heads, entry)
        pinned = entry._replace(pins=entry.pins + 1)
        return TierIndex(self.entries.set(digest, pinned), order, heads, self.clock)

    def unpin(self, digest: bytes) -> TierIndex:
        """One reader fewer; the last one puts the entry back in the order, used now."""
        entry = self.entries[digest]
        assert entry.pins > 0, digest
        if entry.pins > 1:
            pinned = entry._replace(pins=entry.pins - 1)
            return TierIndex(self.entries.set(digest, pinned), self.order, self.heads, self.clock)
        entry = entry._replace(pins=0, tick=self.clock)
        return self._enter(self.entries.set(digest, entry), digest, entry)

    def victim(self) -> bytes | None:
        """The next hash to evict: lowest priority, then least recently used; None if none."""
        for priority in sorted(self.order.keys()):
            level = self.order[priority]
            tick = self.heads[priority]
            while tick not in level:
                tick += 1
            return level[tick]
        return None

    def _enter(self, entries: immutables.Map[bytes, TierEntry], digest: bytes,
               entry: TierEntry) -> TierIndex:
        level = self.order.get(entry.priority, _EMPTY_MAP)
        heads = self.heads
        if not level:
            heads = heads.set(entry.priority, entry.tick)
        order = self.order.set(entry.priority, level.set(entry.tick, digest))
        return TierIndex(entries, order, heads, self.clock + 1)


def _leave(order: immutables.Map[int, immutables.Map[int, bytes]],
           heads: immutables.Map[int, int], entry: TierEntry
           ) -> tuple[immutables.Map[int, immutables.Map[int, bytes]], immutables.Map[int, int]]:
    """The order without ``entry``; an emptied priority leaves, a head moves past it."""
    level = order[entry.priority].delete(entry.tick)
    if not level:
        return order.delete(entry.priority), heads.delete(entry.priority)
    if heads[entry.priority] == entry.tick:
        tick = entry.tick + 1
        while tick not in level:
            tick += 1
        heads = heads.set(entry.priority, tick)
    return order.set(entry.priority, level), heads
