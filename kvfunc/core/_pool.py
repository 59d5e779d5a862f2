"""The block pool: free queue, reference counts, hash index, eviction order -- one value.

Theory of operation
-------------------
A :class:`PoolState` owns ``num_blocks`` block ids (block 0 is the null
block: never free, never handed out).  One or more groups draw from it: a
pool per attention type (the seed's layout) or one pool shared by every
group (vLLM's hybrid layout), so ids are unique across the groups of a pool.

Two kinds, chosen when the state is made:

* **seed** (no prefix caching): a FIFO :class:`~kvfunc.core._queue.Ring`.
  Blocks have one holder at most, so there are no reference counts.
* **linked** (prefix caching, or vLLM's order without it): vLLM's free
  queue, :class:`~kvfunc.core._queue.Linked`, plus ``refs`` (table entries
  and detached holders per block) and, with caching, ``hash_of`` (the key
  each cached block is stored under) and ``by_key`` (key -> block id, or a
  tuple of ids in cache order; a hit takes the first, as vLLM's does).  A
  block nobody holds re-enters the queue at the front when it caches nothing
  (reused first), else at the back (evicted last: least recently freed
  first); it keeps its key while it waits and is *evicted* only when handed
  out again.  A hit on a free cached block takes it out of the queue.  A
  free with a retention priority queues its cached blocks behind lower ones.

In a pool shared by several groups the same block hash of two groups names
different KV, so a key is the digest followed by one byte naming the group
(its position among the pool's members); a pool with one member uses the
digest itself.

Conservation: ``free + held + detached == num_blocks - 1`` (``detached``:
held outside the tables, as the seed's ``BlockPool.get_new_blocks`` and
vLLM's deferred frees do).

:class:`PoolCopy` is the working copy one transition edits.  Its
primitives record the pool's own delta rows (freed, evicted) as they act.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import immutables
from pyrsistent import PVector, pvector

from kvfunc.core._delta import DeltaBuilder
from kvfunc.core._queue import Linked, Ring
from kvfunc.core._untracked import atomic, forget, open_evolvers, untrack, watch, watching

__all__ = ["EMPTY_MAP", "PoolCopy", "PoolState", "cache_key"]

EMPTY_MAP: immutables.Map[Any, Any] = immutables.Map()


def cache_key(digest: bytes, tag: bytes | None) -> bytes:
    """The index key of ``digest`` for a member whose tag is ``tag`` (None: the only member).

    >>> cache_key(b"ab", None), cache_key(b"ab", b"\\x01")
    (b'ab', b'ab\\x01')
    """
    return digest if tag is None else digest + tag


class PoolState(NamedTuple):
    """A block pool as a value (see the module docstring): an immutable record.

    Attributes:
        name: the pool's name (a group key for a pool per type, else ``"shared"``).
        members: the keys of the groups that draw from it, in manager order.
        num_blocks: block ids ``0 .. num_blocks - 1``; 0 is the null block.
        queue: the free queue (a ``Ring`` or a ``Linked`` queue).
        refs: holders per block (linked pools), else None.
        hash_of: the key each block is cached under, or None (caching pools).
        by_key: the hash index: cached key -> block id, or a tuple of ids in cache order.
        num_cached: blocks whose ``hash_of`` is set.
        detached: block -> holders outside the tables.
    """

    name: str
    members: tuple[str, ...]
    num_blocks: int
    queue: Any
    refs: PVector[int] | None
    hash_of: PVector[bytes | None] | None
    by_key: immutables.Map[bytes, Any]
    num_cached: int
    detached: immutables.Map[int, int]

    @classmethod
    def create(cls, name: str, members: tuple[str, ...], num_blocks: int, *, linked: bool,
               caching: bool) -> PoolState:
        """A fresh pool: blocks ``1 .. num_blocks - 1`` free in order.

        >>> p = PoolState.create("full", ("full",), 4, linked=False, caching=False)
        >>> p.free_block_ids(), p.num_free
        ((1, 2, 3), 3)
        """
        ids = range(1, num_blocks)
        if not linked:
            return cls(name, members, num_blocks, Ring.of(ids, num_blocks - 1), None, None,
                       EMPTY_MAP, 0, EMPTY_MAP)
        hash_of: Any = atomic(pvector([None] * num_blocks)) if caching else None
        return cls(name, members, num_blocks, Linked.of(ids, num_blocks),
                   atomic(pvector([0] * num_blocks)), hash_of, EMPTY_MAP, 0, EMPTY_MAP)

    @property
    def num_free(self) -> int:
        """Free blocks (cached ones waiting in the queue included)."""
        return self.queue.count  # type: ignore[no-any-return]

    @property
    def linked(self) -> bool:
        """True for vLLM's queue with reference counts."""
        return self.refs is not None

    @property
    def caching(self) -> bool:
        """True when the pool caches blocks by hash."""
        return self.hash_of is not None

    def free_block_ids(self) -> tuple[int, ...]:
        """Free block ids in hand-out order."""
        return tuple(self.queue.ids())

    def num_detached(self) -> int:
        """Holders outside the tables."""
        return sum(self.detached.values())

    def cached(self, member: str) -> dict[bytes, tuple[int, ...]]:
        """``{digest: block ids ascending}`` of one member group (for checks and views)."""
        if self.hash_of is None:
            return {}
        tag = self.tag_of(member)
        out: dict[bytes, tuple[int, ...]] = {}
        for key, found in self.by_key.items():
            if tag is None or key[-1:] == tag:
                ids = tuple(sorted(found)) if type(found) is tuple else (found,)
                out[key if tag is None else key[:-1]] = ids
        return out

    def tag_of(self, member: str) -> bytes | None:
        """The index tag of a member group (None when it is the only member)."""
        return None if len(self.members) == 1 else bytes((self.members.index(member),))

    def identity(self) -> tuple[Any, ...]:
        """What equality compares: sizes, the queue's order, references and cached keys."""
        return (self.name, self.members, self.num_blocks, self.queue.layout(),
                None if self.refs is None else tuple(self.refs),
                None if self.hash_of is None else tuple(self.hash_of),
                dict(self.detached.items()))

    def __repr__(self) -> str:
        return (f"PoolState(name={self.name!r}, members={self.members!r}, "
                f"num_blocks={self.num_blocks}, free={self.num_free})")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PoolState):
            return NotImplemented
        return self is other or self.identity() == other.identity()

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        raise TypeError("unhashable type: 'PoolState'")


class PoolCopy:
    """The working copy of a :class:`PoolState` (see the module docstring)."""

    __slots__ = ("by_key", "caching", "detached", "hash_of", "linked", "members", "num_blocks",
                 "num_cached", "queue", "refs", "sink", "src", "tagged", "writable")

    def __init__(self, pool: PoolState, sink: DeltaBuilder | None) -> None:
        self.src = pool
        self.num_blocks = pool.num_blocks
        self.members = pool.members
        self.tagged = len(pool.members) > 1
        self.linked = pool.refs is not None
        self.caching = pool.hash_of is not None
        self.queue: Any = pool.queue.copy()
        self.refs: Any = pool.refs
        self.hash_of: Any = pool.hash_of
        self.by_key: Any = pool.by_key
        self.num_cached = pool.num_cached
        self.detached: Any = pool.detached
        self.sink = sink
        self.writable = False

    @property
    def count(self) -> int:
        """Free blocks now."""
        return self.queue.count  # type: ignore[no-any-return]

    def writing(self) -> None:
        """Turn the per-block vectors into evolvers (once per transition)."""
        if self.writable:
            return
        if self.linked:
            self.refs = self.refs.evolver()
            if self.caching:
                self.hash_of = self.hash_of.evolver()
                self.by_key = self.by_key.mutate()
            if watching():  # see ``kvfunc.core._untracked``: the collector skips them
                watch(self.refs, self.hash_of)
        self.writable = True

    # -- the free queue ---------------------------------------------------------------
    def take(self, n: int) -> list[int]:
        """Pop ``n`` free blocks for one holder each, evicting what they cache (caller checked)."""
        if not self.writable:
            self.writing()
        out: list[int] = self.queue.pop(n)
        if self.linked:
            refs = self.refs
            for b in out:
                refs[b] = 1
            if self.num_cached:
                hash_of = self.hash_of
                if cached := [b for b in out if hash_of[b] is not None]:
                    self._evict_run(cached)
        return out

    def free(self, ids: Sequence[int], key: str, priority: int = 0) -> None:
        """Return blocks nobody holds to the queue; cached ones wait at ``priority`` (Y, F rows)."""
        if not ids:
            return
        if not self.writable:
            self.writing()
        queue, sink = self.queue, self.sink
        if priority and self.caching and sink is not None:
            sink.rows.append((key, priority))
            sink.codes.append("Y")
        if not self.linked:
            queue.push_back(ids)
        elif self.hash_of is None or not self.num_cached:
            queue.push_front(ids)
        else:  # cached blocks go to the back (evicted last), the others to the front
            hash_of = self.hash_of
            front = [b for b in ids if hash_of[b] is None]
            if len(front) < len(ids):
                queue.push_back([b for b in ids if hash_of[b] is not None], priority, hash_of)
            queue.push_front(front)
        if sink is not None:  # in release order: replay frees the whole run at once
            sink.rows.extend([(key, b) for b in ids])
            sink.codes.append("F" * len(ids))

    def release(self, ids: Sequence[int], key: str, priority: int = 0) -> None:
        """Drop one holder of each block; free, in order, those that reach none."""
        if not self.linked:
            self.free(ids, key)
            return
        if not self.writable:
            self.writing()
        refs = self.refs
        left = [refs[b] - 1 for b in ids]
        for b, r in zip(ids, left, strict=True):
            refs[b] = r
        self.free([b for b, r in zip(ids, left, strict=True) if not r] if any(left) else ids,
                  key, priority)

    def share(self, entries: Sequence[int]) -> None:
        """Add a holder to each non-null entry's block; a free one (cached) leaves the queue."""
        if not self.writable:
            self.writing()
        ids = [b for b in entries if b] if 0 in entries else entries
        refs, queue = self.refs, self.queue
        for b in ids:
            r = refs[b]
            if not r:
                queue.remove(b)
            refs[b] = r + 1

    def detach(self, ids: Sequence[int]) -> None:
        """Count one holder of each block outside the tables (its table entry is gone)."""
        detached = self.detached.mutate()
        for b in ids:
            detached[b] = detached.get(b, 0) + 1
        self.detached = detached.finish()

    def attach(self, ids: Sequence[int]) -> None:
        """Forget one outside holder of each block (the caller checked they are detached)."""
        detached = self.detached.mutate()
        for b in ids:
            n = detached[b] - 1
            if n:
                detached[b] = n
            else:
                del detached[b]
        self.detached = detached.finish()

    def free_ids(self) -> list[int]:
        """Every free block in hand-out order (O(free); for checks and the compat pool)."""
        return list(self.queue.ids())

    # -- the hash index ---------------------------------------------------------------
    def tag_of(self, member: str) -> bytes | None:
        """The index tag of a member group (None when it is the only member)."""
        return bytes((self.members.index(member),)) if self.tagged else None

    def find(self, key: bytes) -> int | None:
        """The first block cached under ``key``, or None."""
        found = self.by_key.get(key)
        if found is None or type(found) is int:
            return found
        first: int = found[0]
        return first

    def store_run(self, blocks: Sequence[int], keys: Sequence[bytes]) -> None:
        """Cache each block under its key (none of them holds anything cached)."""
        if not self.writable:
            self.writing()
        index, hash_of = self.by_key, self.hash_of
        if len(keys) > 1 and not any(map(index.__contains__, keys)):
            index.update(zip(keys, blocks, strict=True))  # no key cached yet: one call
        else:
            get = index.get
            for b, key in zip(blocks, keys, strict=True):
                found = get(key)
                index[key] = (b if found is None else (found, b) if type(found) is int
                              else (*found, b))
        for b, key in zip(blocks, keys, strict=True):
            hash_of[b] = key
        self.num_cached += len(blocks)

    def _evict_run(self, blocks: list[int]) -> None:
        """Forget what ``blocks`` cache; records their E rows, in order."""
        index, hash_of = self.by_key, self.hash_of
        keys = [hash_of[b] for b in blocks]
        pop = index.pop  # one walk of the index per block (a read, then a delete, were two)
        for b, key in zip(blocks, keys, strict=True):
            found = pop(key)
            if type(found) is not int:  # copies of one key: put the others back
                rest = tuple(x for x in found if x != b)
                index[key] = rest[0] if len(rest) == 1 else rest
            hash_of[b] = None
        self.num_cached -= len(blocks)
        sink = self.sink
        if sink is not None:
            members, pairs = self.members, zip(blocks, keys, strict=True)
            sink.rows.extend([(members[k[-1]], b, k[:-1]) for b, k in pairs] if self.tagged
                             else [(members[0], b, k) for b, k in pairs])
            sink.codes.append("E" * len(blocks))

    def evict(self, b: int) -> bool:
        """Forget what block ``b`` caches, held or free (vLLM's ``evict_blocks``); True if it did.

        A free block keeps its place in the queue; a held block stays held.
        """
        if not self.caching or self.hash_of[b] is None:
            return False
        if not self.writable:
            self.writing()
        self._evict_run([b])
        return True

    def drop(self, ids: Sequence[int], key: str) -> None:
        """Let one detached holder of each block go (records X), freeing those nobody holds."""
        sink = self.sink
        if sink is not None:
            sink.rows.extend([(key, b) for b in ids])
            sink.codes.append("X" * len(ids))
        self.attach(ids)
        self.release(ids, key)

    def clear(self) -> int:
        """Forget every cached key (held blocks stay held); how many blocks were cached."""
        if not self.writable:
            self.writing()
        self.hash_of = atomic(pvector([None] * self.num_blocks)).evolver()
        watch(self.hash_of)
        n, self.num_cached = self.num_cached, 0
        self.by_key = EMPTY_MAP.mutate()
        if self.queue.levels:  # nothing waits at a priority now: vLLM's queue, in its order
            self.queue = Linked.of(self.queue.ids(), self.num_blocks).copy()
        return n

    # -- freezing ---------------------------------------------------------------------
    def freeze(self) -> PoolState:
        """The pool as a value; the working copy goes on from it."""
        src = self.src
        queue = self.queue.frozen()
        if not self.writable and queue is src.queue and self.detached is src.detached:
            return src
        refs, hash_of, index = self.refs, self.hash_of, self.by_key
        if self.writable and self.linked:
            if open_evolvers:
                forget(refs, hash_of)
            refs = refs.persistent()
            if self.caching:
                hash_of, index = hash_of.persistent(), index.finish()
            if watching():
                untrack(refs, hash_of)
        new = self.src = _new(PoolState, (src.name, src.members, src.num_blocks, queue, refs,
                                          hash_of, index, self.num_cached, self.detached))
        self.refs, self.hash_of, self.by_key, self.writable = refs, hash_of, index, False
        return new


_new = tuple.__new__
