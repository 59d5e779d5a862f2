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
  block ids, two lists ``prev`` and ``next`` with one sentinel (index
  ``num_blocks``), kept in the pool's store with its other per-block arrays
  (:mod:`kvfunc.core._lineage`: the newest value's links, written in place,
  and undo logs for older values).  Blocks leave at the front; a freed block
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

from kvfunc.core._lineage import LINKED, NEXT, PREV, kept

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
    """vLLM's free queue as a value: its length, its priority markers and its sentinel.

    The links themselves (``prev``, ``next``: one node per block, the
    sentinel ``num_blocks``, then the marker nodes) live in the pool's store
    (:mod:`kvfunc.core._lineage`); ``levels`` pairs each retention priority
    in use with its marker node, by priority (see the module docstring).
    """

    __slots__ = ("count", "levels", "sentinel")

    def __init__(self, count: int, levels: tuple[tuple[int, int], ...], sentinel: int) -> None:
        self.count, self.levels, self.sentinel = count, levels, sentinel

    @classmethod
    def of(cls, ids: Sequence[int], num_blocks: int) -> tuple[Linked, list[int], list[int]]:
        """A queue holding ``ids`` in order over blocks ``0 .. num_blocks - 1``, with its links.

        >>> q, prev, nxt = Linked.of([3, 1, 2], 4)
        >>> q.ids(nxt)
        [3, 1, 2]
        """
        s = num_blocks
        prev, nxt = [s] * (s + 1), [s] * (s + 1)
        last = s
        for b in ids:
            prev[b], nxt[last] = last, b
            last = b
        nxt[last], prev[s] = s, last
        return cls(len(ids), (), s), prev, nxt

    def ids(self, nxt: Sequence[int]) -> list[int]:
        """The ids front to back over the links ``nxt`` (O(count); markers skipped)."""
        s = self.sentinel
        return [b for b in _walk(nxt, s) if b < s]

    def layout(self, nxt: Sequence[int]) -> tuple[Any, ...]:
        """The whole order, markers shown as ``("priority", p)`` (for equality and checks).

        >>> q, prev, nxt = Linked.of([1, 2], 3)
        >>> w = q.copy(prev, nxt, [])
        >>> w.push_back([0], 4, cached=[None, None, b"k"])  # block 2 caches something
        >>> w.frozen().layout(nxt)
        (1, ('priority', 0), 2, ('priority', 4), 0)
        """
        s, marks = self.sentinel, {m: p for p, m in self.levels}
        return tuple(b if b < s else ("priority", marks[b]) for b in _walk(nxt, s))

    def copy(self, prev: list[int], nxt: list[int], log: list[Any]) -> LinkedCopy:
        """A working copy writing the links ``prev`` / ``nxt`` and logging to ``log``."""
        return LinkedCopy(self, prev, nxt, log)


class LinkedCopy:
    """The working copy of a :class:`Linked` queue: it writes the store's links in place,
    logging each entry's old value first (:mod:`kvfunc.core._lineage`)."""

    __slots__ = ("bulk", "count", "levels", "log", "next", "prev", "sentinel", "src")

    def __init__(self, queue: Linked, prev: list[int], nxt: list[int], log: list[Any]) -> None:
        self.src = queue
        self.prev, self.next = prev, nxt
        self.log = log.append
        self.bulk = 0  # writes logged beyond one per entry (``_lineage.commit``'s ``bulk``)
        self.count = queue.count
        self.levels = queue.levels
        self.sentinel = queue.sentinel

    def pop(self, n: int) -> list[int]:
        """The ``n`` blocks at the front (the caller checked ``n <= count``)."""
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
        prev, log = self.prev, self.log
        log((NEXT, s, nxt[s]))
        nxt[s] = b
        log((PREV, b, prev[b]))
        prev[b] = s
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
        """Link a marker node for ``priority`` right before node ``before``: one no level
        uses (markers unlinked by :meth:`relink`), else a new one."""
        prev, nxt, log = self.prev, self.next, self.log
        used = {node for _, node in self.levels}
        m = next((x for x in range(self.sentinel + 1, len(nxt)) if x not in used), len(nxt))
        after = prev[before]
        if m == len(nxt):
            prev.append(after)  # a rollback cuts the links back to their length
            nxt.append(before)
        else:
            log((PREV, m, prev[m]))
            prev[m] = after
            log((NEXT, m, nxt[m]))
            nxt[m] = before
        log((NEXT, after, nxt[after]))
        nxt[after] = m
        log((PREV, before, prev[before]))
        prev[before] = m
        self.levels = tuple(sorted((*self.levels, (priority, m))))

    def _link(self, last: int, ids: Sequence[int]) -> None:
        """Link ``ids``, in order, between block ``last`` (or the sentinel) and its next."""
        prev, nxt, log = self.prev, self.next, self.log
        following = nxt[last]
        log((NEXT, last, following))
        if len(ids) == 1:
            b = ids[0]
            log((PREV, b, prev[b]))
            log((NEXT, b, nxt[b]))
        else:  # every link is logged, in one entry: an older value may have queued them
            ids = kept(ids)
            log((LINKED, ids, list(map(prev.__getitem__, ids)), list(map(nxt.__getitem__, ids))))
            self.bulk += 2 * len(ids) - 1
        for b in ids:
            prev[b] = last
            nxt[last] = b
            last = b
        nxt[last] = following
        log((PREV, following, prev[following]))
        prev[following] = last
        self.count += len(ids)

    def remove(self, b: int) -> None:
        """Take block ``b`` out of the middle of the queue (it must be queued)."""
        prev, nxt = self.prev, self.next
        p, n = prev[b], nxt[b]
        self.log((NEXT, p, nxt[p]))
        nxt[p] = n
        self.log((PREV, n, prev[n]))
        prev[n] = p
        self.count -= 1

    def relink(self, ids: Sequence[int]) -> None:
        """The queue holding exactly ``ids``, in order, with no markers (their nodes unlinked)."""
        s, prev, nxt = self.sentinel, self.prev, self.next
        self.log((NEXT, s, nxt[s]))
        nxt[s] = s
        self.log((PREV, s, prev[s]))
        prev[s] = s
        self.count, self.levels = 0, ()
        self._link(s, ids)

    def ids(self) -> list[int]:
        """The ids front to back (O(count); for checks)."""
        s = self.sentinel
        return [b for b in _walk(self.next, s) if b < s]

    def frozen(self) -> Linked:
        """The queue as a value."""
        src = self.src
        if self.count != src.count or self.levels is not src.levels:
            src = self.src = Linked(self.count, self.levels, self.sentinel)
        return src

    def rebind(self, queue: Linked, log: list[Any]) -> None:
        """Go on from ``queue`` over the same links with another log (a new transition)."""
        self.src, self.log, self.bulk = queue, log.append, 0


def _walk(nxt: Any, s: int) -> list[int]:
    """Every node after the sentinel ``s`` up to it again, markers included."""
    out, b = [], nxt[s]
    while b != s:
        out.append(b)
        b = nxt[b]
    return out
