"""The working copy of a caching group: the FIFO ring plus references and hashes.

See :mod:`kvfunc.core._cache_state` for the representation.  Everything a
plain :class:`~kvfunc.core._transient.GroupTransient` does still holds; this
subclass adds

* ``take``: skips stale entries, sets the taken block's count to 1 and
  evicts its cached hash (the only place eviction happens);
* ``give``: appends live entries, compacting the ring when it is full;
* ``release_blocks``: drops one reference per block and frees the blocks
  nobody holds any more;
* ``share``: adds a reference, taking a free block out of the queue (its
  ring entry turns stale);
* ``store`` / ``clear_cache``: the cached hashes (and the
  shared candidate index, see :mod:`kvfunc.core._cache_state`).

Evictions are collected in ``evicted`` and moved into the delta when the
transition finishes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pyrsistent import pvector

from kvfunc.core._cache_state import GroupCache, index_of, live_ids, valid_blocks
from kvfunc.core._state import FREE_CHUNK, NULL_BLOCK, BlockId, GroupState
from kvfunc.core._transient import CACHING_KIND, GroupTransient

__all__ = ["CacheGroupTransient"]

# A candidate list longer than this (a hot hash stored into many blocks over time, here
# or in transitions that were thrown away) makes the transition rebuild the index.
_LONG = 32


class CacheGroupTransient(GroupTransient):
    """Working copy of a :class:`GroupState` with a :class:`GroupCache`."""

    __slots__ = ("cache_src", "candidates", "entries", "evicted", "hash_of", "index",
                 "num_cached", "refs", "saved", "stale", "writable")

    counts_refs = True

    def __init__(self, group: GroupState) -> None:
        super().__init__(group)
        self._open(group.cache)
        self.evicted: list[tuple[str, BlockId, bytes]] = []
        # states saved in this transition: (block, hash, evictions before it, its stored
        # row, its copy row)
        self.saved: list[tuple[BlockId, bytes, int, int, int]] = []

    def _open(self, cache: GroupCache | None) -> None:
        """Read the published cache; vectors turn into evolvers on the first write."""
        assert cache is not None
        self.cache_src = cache
        self.refs: Any = cache.refs
        self.hash_of: Any = cache.hash_of
        self.stale: Any = cache.stale
        self.index = cache.by_hash  # shared by the lineage: only ever appended to
        self.num_cached = cache.num_cached_blocks
        self.candidates = cache.num_candidates
        self.entries = cache.num_entries
        self.writable = False

    def writing(self) -> None:
        """Make the per-block vectors editable (once per transition, on the first write)."""
        if not self.writable:
            if len(self.index) > self._limit():  # grown by others: add nothing to it
                self.index, self.candidates = index_of(self.hash_of), self.num_cached
            self.refs = self.refs.evolver()
            self.hash_of = self.hash_of.evolver()
            self.stale = self.stale.evolver()
            self.writable = True
            self.changed = True

    def _limit(self) -> int:
        """Candidates beyond which the index is rebuilt (twice the blocks)."""
        return 2 * self.policy.num_blocks + 64

    # -- the queue ---------------------------------------------------------------
    def take(self, n: int) -> tuple[BlockId, ...]:
        """Pop ``n`` live ids from the head, evicting their cached hashes."""
        self.writing()
        out: list[BlockId] = []
        refs, stale, hash_of, evicted = self.refs, self.stale, self.hash_of, self.evicted
        key, add, gone = self.key, out.append, len(evicted)
        h = self.head
        while len(out) < n:
            want = n - len(out)
            run, h = self._read(h, want)
            self.entries -= want
            for b in run:
                s = stale[b]
                if s:
                    stale[b] = s - 1
                    continue
                add(b)
                refs[b] = 1
                old = hash_of[b]
                if old is not None:  # evicted: recorded for the delta
                    hash_of[b] = None
                    evicted.append((key, b, old))
        self.num_cached -= len(evicted) - gone
        self.head = h
        self.count -= n
        self.changed = True
        return tuple(out)

    def give(self, ids: Any) -> None:
        """Append live entries at the tail (compacting the ring first when it is full)."""
        new = ids if isinstance(ids, list | tuple) else list(ids)
        if not new:
            return
        self.writing()
        if self.entries + len(new) > self.cap:
            self._compact()
        self._write((self.head + self.entries) % self.cap, new)
        self.entries += len(new)
        self.count += len(new)
        self.changed = True

    def _compact(self) -> None:
        """Rewrite the ring with its live entries only (order kept, stale counts zeroed)."""
        live = self.free_ids()
        pad = self.cap - len(live)
        ids = live + [NULL_BLOCK] * pad
        self.ring = pvector(tuple(ids[i:i + FREE_CHUNK]) for i in range(0, len(ids), FREE_CHUNK))
        self.dirty = None
        self.head = 0
        self.entries = len(live)
        self.stale = pvector([0] * self.policy.num_blocks).evolver()

    def free_ids(self) -> list[BlockId]:
        """Live free ids in hand-out order (O(entries); for checks and compaction)."""
        return list(live_ids(self._chunk, FREE_CHUNK, self.head, self.cap, self.entries,
                             self.stale))

    # -- references ----------------------------------------------------------------
    def release_blocks(self, ids: list[BlockId] | tuple[BlockId, ...]) -> list[BlockId]:
        """Drop one reference to each of ``ids``; free (in order) those that reach 0."""
        self.writing()
        refs = self.refs
        freed = []
        for b in ids:
            r = refs[b] - 1
            refs[b] = r
            if not r:
                freed.append(b)
        self.changed = True
        self.give(freed)
        return freed

    def share(self, blocks: tuple[BlockId, ...]) -> list[BlockId]:
        """Add a reference to each real block of ``blocks``; return those that were free.

        A free block leaves the queue (its ring entry turns stale).
        """
        self.writing()
        refs, stale = self.refs, self.stale
        touched = []
        for b in blocks:
            if b:
                r = refs[b]
                refs[b] = r + 1
                if not r:
                    stale[b] += 1
                    touched.append(b)
        self.count -= len(touched)
        self.changed = True
        return touched

    # -- the hash index ------------------------------------------------------------
    def lookup(self, block_hash: bytes) -> tuple[BlockId, ...]:
        """Blocks cached under ``block_hash`` (ascending)."""
        return valid_blocks(self.index, self.hash_of, block_hash)

    def store(self, b: BlockId, block_hash: bytes) -> None:
        """Cache ``b`` (a full block) under ``block_hash``."""
        self.store_run((b,), (block_hash,))

    def store_run(self, blocks: Sequence[BlockId], block_hashes: Sequence[bytes]) -> None:
        """Cache each block under its hash (a prefill caches a run)."""
        self.writing()
        hash_of, index = self.hash_of, self.index
        get = index.get
        for b, h in zip(blocks, block_hashes, strict=True):
            hash_of[b] = h
            have = get(h)
            if have is None:  # atomic: a sibling transition may add this hash meanwhile
                have = index.setdefault(h, [b])
            if have[-1] != b and b not in have:
                have.append(b)
                if len(have) > _LONG:  # a hot hash: rebuild the index when freezing
                    self.candidates = self._limit() + 1
        self.num_cached += len(blocks)
        self.candidates += len(blocks)

    def clear_cache(self) -> int:
        """Forget every cached hash (held blocks stay held); returns how many were cached."""
        self.writing()
        hash_of = self.hash_of
        for b in range(self.policy.num_blocks):
            if hash_of[b] is not None:
                hash_of[b] = None
        n, self.num_cached = self.num_cached, 0
        self.index = {}
        self.candidates = 0
        self.changed = True
        return n

    # -- freezing ------------------------------------------------------------------
    def _frozen_cache(self) -> GroupCache:
        if not self.writable:
            return self.cache_src
        hash_of = self.hash_of.persistent()
        index, candidates = self.index, self.candidates
        if candidates > self._limit():  # mostly stale: start a fresh one
            index, candidates = index_of(hash_of), self.num_cached
        cache = GroupCache(self.refs.persistent(), hash_of, index, self.stale.persistent(),
                           self.entries, self.num_cached, candidates)
        self._open(cache)  # the published vectors are shared from now on
        return cache


CACHING_KIND.append(CacheGroupTransient)
