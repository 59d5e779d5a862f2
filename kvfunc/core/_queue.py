"""Free queues: the order a pool hands its free blocks out in.

Theory of operation
-------------------
Two orders, each a persistent value with a working copy that one transition
edits and freezes once:

* :class:`Ring` -- the seed's FIFO.  Blocks leave at the head and freed
  ones re-enter at the tail.  The ids wait in a persistent vector of
  fixed-size chunks (``CHUNK`` ids each) with a head position and a count,
  so popping only moves the head and pushing a run rewrites one or two
  chunks: a transition shares every other chunk with the state it came from.
* :class:`Linked` -- vLLM's free block queue: a doubly linked list over
  block ids, kept as two persistent vectors ``prev`` and ``next`` with one
  sentinel (index ``num_blocks``).  Blocks leave at the front; a freed block
  re-enters at the front (reused first) or at the back (evicted last), and a
  block can leave from the middle (a prefix hit on a free cached block).

A run of blocks freed by one call enters in one push (``push_front`` keeps
the run's order at the front, as vLLM's ``prepend_n`` does); a delta records
such a run as consecutive Freed rows and replay pushes it as one run.

Retention priority (linked queues only): a run pushed at the back with a
priority other than 0 waits behind every block of a lower priority.  The
queue then holds one *marker* node per priority in use, 0 included (ids
after the sentinel), each at the start of its priority's segment; blocks
that cache nothing, pushed at the front, come before every marker::

    sentinel -> [uncached] <-1> [priority -1] <0> [priority 0] <5> [priority 5] -> sentinel

so the front is still the block handed out next: one that caches nothing,
else the least recently freed of the lowest priority.  The first marker (0)
goes before the first queued block that caches something.  A queue that
never saw a priority has no markers and is exactly vLLM's.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from pyrsistent import PVector, pvector

from kvfunc.core._untracked import atomic, forget, open_evolvers, untrack, watch, watching

__all__ = ["CHUNK", "Linked", "LinkedCopy", "Ring", "RingCopy"]

CHUNK = 64

class Ring:
    """The seed's FIFO as a value: ``chunks`` of ids, the ``head`` position, ``count`` ids."""

    __slots__ = ("chunks", "count", "head")

    def __init__(self, chunks: PVector[tuple[int, ...]], head: int, count: int) -> None:
        self.chunks, self.head, self.count = chunks, head, count

    @classmethod
    def of(cls, ids: Sequence[int], room: int) -> Ring:
        """A ring holding ``ids`` from position 0, with room for ``room`` ids.

        >>> list(Ring.of([4, 5, 6], 8).ids())
        [4, 5, 6]
        """
        n = max(1, -(-room // CHUNK))
        padded = list(ids) + [0] * (n * CHUNK - len(ids))
        chunks = pvector(tuple(padded[i:i + CHUNK]) for i in range(0, len(padded), CHUNK))
        return cls(chunks, 0, len(ids))

    def ids(self) -> Iterator[int]:
        """The ids in hand-out order (O(count))."""
        chunks, cap = self.chunks, len(self.chunks) * CHUNK
        for i in range(self.count):
            p = (self.head + i) % cap
            yield chunks[p // CHUNK][p % CHUNK]

    def layout(self) -> tuple[int, ...]:
        """The ids in hand-out order, as a tuple (for equality)."""
        return tuple(self.ids())

    def copy(self) -> RingCopy:
        """A working copy (chunks are copied into lists on first write)."""
        return RingCopy(self)


class RingCopy:
    """The working copy of a :class:`Ring`."""

    __slots__ = ("cap", "chunks", "count", "dirty", "head", "src")

    def __init__(self, ring: Ring) -> None:
        self.src = ring
        self.chunks, self.head, self.count = ring.chunks, ring.head, ring.count
        self.cap = len(ring.chunks) * CHUNK
        self.dirty: dict[int, list[int]] = {}

    def _chunk(self, index: int) -> Any:
        chunk = self.dirty.get(index)
        return self.chunks[index] if chunk is None else chunk

    def pop(self, n: int) -> list[int]:
        """The ``n`` ids at the head (the caller checked ``n <= count``)."""
        h = self.head
        index, off = h // CHUNK, h % CHUNK  # cheaper than ``divmod``'s call and tuple
        if off + n <= CHUNK:  # the common case: one chunk (``_chunk`` inlined)
            chunk: Any = self.dirty.get(index) or self.chunks[index]  # a chunk is never empty
            out = list(chunk[off:off + n])
            h += n
        else:
            out = []
            while len(out) < n:
                index, off = divmod(h, CHUNK)
                m = min(n - len(out), CHUNK - off)
                out.extend(self._chunk(index)[off:off + m])
                h = (h + m) % self.cap
        self.head = h % self.cap
        self.count -= n
        return out

    def push_back(self, ids: Sequence[int]) -> None:
        """Append ``ids`` at the tail, in order."""
        pos, i, dirty = (self.head + self.count) % self.cap, 0, self.dirty
        while i < len(ids):
            index, off = divmod(pos, CHUNK)
            m = min(len(ids) - i, CHUNK - off)
            chunk = dirty.get(index)
            if chunk is None:
                chunk = dirty[index] = list(self.chunks[index])
            chunk[off:off + m] = ids[i:i + m]
            i += m
            pos = (pos + m) % self.cap
        self.count += len(ids)

    def ids(self) -> list[int]:
        """The ids in hand-out order (O(count); for checks)."""
        out = []
        for i in range(self.count):
            p = (self.head + i) % self.cap
            out.append(self._chunk(p // CHUNK)[p % CHUNK])
        return out

    def frozen(self) -> Ring:
        """The queue as a value (dirty chunks written back once)."""
        src = self.src
        if not self.dirty and self.head == src.head and self.count == src.count:
            return src
        if self.dirty:
            ev = self.chunks.evolver()
            for index, chunk in self.dirty.items():
                ev[index] = tuple(chunk)
            self.chunks = ev.persistent()
            self.dirty = {}
        self.src = Ring(self.chunks, self.head, self.count)
        return self.src


class Linked:
    """vLLM's free queue as a value: ``prev`` / ``next`` links over the blocks and a sentinel.

    ``levels`` pairs each retention priority in use with its marker node, by
    priority (see the module docstring); the sentinel is ``len(next) - 1 - len(levels)``.
    """

    __slots__ = ("count", "levels", "next", "prev")

    def __init__(self, prev: PVector[int], nxt: PVector[int], count: int,
                 levels: tuple[tuple[int, int], ...] = ()) -> None:
        self.prev, self.next, self.count, self.levels = prev, nxt, count, levels

    @property
    def sentinel(self) -> int:
        """The sentinel node (also the number of blocks)."""
        return len(self.next) - 1 - len(self.levels)

    @classmethod
    def of(cls, ids: Sequence[int], num_blocks: int) -> Linked:
        """A queue holding ``ids`` in order over blocks ``0 .. num_blocks - 1``.

        >>> list(Linked.of([3, 1, 2], 4).ids())
        [3, 1, 2]
        """
        s = num_blocks
        prev, nxt = [s] * (s + 1), [s] * (s + 1)
        last = s
        for b in ids:
            prev[b], nxt[last] = last, b
            last = b
        nxt[last], prev[s] = s, last
        return cls(atomic(pvector(prev)), atomic(pvector(nxt)), len(ids))

    def ids(self) -> Iterator[int]:
        """The ids front to back (O(count); markers skipped)."""
        s = self.sentinel
        return (b for b in _walk(self.next, s) if b < s)

    def layout(self) -> tuple[Any, ...]:
        """The whole order, markers shown as ``("priority", p)`` (for equality and checks).

        >>> q = Linked.of([1, 2], 3).copy()
        >>> q.push_back([0], 4, cached=[None, None, b"k"])  # block 2 caches something
        >>> q.frozen().layout()
        (1, ('priority', 0), 2, ('priority', 4), 0)
        """
        s, marks = self.sentinel, {m: p for p, m in self.levels}
        return tuple(b if b < s else ("priority", marks[b]) for b in _walk(self.next, s))

    def copy(self) -> LinkedCopy:
        """A working copy (the link vectors turn into evolvers on first write)."""
        return LinkedCopy(self)


class LinkedCopy:
    """The working copy of a :class:`Linked` queue."""

    __slots__ = ("count", "levels", "next", "prev", "sentinel", "src", "writable")

    def __init__(self, queue: Linked) -> None:
        self.src = queue
        self.prev: Any = queue.prev
        self.next: Any = queue.next
        self.count = queue.count
        self.levels = queue.levels
        self.sentinel = queue.sentinel
        self.writable = False

    def _write(self) -> None:
        self.prev, self.next, self.writable = self.prev.evolver(), self.next.evolver(), True
        if watching():  # see ``kvfunc.core._untracked``: the collector skips them
            watch(self.prev, self.next)

    def pop(self, n: int) -> list[int]:
        """The ``n`` blocks at the front (the caller checked ``n <= count``)."""
        if not self.writable:
            self._write()
        nxt, s = self.next, self.sentinel
        out: list[int] = []
        b = nxt[s]
        if self.levels:  # markers stay where they are
            while len(out) < n:
                if b < s:
                    out.append(b)
                    self.remove(b)
                b = nxt[b]
            return out
        for _ in range(n):
            out.append(b)
            b = nxt[b]
        nxt[s] = b
        self.prev[b] = s
        self.count -= n
        return out

    def push_front(self, ids: Sequence[int]) -> None:
        """Put ``ids`` at the front, ``ids[0]`` first (vLLM's ``prepend_n``)."""
        if ids:
            self._link(self.sentinel, ids)

    def push_back(self, ids: Sequence[int], priority: int = 0, cached: Any = None) -> None:
        """Put ``ids`` at the back of ``priority``'s segment, in order (vLLM's ``append_n``).

        ``cached`` (block -> key or None) places the first markers after the
        blocks at the front that cache nothing (see the module docstring).
        """
        if not ids:
            return
        if not priority and not self.levels:
            self._link(self.prev[self.sentinel], ids)
            return
        if not self.writable:
            self._write()
        levels = self.levels or self._first_level(cached)
        following = next((m for p, m in levels if p > priority), self.sentinel)
        if all(p != priority for p, _ in levels):
            self._add_marker(priority, following)
        self._link(self.prev[following], ids)

    def _first_level(self, cached: Any) -> tuple[tuple[int, int], ...]:
        """Priority 0's marker, before the first queued block that caches something."""
        nxt, s, b = self.next, self.sentinel, self.next[self.sentinel]
        while b != s and cached is not None and cached[b] is None:
            b = nxt[b]
        self._add_marker(0, b)
        return self.levels

    def _add_marker(self, priority: int, before: int) -> None:
        """Link a marker for ``priority`` right before node ``before``."""
        prev, nxt = self.prev, self.next
        m, after = len(nxt), prev[before]
        prev.append(after)
        nxt.append(before)
        nxt[after] = prev[before] = m
        self.levels = tuple(sorted((*self.levels, (priority, m))))

    def _link(self, last: int, ids: Sequence[int]) -> None:
        """Link ``ids``, in order, between block ``last`` (or the sentinel) and its next."""
        if not self.writable:
            self._write()
        prev, nxt = self.prev, self.next
        following = nxt[last]
        for b in ids:
            prev[b], nxt[last] = last, b
            last = b
        nxt[last], prev[following] = following, last
        self.count += len(ids)

    def remove(self, b: int) -> None:
        """Take block ``b`` out of the middle of the queue (it must be queued)."""
        if not self.writable:
            self._write()
        prev, nxt = self.prev, self.next
        p, n = prev[b], nxt[b]
        nxt[p], prev[n] = n, p
        self.count -= 1

    def ids(self) -> list[int]:
        """The ids front to back (O(count); for checks)."""
        s = self.sentinel
        return [b for b in _walk(self.next, s) if b < s]

    def frozen(self) -> Linked:
        """The queue as a value."""
        if self.writable:
            if open_evolvers:
                forget(self.prev, self.next)
            self.src = Linked(self.prev.persistent(), self.next.persistent(), self.count,
                              self.levels)
            if watching():
                untrack(self.src.prev, self.src.next)
            self.prev, self.next, self.writable = self.src.prev, self.src.next, False
        return self.src


def _walk(nxt: Any, s: int) -> list[int]:
    """Every node after the sentinel ``s`` up to it again, markers included."""
    out, b = [], nxt[s]
    while b != s:
        out.append(b)
        b = nxt[b]
    return out
