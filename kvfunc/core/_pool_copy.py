"""The working copy of a block pool: what one transition edits (see :mod:`kvfunc.core._pool`).

A linked pool's copy claims its lineage's store when it is made
(:func:`~kvfunc.core._lineage.claim`: the store itself when the pool is its
head and nobody holds it, else a fork), writes the store's lists and dict in
place, logging each entry's old value first, and gives the store back when
it freezes (:func:`~kvfunc.core._lineage.commit`: a new head) or aborts
(the writes rolled back).  A seed pool's copy edits its ring's copy.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import compress, repeat
from operator import itemgetter
from typing import Any

from kvfunc.core._builder import DeltaBuilder
from kvfunc.core._lineage import (
    CACHED,
    COUNTED,
    EVICTED,
    KEYS,
    MISSING,
    REFS,
    SLOTS,
    STORED,
    UNCACHED,
    Store,
    abort,
    claim,
    commit,
    kept,
)
from kvfunc.core._pool import PoolState

__all__ = ["PoolCopy"]


class PoolCopy:
    """The working copy of a :class:`PoolState` (see the module docstring).

    A linked pool's copy holds its store (``store``, claimed with ``log``)
    from when it is made until :meth:`freeze` or :meth:`abort`; a copy left
    with a state for the next transition claims it again (:meth:`reopen`).
    """

    __slots__ = ("by_key", "caching", "detached", "hash_of", "linked", "log", "members",
                 "num_blocks", "num_cached", "queue", "refs", "sink", "src", "store", "tagged")

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
        self.store: Store | None = None
        self.log: Any = None  # the claim's log (a list), while the store is held
        self.refs: Any = None
        self.hash_of: Any = None
        self.by_key: Any = None
        self.queue: Any = None
        if pool.ver is None:
            self.queue = pool.queue.copy()
        else:
            self._claim()

    def _claim(self) -> None:
        pool = self.src
        store, log = claim(pool.ver)  # type: ignore[arg-type]
        if store is not self.store:
            self.store = store
            self.refs = store.refs
            self.hash_of = store.hash_of
            self.by_key = store.by_key
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

    # -- the free queue ---------------------------------------------------------------
    def take(self, n: int) -> list[int]:
        """Pop ``n`` free blocks for one holder each, evicting what they cache (caller checked)."""
        out: list[int] = self.queue.pop(n)
        if self.linked:
            refs = self.refs
            if n == 1:  # the common decode step: one block, no list built
                b = out[0]
                self.log.append((REFS, b, refs[b]))
                refs[b] = 1
                if self.num_cached and self.hash_of[b] is not None:
                    self._evict_run(out)
                return out
            self.log.append((COUNTED, tuple(out), list(map(refs.__getitem__, out))))
            self.queue.bulk += n - 1
            for b in out:
                refs[b] = 1
            # a key is never empty: the blocks with a truthy key are the cached ones
            if self.num_cached and (cached := list(compress(out, map(self.hash_of.__getitem__,
                                                                      out)))):
                self._evict_run(cached)
        return out

    def free(self, ids: Sequence[int], key: str, priority: int = 0) -> None:
        """Return blocks nobody holds to the queue; cached ones wait at ``priority`` (Y, F rows)."""
        if not ids:
            return
        if len(ids) > 1:
            ids = kept(ids)  # the delta's run and the queue's log keep this one tuple
        queue, sink = self.queue, self.sink
        if priority and self.caching and sink is not None:
            sink.rows.append((key, priority))
            sink.codes.append("Y")
        if not self.linked:
            queue.push_back(ids)
        elif self.hash_of is None or not self.num_cached:
            queue.push_front(ids)
        elif len(ids) == 1:  # one block: to the back if it caches something, else the front
            if self.hash_of[ids[0]] is None:
                queue.push_front(ids)
            else:
                queue.push_back(ids, priority, self.hash_of)
        else:  # cached blocks go to the back (evicted last), the others to the front
            hash_of = self.hash_of
            front = [b for b in ids if hash_of[b] is None]
            if len(front) < len(ids):
                queue.push_back([b for b in ids if hash_of[b] is not None], priority, hash_of)
            queue.push_front(front)
        if sink is None:
            return
        if len(ids) == 1:
            sink.rows.append((key, ids[0]))
            sink.codes.append("F")
        else:  # in release order: replay frees the whole run at once
            sink.run("F", (key,), ids)

    def release(self, ids: Sequence[int], key: str, priority: int = 0) -> None:
        """Drop one holder of each block; free, in order, those that reach none."""
        if not self.linked:
            self.free(ids, key)
            return
        refs, log = self.refs, self.log.append
        if len(ids) == 1:
            b = ids[0]
            r = refs[b]
            log((REFS, b, r))
            refs[b] = r - 1
            if r == 1:
                self.free(ids, key, priority)
            return
        ids = kept(ids)
        if len(set(ids)) < len(ids):  # a block twice (holders outside the tables let go)
            self._release_repeats(ids, key, priority)
            return
        olds = list(map(refs.__getitem__, ids))
        log((COUNTED, ids, olds))
        self.queue.bulk += len(ids) - 1
        for b in ids:
            refs[b] -= 1
        self.free(ids if olds.count(1) == len(olds) else list(compress(ids, map((1).__eq__, olds))),
                  key, priority)

    def _release_repeats(self, ids: tuple[int, ...], key: str, priority: int) -> None:
        """:meth:`release` of a run that names a block more than once: one holder dropped per
        mention; a block is freed, in the run's order, where its last holder goes."""
        refs, freed = self.refs, []
        olds = dict(zip(ids, map(refs.__getitem__, ids), strict=True))  # the first of each
        self.log.append((COUNTED, tuple(olds), list(olds.values())))  # logged before written
        self.queue.bulk += len(olds) - 1
        for b in ids:
            r = refs[b]
            refs[b] = r - 1
            if r == 1:
                freed.append(b)
        self.free(freed, key, priority)

    def unhold(self, b: int) -> int:
        """Drop one holder of block ``b`` and nothing more (replay frees it on its own row):
        the holders left."""
        r = self.refs[b]
        self.log.append((REFS, b, r))
        self.refs[b] = r - 1
        return r - 1  # type: ignore[no-any-return]

    def share(self, entries: Sequence[int]) -> None:
        """Add a holder to each non-null entry's block; a free one (cached) leaves the queue."""
        ids = [b for b in entries if b] if 0 in entries else entries
        refs, queue, log = self.refs, self.queue, self.log.append
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
            return found
        first: int = found[0]
        return first

    def store_run(self, blocks: Sequence[int], keys: Sequence[bytes]) -> None:
        """Cache each block under its key (none of them holds anything cached)."""
        index, hash_of, log, n = self.by_key, self.hash_of, self.log, len(blocks)
        if n > 1 and len(set(keys)) == n and index.keys().isdisjoint(keys):
            keys, blocks = kept(keys), kept(blocks)
            log.append((CACHED, keys, blocks))  # none cached yet: one entry, one update
            self.queue.bulk += n - 1
            index.update(zip(keys, blocks, strict=True))
            for b, key in zip(blocks, keys, strict=True):
                hash_of[b] = key
        else:  # one block (the common decode step), or keys cached already or repeated
            get = index.get
            for b, key in zip(blocks, keys, strict=True):
                found = get(key, MISSING)
                log.append((STORED, key, found, b))
                index[key] = (b if found is MISSING else (found, b) if type(found) is int
                              else (*found, b))
                hash_of[b] = key
        self.num_cached += n

    def _evict_run(self, blocks: Sequence[int]) -> None:
        """Forget what ``blocks`` cache; records their E rows, in order."""
        index, hash_of, sink = self.by_key, self.hash_of, self.sink
        if len(blocks) == 1:  # the common decode step: one block taken, its E row built here
            # (as ``_evicted_rows`` spells it; through that function it costs several times more)
            b = blocks[0]
            key = hash_of[b]
            found = index[key]
            self.log.append((EVICTED, key, found, b))
            if type(found) is int:
                del index[key]
            else:
                self._drop_copy(key, found, b)
            hash_of[b] = None
            self.num_cached -= 1
            if sink is not None:
                sink.rows.append((self.members[key[-1]], b, key[:-1]) if self.tagged
                                 else (self.members[0], b, key))
                sink.codes.append("E")
            return
        keys = list(map(hash_of.__getitem__, blocks))
        if list(map(index.__getitem__, keys)) == blocks:
            blocks = kept(blocks)  # each key caches its block alone (``keys``: ours alone)
            self.log.append((UNCACHED, keys, blocks))
            self.queue.bulk += len(blocks) - 1
            for key, b in zip(keys, blocks, strict=True):
                del index[key]
                hash_of[b] = None
        else:
            log = self.log.append
            for key, b in zip(keys, blocks, strict=True):
                found = index[key]
                log((EVICTED, key, found, b))
                if type(found) is int:
                    del index[key]
                else:
                    self._drop_copy(key, found, b)
                hash_of[b] = None
        self.num_cached -= len(blocks)
        if sink is not None:
            sink.spell("E", len(blocks), _evicted_rows, self.members, self.tagged, blocks, keys)

    def _drop_copy(self, key: bytes, found: tuple[int, ...], b: int) -> None:
        """Forget block ``b``'s copy of ``key``, of the copies ``found`` (it keeps the others)."""
        rest = tuple(x for x in found if x != b)
        self.by_key[key] = rest[0] if len(rest) == 1 else rest

    def evict(self, b: int) -> bool:
        """Forget what block ``b`` caches, held or free (vLLM's ``evict_blocks``); True if it did.

        A free block keeps its place in the queue; a held block stays held.
        """
        if not self.caching or self.hash_of[b] is None:
            return False
        self._evict_run([b])
        return True

    def drop(self, ids: Sequence[int], key: str) -> None:
        """Let one detached holder of each block go (records X), freeing those nobody holds."""
        ids, sink = kept(ids), self.sink
        if sink is not None:
            sink.run("X", (key,), ids)
        self.attach(ids)
        self.release(ids, key)

    def clear(self) -> int:
        """Forget every cached key (held blocks stay held); how many blocks were cached."""
        hash_of, index, log = self.hash_of, self.by_key, self.log
        for b in [b for b in range(self.num_blocks) if hash_of[b] is not None]:
            log.append((SLOTS, b, hash_of[b]))
            hash_of[b] = None
        log.extend([(KEYS, k, v) for k, v in index.items()])
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
            self.queue.log = _closed  # writes wait for :meth:`reopen`
            if not log and len(store.next) == store.size:
                abort(store, log)  # nothing written: the store goes back as it was
                if queue is src.queue and self.detached is src.detached:
                    return src
                ver = src.ver
            else:
                ver = commit(store, log, src.ver, self.queue.bulk)  # type: ignore[arg-type]
        new = self.src = _new(PoolState, (src.name, src.members, src.num_blocks, queue, ver,
                                          src.caching, self.num_cached, self.detached))
        return new

    def abort(self) -> None:
        """Give the store back with every write of this transition undone."""
        if self.log is not None:
            abort(self.store, self.log)  # type: ignore[arg-type]
            self.log = None
            self.queue.log = _closed


def _evicted_rows(members: tuple[str, ...], tagged: bool, blocks: Sequence[int],
                  keys: Sequence[bytes]) -> Iterable[tuple[str, int, bytes]]:
    """The E rows of forgetting ``blocks``' ``keys`` (``tagged``: a shared pool's keys, which
    end in their group's index among ``members``)."""
    if tagged:
        return zip(map(members.__getitem__, map(itemgetter(-1), keys)), blocks,
                   [k[:-1] for k in keys], strict=True)
    return zip(repeat(members[0]), blocks, keys, strict=False)


def _closed(entry: Any) -> None:
    """The log of a working copy that holds no store: it must not write."""
    raise AssertionError("a pool's working copy wrote without holding its store")


_new = tuple.__new__
