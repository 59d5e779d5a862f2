"""The free queue: a ring of chunks that only moves at its ends.

Theory of operation
-------------------
A group's free block ids wait in a ring: a persistent vector of fixed-size
tuples (``FREE_CHUNK`` ids each) with a head position and an entry count.
Blocks are handed out at the head and freed ones re-enter at the tail,
exactly the seed's FIFO.  Popping only moves the head and pushing a run of
ids rewrites one or two chunks, so a transition shares every other chunk with
the state it came from and pays one vector update per touched chunk, not one
per block.

:class:`RingCopy` is the working copy one transition edits: chunks it writes
are copied into plain lists (``dirty``) on first write and frozen back into
the vector once, by :meth:`RingCopy.frozen`.

With prefix caching (``_cache``) the ring holds the free blocks that hold a
cached block, least recently freed first (the uncached ones wait on a stack
and go first), and may hold *stale* entries (a prefix hit took a free block
out of the middle); the caching pool skips them when it pops.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from pyrsistent import PVector, pvector

__all__ = ["FREE_CHUNK", "RingCopy", "new_ring", "ring_entries"]

FREE_CHUNK = 64


def new_ring(ids: Sequence[int], room: int) -> PVector[tuple[int, ...]]:
    """A ring holding ``ids`` from position 0, with room for ``room`` entries (padded with 0).

    >>> len(new_ring([1, 2, 3], 100))
    2
    """
    chunks = max(1, -(-room // FREE_CHUNK))
    padded = list(ids) + [0] * (chunks * FREE_CHUNK - len(ids))
    return pvector(tuple(padded[i:i + FREE_CHUNK]) for i in range(0, len(padded), FREE_CHUNK))


def ring_entries(ring: PVector[tuple[int, ...]], head: int, count: int) -> Iterator[int]:
    """The first ``count`` entries of a published ring from ``head`` (O(count)).

    >>> list(ring_entries(new_ring([4, 5, 6], 8), 1, 2))
    [5, 6]
    """
    cap = len(ring) * FREE_CHUNK
    for i in range(count):
        p = (head + i) % cap
        yield ring[p // FREE_CHUNK][p % FREE_CHUNK]


class RingCopy:
    """The working copy of one ring (see the module docstring)."""

    __slots__ = ("cap", "dirty", "head", "ring")

    def __init__(self, ring: PVector[tuple[int, ...]], head: int) -> None:
        self.ring = ring
        self.head = head
        self.cap = len(ring) * FREE_CHUNK
        self.dirty: dict[int, list[int]] | None = None

    def chunk(self, index: int) -> Any:
        """The current contents of chunk ``index``."""
        dirty = self.dirty
        if dirty is not None:
            chunk = dirty.get(index)
            if chunk is not None:
                return chunk
        return self.ring[index]

    def pop(self, n: int) -> list[int]:
        """The ``n`` entries from the head, moving the head past them (caller checked)."""
        h, cap = self.head, self.cap
        index, off = divmod(h, FREE_CHUNK)
        if off + n <= FREE_CHUNK:  # the common case: one chunk
            dirty = self.dirty
            chunk: Any = dirty.get(index) if dirty is not None else None
            if chunk is None:
                chunk = self.ring[index]
            out = list(chunk[off:off + n])
            h += n
        else:
            out = []
            while len(out) < n:
                index, off = divmod(h, FREE_CHUNK)
                m = min(n - len(out), FREE_CHUNK - off)
                out.extend(self.chunk(index)[off:off + m])
                h += m
                if h == cap:
                    h = 0
        self.head = h if h != cap else 0
        return out

    def write(self, pos: int, new: Sequence[int]) -> None:
        """Write ``new`` into the ring from position ``pos`` on (chunks copied on first write)."""
        dirty = self.dirty
        if dirty is None:
            dirty = self.dirty = {}
        cap = self.cap
        i = 0
        while i < len(new):
            index, off = divmod(pos, FREE_CHUNK)
            m = min(len(new) - i, FREE_CHUNK - off)
            chunk = dirty.get(index)
            if chunk is None:
                chunk = dirty[index] = list(self.ring[index])
            chunk[off:off + m] = new[i:i + m]
            i += m
            pos += m
            if pos == cap:
                pos = 0

    def entries(self, count: int) -> list[int]:
        """The first ``count`` entries from the head (O(count); for checks, not the hot path)."""
        h, cap = self.head, self.cap
        out = []
        for i in range(count):
            p = (h + i) % cap
            out.append(self.chunk(p // FREE_CHUNK)[p % FREE_CHUNK])
        return out

    def reset(self, ids: Sequence[int]) -> None:
        """Rewrite the ring to hold exactly ``ids`` from position 0 (same room)."""
        self.ring = new_ring(ids, self.cap)
        self.dirty = None
        self.head = 0

    def frozen(self) -> PVector[tuple[int, ...]]:
        """The ring as a persistent vector (the dirty chunks written back once)."""
        if self.dirty:
            ev = self.ring.evolver()
            for index, chunk in self.dirty.items():
                ev[index] = tuple(chunk)
            self.ring = ev.persistent()
        self.dirty = None
        return self.ring
