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

:class:`~kvfunc.core._pool_copy.PoolCopy` is the working copy one
transition edits: it claims the store (or a fork of it) when it is made,
writes it logging each old value, and commits or aborts it.  Its primitives
record the pool's own delta rows (freed, evicted) as they act.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import immutables

from kvfunc.core._lineage import LOCK, Store, Version, reading
from kvfunc.core._policy import slid_out
from kvfunc.core._queue import Linked, Ring

__all__ = ["EMPTY_MAP", "PoolState", "cache_key"]

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
        with self.reading() as store:
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
        with self.reading() as store:
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
        with self.reading() as store:
            return self.queue.layout(store.next)  # type: ignore[no-any-return]

    def identity(self) -> tuple[Any, ...]:
        """What equality compares: sizes, the queue's order, references and cached keys."""
        if self.ver is None:
            return (self.name, self.members, self.num_blocks, self.queue.layout(), None, None,
                    dict(self.detached.items()))
        with self.reading() as store:
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


_new = tuple.__new__


def next_free(pool: PoolState, after: int | None, n: int) -> list[int] | None:
    """The ``n`` blocks ``pool``'s free queue hands out next, after the free block ``after``
    (None: from the front), as ``n`` one-block takes would pop them; None when fewer are
    queued, or when the pool is not a linked one whose lineage it heads with nobody writing
    (the answer would need a copy).

    For a caller that promises blocks to takes it makes later, in order (``kvfunc.vllm``'s
    owed takes): ``after`` is the last block it promised, still free in ``pool``.

    >>> p = PoolState.create("full", ("full",), 5, linked=True, caching=True)
    >>> next_free(p, None, 2), next_free(p, 2, 2), next_free(p, 2, 3)
    ([1, 2], [3, 4], None)
    """
    ver = pool.ver
    with LOCK:  # no claim lands while the links are walked
        store = None if ver is None else ver.node.store
        if store is None or store.txn is not None:
            return None
        nxt, s = store.next, pool.queue.sentinel
        b = nxt[s if after is None else after]
        out: list[int] = []
        while len(out) < n:
            if b == s:  # fewer free blocks than asked for
                return None
            if b < s:  # a priority marker's node is past the sentinel
                out.append(b)
            b = nxt[b]
        return out


def slid_blocks(state: Any, rid: Any, computed: int) -> list[tuple[int, int]] | None:
    """The blocks of ``state``'s first pool that a step of ``rid`` from ``computed`` tokens
    lets slide out of its windows, each with its holders now (1: the step frees it); None
    when the pool's store is not at hand, as :func:`next_free` (for ``kvfunc.vllm``'s owed
    slides).

    >>> from kvfunc.core import KVState, SlidingWindow, allocate_slots
    >>> s = KVState.create({"swa": SlidingWindow(num_blocks=9, block_size=4,
    ...                                          sliding_window=8)}, 1024,
    ...                    enable_prefix_caching=True)
    >>> s = allocate_slots(s, "a", 0, 12).state
    >>> slid_blocks(s, "a", 10), slid_blocks(s, "a", 11)
    ([], [(1, 1)])
    """
    ver = state.pools[0].ver
    with LOCK:  # no claim lands while the counts are read
        store = None if ver is None else ver.node.store
        if store is None or store.txn is not None:
            return None
        out: list[tuple[int, int]] = []
        for g in state.groups:
            row = g.rows.get(rid)
            if row is not None and g.pool == 0 and computed >= row[6]:
                upto = slid_out(g.policy, g.traits[2], computed, row[9])
                if upto > row[1]:
                    ids = row[0][row[1]:upto]
                    out.extend(zip(ids, map(store.refs.__getitem__, ids), strict=True))
        return out
