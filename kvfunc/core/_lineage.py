"""The per-block arrays a lineage of pool values shares: one mutable copy, and undo logs.

Theory of operation
-------------------
A linked pool's per-block arrays -- reference counts (``refs``), cached
keys (``hash_of``), the free queue's links (``prev``, ``next``) -- and its
hash index (``by_key``) hold tens of thousands of entries, of which one
transition writes a handful.  Persistent vectors and maps pay for each
write (a path copy) and each freeze, and the collector walks every version
they make.  Here the values of one *lineage* share a :class:`Store` of plain
lists and one dict holding the newest value's contents, and each older value
keeps an *undo log* that turns its newer neighbour back into itself (Baker's
shallow binding; the links only ever point from older to newer)::

    v0 --undo--> v1 --undo--> v2   (the head: the store holds its contents)

* A :class:`Version` names one value; its :class:`Node` is the head of a
  store (``store`` set) or an older link (``parent``: the next newer node,
  ``undo``: its log).
* A transition :func:`claim`\\ s the store of the value it starts from.  When
  that value is the head and nobody holds the store, the transition writes
  the store in place, logging each entry's old value before writing it, and
  :func:`commit` makes a new head and gives the log to the old one.
  Otherwise it *forks*: the store is copied and the copy rolled back to the
  value (the holder's pending log first, then each log on the way), and the
  transition works on that copy, which its new value heads.
* A read outside a transition (:func:`reading`) holds the module's lock, so
  that no claim lands meanwhile, and reads the store in place when the value
  is its head and nobody holds it, else a fork.
* A transition that fails rolls its log back (:func:`abort`).  One that
  never ends leaves the store held: later transitions fork, which costs a
  copy but never gives a wrong value.
* Old values that are still held keep the logs between them alive.  Once a
  store has logged as many entries as it holds, the held ones whose logs to
  the next held value are longer than that get contents of their own
  (:func:`_compact`), so an old snapshot kept for ever costs one copy, and a
  run that keeps every value costs only what changed.

A store's writer takes no lock: the GIL makes each list or dict operation
atomic, and it logs before it writes, so a fork that copies the arrays
first and the pending log second always finds a log entry for every write
it copied.  Everything else happens under the lock.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import Any, TypeVar

__all__ = [
    "CACHED",
    "COUNTED",
    "EVICTED",
    "KEYS",
    "LINKED",
    "LOCK",
    "MISSING",
    "NEXT",
    "PREV",
    "REFS",
    "SLOTS",
    "STORED",
    "UNCACHED",
    "Node",
    "Reading",
    "Store",
    "Version",
    "abort",
    "claim",
    "commit",
    "content",
    "kept",
    "materialize",
    "reading",
]

LOCK = threading.RLock()
#: What a log entry ``(part, index or key, old value, ...)`` wrote: ``refs``, ``hash_of``,
#: ``prev``, ``next`` or ``by_key`` at one index or key; ``COUNTED``: ``refs`` of blocks
#: ``ids``, taken or released (``(COUNTED, ids, old counts)``); ``STORED`` / ``EVICTED``:
#: ``by_key`` at ``key`` and ``hash_of`` at block ``b`` (``(kind, key, old, b)``: the block
#: was uncached / cached under ``key``); ``LINKED``: ``prev`` and ``next`` of blocks ``ids``
#: (``(LINKED, ids, old prevs, old nexts)``); ``CACHED`` / ``UNCACHED``: ``by_key`` at ``keys``
#: and ``hash_of`` at ``blocks`` (``(kind, keys, blocks)``: each block was uncached and its
#: key absent / each key cached its block alone).
REFS, SLOTS, PREV, NEXT, KEYS, COUNTED, STORED, EVICTED, LINKED, CACHED, UNCACHED = range(11)
_T = TypeVar("_T")
MISSING: Any = object()  # a key's old value when it was not in the index
#: A store compacts after logging ``max(COMPACT_MIN, its entries)`` entries.
COMPACT_MIN = 4096


def kept(ids: Sequence[_T]) -> tuple[_T, ...]:
    """``ids`` as a tuple: an entry that a log (or a delta) keeps is never written again.

    >>> kept([3, 4]), kept((5,))
    ((3, 4), (5,))
    """
    return ids if type(ids) is tuple else tuple(ids)


class Store:
    """The contents of one value of a lineage (see the module docstring).

    ``refs``, ``hash_of`` (None without caching), ``prev`` and ``next`` are
    lists; ``by_key`` is a dict (None without caching); ``txn`` is the log of
    the transition holding the store, if any.
    """

    __slots__ = ("by_key", "count", "hash_of", "held", "marks", "next", "prev", "refs", "size",
                 "txn")

    def __init__(self, refs: list[int], hash_of: list[Any] | None, prev: list[int],
                 nxt: list[int], by_key: dict[bytes, Any] | None) -> None:
        self.refs, self.hash_of, self.by_key = refs, hash_of, by_key
        self.prev, self.next = prev, nxt
        self.txn: list[Any] | None = None  # the holder's log
        self.size = len(nxt)  # the links' length when the holder began
        self.count = 0  # entries logged here so far
        self.marks = 0  # ``count`` at the last compaction
        self.held: list[tuple[Any, int]] = []  # (weak version, count when it got its log)

    def entries(self) -> int:
        """Entries held: the size a copy costs."""
        return len(self.refs) + len(self.prev) * 2 + (len(self.by_key) if self.by_key else 0)


class Node:
    """A link of a lineage: a store's head, or ``parent``'s contents undone by ``undo``
    (then cut to ``size`` links)."""

    __slots__ = ("parent", "size", "store", "undo")

    def __init__(self, store: Store | None) -> None:
        self.store = store
        self.parent: Node | None = None
        self.undo: list[Any] | None = None
        self.size = 0


class Version:
    """One value of a lineage, as a pool holds it: its :class:`Node`.

    The chain of nodes keeps older nodes' newer neighbours alive; a version
    is alive only while a value holds it, which is what compaction asks.
    """

    __slots__ = ("__weakref__", "node")

    def __init__(self, store: Store | None) -> None:
        self.node = Node(store)

    @property
    def store(self) -> Store | None:
        """The store this version heads, if it is a head."""
        return self.node.store

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled or deep-copied: a version of its own, heading a copy of its contents."""
        with LOCK:
            s = materialize(self)  # a copy: nothing of it is shared with the lineage
            return _revive, (s.refs, s.hash_of, s.prev, s.next, s.by_key)


def _revive(refs: list[int], hash_of: list[Any] | None, prev: list[int], nxt: list[int],
            by_key: dict[bytes, Any] | None) -> Version:
    """A version heading a store of these contents (unpickling, deep copies)."""
    return Version(Store(refs, hash_of, prev, nxt, by_key))


def _roll_back(s: Store, log: list[Any], size: int) -> None:
    """Undo ``log`` on ``s`` (latest entry first), then cut its links to ``size``."""
    parts: Any = (s.refs, s.hash_of, s.prev, s.next)
    index: Any = s.by_key
    for e in reversed(log):
        c = e[0]
        if c <= NEXT:
            if c < PREV or e[1] < size:  # a marker node past ``size`` is cut below
                parts[c][e[1]] = e[2]
        elif c == COUNTED:
            refs = s.refs
            for b, r in zip(e[1], e[2], strict=True):
                refs[b] = r
        elif c == LINKED:  # blocks only: never a marker node
            prev, nxt = s.prev, s.next
            for b, p, n in zip(e[1], e[2], e[3], strict=True):
                prev[b] = p
                nxt[b] = n
        elif c >= CACHED:  # keys and blocks distinct: any order
            hash_of = s.hash_of
            if c == CACHED:
                for k, b in zip(e[1], e[2], strict=True):
                    index.pop(k, None)  # a write logged may not have happened yet (a fork)
                    hash_of[b] = None  # type: ignore[index]
            else:
                for k, b in zip(e[1], e[2], strict=True):
                    index[k] = b
                    hash_of[b] = k  # type: ignore[index]
        else:  # KEYS, STORED, EVICTED
            key, old = e[1], e[2]
            if old is MISSING:
                index.pop(key, None)  # a key the index did not have
            else:
                index[key] = old
            if c != KEYS:
                s.hash_of[e[3]] = None if c == STORED else key  # type: ignore[index]
    del s.prev[size:], s.next[size:]


def materialize(v: Version) -> Store:
    """A new store holding ``v``'s contents, held by nobody (call under :data:`LOCK`)."""
    chain = []
    node = v.node
    while node.store is None:
        chain.append(node)
        node = node.parent  # type: ignore[assignment]
    src = node.store
    out = Store(list(src.refs), None if src.hash_of is None else list(src.hash_of),
                list(src.prev), list(src.next), None if src.by_key is None else dict(src.by_key))
    pending = src.txn
    if pending is not None:  # copied after the arrays: every write copied is in it
        _roll_back(out, list(pending), src.size)
    for older in reversed(chain):
        _roll_back(out, older.undo, older.size)  # type: ignore[arg-type]
    out.size = len(out.next)
    return out


def claim(v: Version) -> tuple[Store, list[Any]]:
    """The store a transition from ``v`` writes, held by its new log (a fork if need be).

    The transition logs an entry (:data:`REFS` ...) before each write it
    makes to a part of its starting value (:data:`MISSING`: a key the index
    did not have).
    """
    with LOCK:
        s = v.node.store
        if s is None or s.txn is not None:
            s = _own(v)
        log: list[Any] = []
        s.txn, s.size = log, len(s.next)
        return s, log


def _own(v: Version) -> Store:
    """A copy of ``v``'s contents that ``v`` heads from now on (older values chained through
    ``v`` then end there); the store it heads or came from goes on without it."""
    copy = materialize(v)
    node = v.node
    node.store, node.parent, node.undo = copy, None, None
    return copy


def commit(s: Store, log: list[Any], base: Version, bulk: int = 0) -> Version:
    """End the transition holding ``s``: the version of its result (``base``'s successor).

    ``bulk``: the writes that the log's entries of several blocks (``COUNTED``, ``LINKED``,
    ``CACHED``, ``UNCACHED``) hold beyond one each, so that compaction weighs every write."""
    with LOCK:
        s.txn = None
        new = Version(s)
        old = base.node
        if old.store is s:  # it started from the head: the old head keeps the log
            old.store, old.parent, old.undo, old.size = None, new.node, log, s.size
            s.count += len(log) + bulk + 1
            s.held.append((weakref.ref(base), s.count))
            if s.count - s.marks > COMPACT_MIN and s.count - s.marks > s.entries():
                _compact(s)
        return new


def abort(s: Store, log: list[Any]) -> None:
    """End the transition holding ``s`` with nothing written (its log rolled back)."""
    with LOCK:
        if s.txn is log:
            if log or len(s.next) != s.size:
                _roll_back(s, log, s.size)
            s.txn = None


def _compact(s: Store) -> None:
    """Give a store of its own to each held old value whose logs outweigh a copy.

    Newest first: a value copied becomes the head of its copy, so the older
    values chained through it end there (and are its store's to compact).
    """
    size = s.entries()
    live = [(v, at) for ref, at in s.held if (v := ref()) is not None and v.node.store is None]
    kept: list[tuple[Any, int]] = []
    held, upto, copies = kept, s.count, []
    for v, at in reversed(live):  # ``upto``: where the next newer value held sits
        if upto - at > size:
            copy = _own(v)
            copy.count = copy.marks = at
            copies.append(copy)
            held = copy.held  # the older ones chain into ``v`` now
        else:
            held.append((weakref.ref(v), at))
        upto = at
    for copy in copies:
        copy.held.reverse()  # oldest first, as commits add them
    s.held, s.marks = kept[::-1], s.count


def content(v: Version) -> Store:
    """A store holding ``v``'s contents to read (call under :data:`LOCK`, read under it)."""
    s = v.node.store
    return s if s is not None and s.txn is None else materialize(v)


class Reading:
    """The context :func:`reading` makes: the module's lock held, ``v``'s contents given."""

    __slots__ = ("v",)

    def __init__(self, v: Version) -> None:
        self.v = v

    def __enter__(self) -> Store:
        LOCK.acquire()
        try:
            return content(self.v)
        except BaseException:
            LOCK.release()
            raise

    def __exit__(self, *exc: object) -> None:
        LOCK.release()


def reading(v: Version) -> Reading:
    """The contents of ``v`` to read (not write), kept from any claim while the block runs.

    >>> s = Store([0, 1], None, [2, 2, 2], [2, 2, 2], None)
    >>> head = Version(s)
    >>> store, log = claim(head)
    >>> log.append((REFS, 1, store.refs[1])); store.refs[1] = 5
    >>> with reading(head) as seen:  # the pending write is not part of ``head``
    ...     seen.refs
    [0, 1]
    >>> new = commit(store, log, head)
    >>> with reading(new) as a, reading(head) as b:
    ...     a.refs, b.refs
    ([0, 5], [0, 1])
    """
    return Reading(v)
