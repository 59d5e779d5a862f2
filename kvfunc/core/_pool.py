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
  tuple of ids in cache order; a hit takes the first, as vLLM's does).
  These arrays and the queue's links live in a store that the pool's
  lineage shares (:mod:`kvfunc.core._lineage`): plain lists and a dict that
  a transition writes in place, with undo logs for older values.  A
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

:class:`PoolCopy` is the working copy one transition edits: it claims the
store (or a fork of it) when it is made, writes it logging each old value,
and commits or aborts it.  Its primitives record the pool's own delta rows
(freed, evicted) as they act.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import immutables

from kvfunc.core._delta import DeltaBuilder
from kvfunc.core._lineage import (
    KEYS,
    MISSING,
    REFS,
    SLOTS,
    Store,
    Version,
    abort,
    claim,
    commit,
    reading,
)
from kvfunc.core._queue import Linked, Ring

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
        ver: the version of its lineage's store holding its arrays (linked pools), else None.
        caching: True when the pool caches blocks by hash.
        num_cached: blocks cached (a key in ``hash_of``).
        detached: block -> holders outside the tables.
    """

    name: str
    members: tuple[str, ...]
    num_blocks: int
    queue: Any
    ver: Version | None
    caching: bool
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
            return cls(name, members, num_blocks, Ring.of(ids, num_blocks - 1), None, False, 0,
                       EMPTY_MAP)
        queue, prev, nxt = Linked.of(ids, num_blocks)
        store = Store([0] * num_blocks, [None] * num_blocks if caching else None, prev, nxt,
                      {} if caching else None)
        return cls(name, members, num_blocks, queue, Version(store), caching, 0, EMPTY_MAP)

    @property
    def num_free(self) -> int:
        """Free blocks (cached ones waiting in the queue included)."""
        return self.queue.count  # type: ignore[no-any-return]

    @property
    def linked(self) -> bool:
        """True for vLLM's queue with reference counts."""
        return self.ver is not None

    def reading(self) -> Any:
        """A context whose value is the store holding this pool's arrays, to read only."""
        assert self.ver is not None, "a seed pool has no store"
        return reading(self.ver)

    @property
    def refs(self) -> list[int] | None:
        """Holders per block (a copy; linked pools), else None."""
        if self.ver is None:
            return None
        with reading(self.ver) as store:
            return list(store.refs)

    @property
    def hash_of(self) -> list[bytes | None] | None:
        """The key each block is cached under, or None (a copy; caching pools), else None."""
        if not self.caching:
            return None
        with self.reading() as store:
            return list(store.hash_of)

    @property
    def by_key(self) -> dict[bytes, Any]:
        """The hash index (a copy): cached key -> block id, or a tuple of ids in cache order."""
        if not self.caching:
            return {}
        with self.reading() as store:
            return dict(store.by_key)

    def free_block_ids(self) -> tuple[int, ...]:
        """Free blocks in hand-out order."""
        if self.ver is None:
            return tuple(self.queue.ids())
        with reading(self.ver) as store:
            return tuple(self.queue.ids(store.next))

    def num_detached(self) -> int:
        """Holders outside the tables."""
        return sum(self.detached.values())

    def cached(self, member: str) -> dict[bytes, tuple[int, ...]]:
        """``{digest: block ids ascending}`` of one member group (for checks and views)."""
        if not self.caching:
            return {}
        tag = self.tag_of(member)
        out: dict[bytes, tuple[int, ...]] = {}
        with self.reading() as store:
            for key, found in store.by_key.items():
                if tag is None or key[-1:] == tag:
                    ids = tuple(sorted(found)) if type(found) is tuple else (found,)
                    out[key if tag is None else key[:-1]] = ids
        return out

    def tag_of(self, member: str) -> bytes | None:
        """The index tag of a member group (None when it is the only member)."""
        return None if len(self.members) == 1 else bytes((self.members.index(member),))

    def queue_layout(self) -> tuple[Any, ...]:
        """The free queue's whole order, priority markers as ``("priority", p)``."""
        if self.ver is None:
            return self.queue.layout()  # type: ignore[no-any-return]
        with reading(self.ver) as store:
            return self.queue.layout(store.next)  # type: ignore[no-any-return]

    def identity(self) -> tuple[Any, ...]:
        """What equality compares: sizes, the queue's order, references and cached keys."""
        if self.ver is None:
            return (self.name, self.members, self.num_blocks, self.queue.layout(), None, None,
                    dict(self.detached.items()))
        with reading(self.ver) as store:
            return (self.name, self.members, self.num_blocks, self.queue.layout(store.next),
                    tuple(store.refs), None if store.hash_of is None else tuple(store.hash_of),
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
    """The working copy of a :class:`PoolState` (see the module docstring).

    A linked pool's copy holds its store (``store``, claimed with ``log``)
    from when it is made until :meth:`freeze` or :meth:`abort`; a copy left
    with a state for the next transition claims it again (:meth:`reopen`).
    """

    __slots__ = ("by_key", "caching", "detached", "hash_of", "linked", "log", "members",
                 "num_blocks", "num_cached", "queue", "refs", "sink", "src", "store", "tagged",
                 "writable")

    def __init__(self, pool: PoolState, sink: DeltaBuilder | None) -> None:
        self.src = pool
        self.num_blocks = pool.num_blocks
        self.members = pool.members
        self.tagged = len(pool.members) > 1
        self.linked = pool.ver is not None
        self.caching = pool.caching
        self.num_cached = pool.num_cached
        self.detached: Any = pool.detached
        self.sink = sink
        self.writable = False
        self.store: Store | None = None
        self.log: list[Any] | None = None
        if pool.ver is None:
            self.queue: Any = pool.queue.copy()
            self.refs = self.hash_of = self.by_key = None
        else:
            self._claim()

    def _claim(self) -> None:
        pool = self.src
        store, log = claim(pool.ver)  # type: ignore[arg-type]
        if store is not self.store:
            self.store = store
            self.refs: Any = store.refs
            self.hash_of: Any = store.hash_of
            self.by_key: Any = store.by_key
            self.queue = pool.queue.copy(store.prev, store.next, log)
        else:
            self.queue.rebind(pool.queue, log)
        self.log = log

    def reopen(self) -> None:
        """Claim the store again, for a transition going on from :attr:`src`."""
        if self.log is None and self.linked:
            self._claim()

    @property
    def count(self) -> int:
        """Free blocks now."""
        return self.queue.count  # type: ignore[no-any-return]

    def writing(self) -> None:
        """Note that this transition writes the pool."""
        self.writable = True

    # -- the free queue ---------------------------------------------------------------
    def take(self, n: int) -> list[int]:
        """Pop ``n`` free blocks for one holder each, evicting what they cache (caller checked)."""
        self.writable = True
        out: list[int] = self.queue.pop(n)
        if self.linked:
            refs, log = self.refs, self.log.append  # type: ignore[union-attr]
            for b in out:
                log((REFS, b, 0))  # a free block has no holder
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
        self.writable = True
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
        self.writable = True
        refs, log = self.refs, self.log.append  # type: ignore[union-attr]
        if len(ids) == 1:
            b = ids[0]
            r = refs[b]
            log((REFS, b, r))
            refs[b] = r - 1
            if r == 1:
                self.free(ids, key, priority)
            return
        left = [refs[b] - 1 for b in ids]
        for b, r in zip(ids, left, strict=True):
            log((REFS, b, r + 1))
            refs[b] = r
        self.free([b for b, r in zip(ids, left, strict=True) if not r] if any(left) else ids,
                  key, priority)

    def share(self, entries: Sequence[int]) -> None:
        """Add a holder to each non-null entry's block; a free one (cached) leaves the queue."""
        self.writable = True
        ids = [b for b in entries if b] if 0 in entries else entries
        refs, queue, log = self.refs, self.queue, self.log.append  # type: ignore[union-attr]
        for b in ids:
            r = refs[b]
            if not r:
                queue.remove(b)
            log((REFS, b, r))
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
            return found  # type: ignore[no-any-return]
        first: int = found[0]
        return first

    def store_run(self, blocks: Sequence[int], keys: Sequence[bytes]) -> None:
        """Cache each block under its key (none of them holds anything cached)."""
        self.writable = True
        index, hash_of, log = self.by_key, self.hash_of, self.log  # type: ignore[union-attr]
        if len(keys) > 1 and not any(map(index.__contains__, keys)):
            log.extend([(KEYS, k, MISSING) for k in keys])  # none cached yet: one update
            index.update(zip(keys, blocks, strict=True))
        else:
            get = index.get
            for b, key in zip(blocks, keys, strict=True):
                found = get(key, MISSING)
                log.append((KEYS, key, found))
                index[key] = (b if found is MISSING else (found, b) if type(found) is int
                              else (*found, b))
        for b, key in zip(blocks, keys, strict=True):
            log.append((SLOTS, b, hash_of[b]))
            hash_of[b] = key
        self.num_cached += len(blocks)

    def _evict_run(self, blocks: list[int]) -> None:
        """Forget what ``blocks`` cache; records their E rows, in order."""
        index, hash_of, log = self.by_key, self.hash_of, self.log.append  # type: ignore[union-attr]
        keys = [hash_of[b] for b in blocks]
        pop = index.pop
        for b, key in zip(blocks, keys, strict=True):
            found = index[key]
            log((KEYS, key, found))
            if type(found) is int:
                pop(key)
            else:  # copies of one key: keep the others
                rest = tuple(x for x in found if x != b)
                index[key] = rest[0] if len(rest) == 1 else rest
            log((SLOTS, b, key))
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
        self.writable = True
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
        self.writable = True
        hash_of, index, log = self.hash_of, self.by_key, self.log  # type: ignore[union-attr]
        for b in [b for b in range(self.num_blocks) if hash_of[b] is not None]:
            log.append((SLOTS, b, hash_of[b]))  # type: ignore[union-attr]
            hash_of[b] = None
        log.extend([(KEYS, k, v) for k, v in index.items()])  # type: ignore[union-attr]
        index.clear()
        n, self.num_cached = self.num_cached, 0
        if self.queue.levels:  # nothing waits at a priority now: vLLM's queue, in its order
            self.queue.relink(self.queue.ids())
        return n

    # -- freezing ---------------------------------------------------------------------
    def freeze(self) -> PoolState:
        """The pool as a value; the working copy goes on from it (claiming nothing)."""
        src, store, log = self.src, self.store, self.log
        queue = self.queue.frozen()
        if store is None:  # a seed pool
            if queue is src.queue and self.detached is src.detached:
                return src
            ver = None
        elif log is None:  # frozen already, nothing claimed since
            return src
        else:
            self.log = None
            if not log and len(store.next) == store.size:
                abort(store, log)  # nothing written: the store goes back as it was
                if queue is src.queue and self.detached is src.detached:
                    return src
                ver = src.ver
            else:
                ver = commit(store, log, src.ver)  # type: ignore[arg-type]
        self.writable = False
        new = self.src = _new(PoolState, (src.name, src.members, src.num_blocks, queue, ver,
                                          src.caching, self.num_cached, self.detached))
        return new

    def abort(self) -> None:
        """Give the store back with every write of this transition undone."""
        if self.log is not None:
            abort(self.store, self.log)  # type: ignore[arg-type]
            self.log = None


_new = tuple.__new__
