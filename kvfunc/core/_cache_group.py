"""The working copy of a caching group: reference counts, the hash store, the eviction order.

See :mod:`kvfunc.core._cache` for the representation.  This subclass of
:class:`~kvfunc.core._group.GroupCopy` changes what its primitives mean:

* ``take``: the stack of uncached free blocks first, then the ring, whose
  cached blocks are *evicted* as they are handed out (the only place
  eviction happens); a taken block has one holder;
* ``release``: drops one holder per block; ``free`` puts a block nobody
  holds on the stack if it holds nothing cached, else at the ring's tail;
* ``share``: appends entries by reference (a prefix hit, a fork), taking a
  free cached block out of the ring (its entry turns stale);
* ``store``: caches full blocks under their hashes;
* ``copy_on_write``, ``save_state``, ``clear``.

Every primitive records its rows in the delta in the order it acts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pyrsistent import pvector

from kvfunc.core._cache import GroupCache, index_of, live_ring_ids, valid_blocks
from kvfunc.core._delta import COPY_SAVED, DeltaBuilder
from kvfunc.core._group import CACHING_KIND, GroupCopy
from kvfunc.core._pool import FREE_CHUNK
from kvfunc.core._rows import Row, extend_row, leading_nulls, replace_entry
from kvfunc.core._state import GroupState

__all__ = ["CachingGroupCopy"]

_new = tuple.__new__
# A candidate list longer than this that is mostly stale (a hot hash stored into many
# blocks over time, here or in transitions that were thrown away) makes the transition
# rebuild the index.  A hash cached in many blocks at once is not stale: no rebuild.
_LONG = 32


class CachingGroupCopy(GroupCopy):
    """The working copy of a :class:`~kvfunc.core._state.GroupState` with a cache."""

    __slots__ = ("cache_src", "candidates", "entries", "hash_of", "index", "num_cached", "refs",
                 "stack", "stale", "top", "writable")

    caching = True

    def __init__(self, group: GroupState, sink: DeltaBuilder | None) -> None:
        super().__init__(group, sink)
        self._open(group.cache)

    def _open(self, cache: GroupCache | None) -> None:
        """Read the published cache; its vectors turn into evolvers on the first write."""
        assert cache is not None
        self.cache_src = cache
        self.refs: Any = cache.refs
        self.hash_of: Any = cache.hash_of
        self.stale: Any = cache.stale
        self.stack: Any = cache.stack
        self.top = cache.stack_top
        self.index = cache.by_hash  # shared by the lineage: only ever appended to
        self.num_cached = cache.num_cached_blocks
        self.candidates = cache.num_candidates
        self.entries = cache.ring_entries
        self.writable = False

    def writing(self) -> None:
        """Make the per-block vectors editable (once per transition, on the first write).

        A writable copy counts as changed until it is frozen, so the primitives that call
        this need not mark it themselves.
        """
        if not self.writable:
            if len(self.index) > self._limit():  # grown by others: add nothing to it
                self.index, self.candidates = index_of(self.hash_of), self.num_cached
            self.refs = self.refs.evolver()
            self.hash_of = self.hash_of.evolver()
            self.stale = self.stale.evolver()
            self.stack = self.stack.evolver()
            self.writable = True
            self.changed = True

    def _limit(self) -> int:
        """Candidates beyond which the index is rebuilt (twice the blocks)."""
        return 2 * self.policy.num_blocks + 64

    # -- the free queue -----------------------------------------------------------
    def take(self, n: int) -> list[int]:
        """Pop ``n`` free blocks: stacked ones first, then the ring's, evicting their hashes."""
        self.writing()
        stack, top = self.stack, self.top
        k = n if n <= top else top
        out = [stack[i] for i in range(top - 1, top - 1 - k, -1)]
        self.top = top - k
        if k < n:
            out.extend(self._pop_ring(n - k))
        refs = self.refs
        for b in out:
            refs[b] = 1
        self.count -= n
        return out

    def _pop_ring(self, n: int) -> list[int]:
        """``n`` live blocks from the ring's head, skipping stale entries, evicting hashes."""
        out: list[int] = []
        stale, hash_of, ring, sink, key = self.stale, self.hash_of, self.ring, self.sink, self.key
        while len(out) < n:
            want = n - len(out)
            self.entries -= want
            for b in ring.pop(want):
                s = stale[b]
                if s:
                    stale[b] = s - 1
                    continue
                out.append(b)
                old = hash_of[b]
                if old is not None:  # evicted
                    hash_of[b] = None
                    self.num_cached -= 1
                    if sink is not None:
                        sink.evicted.append((key, b, old))
                        sink.order.append("E")
        return out

    def free(self, ids: Sequence[int]) -> None:
        """Free blocks nobody holds: uncached ones onto the stack, cached ones to the ring."""
        if not ids:
            return
        self.writing()
        hash_of, stack = self.hash_of, self.stack
        cached = []
        for b in ids:
            if hash_of[b] is None:
                if self.top < len(stack):
                    stack[self.top] = b
                else:
                    stack.append(b)
                self.top += 1
            else:
                cached.append(b)
        if cached:
            if self.entries + len(cached) > self.ring.cap:
                self._compact()
            ring = self.ring
            ring.write((ring.head + self.entries) % ring.cap, cached)
            self.entries += len(cached)
        self.count += len(ids)
        sink = self.sink
        if sink is not None:
            key = self.key
            sink.freed.extend([(key, b) for b in ids])
            sink.order.append("F" * len(ids))

    def _compact(self) -> None:
        """Rewrite the ring with its live entries only (order kept, stale counts zeroed)."""
        live = self.ring_ids()
        self.ring.reset(live)
        self.entries = len(live)
        self.stale = pvector([0] * self.policy.num_blocks).evolver()

    def ring_ids(self) -> list[int]:
        """The ring's live entries in hand-out order (O(entries))."""
        ring = self.ring
        return list(live_ring_ids(ring.chunk, FREE_CHUNK, ring.head, ring.cap, self.entries,
                                  self.stale))

    def free_ids(self) -> list[int]:
        """Every free block in hand-out order (for checks and the compat pool)."""
        return [self.stack[i] for i in range(self.top - 1, -1, -1)] + self.ring_ids()

    # -- references -------------------------------------------------------------------
    def release(self, ids: Sequence[int]) -> None:
        """Drop one holder of each block; free, in order, those that reach none."""
        self.writing()
        refs = self.refs
        freed = []
        for b in ids:
            r = refs[b] - 1
            refs[b] = r
            if not r:
                freed.append(b)
        self.free(freed)

    def release_order(self, row: Row) -> list[int]:
        """Last block first: a prefix's tail is evicted before its head."""
        return row.ids[row.length - 1:row.nulls - 1 if row.nulls else None:-1]

    def reclaimable(self, row: Row, upto: int) -> int:
        """Recycled blocks that nobody else holds (they return to the queue)."""
        refs = self.refs
        return sum(1 for b in row.ids[row.nulls:upto] if refs[b] == 1)

    def share(self, request_id: int | str, row: Row, entries: Sequence[int]) -> Row:
        """Append ``entries`` by reference (0: a null entry); free cached ones leave the ring.

        Null entries may only extend a row's null prefix.  ``stored`` advances
        over the cached entries that follow the row's cached prefix, and
        ``shared`` covers every entry.
        """
        self.writing()
        refs, stale, hash_of = self.refs, self.stale, self.hash_of
        sink, key = self.sink, self.key
        n = row.length
        lead = leading_nulls(entries) if n == row.nulls else 0
        stored = max(row.stored, row.nulls + lead)
        for p, b in enumerate(entries, n):
            if b:
                r = refs[b]
                refs[b] = r + 1
                if not r:  # a free cached block: its ring entry turns stale
                    stale[b] += 1
                    self.count -= 1
                if p == stored and hash_of[b] is not None:
                    stored = p + 1
                if sink is not None:
                    sink.shared.append((key, request_id, b))
                    sink.order.append("S")
            elif sink is not None:
                sink.appended.append((key, request_id, 0))
                sink.order.append("A")
        grown = extend_row(row, entries[lead:], lead)
        return _new(Row, (grown.ids, grown.length, grown.nulls, grown.length, stored))

    def copy_on_write(self, request_id: int | str, row: Row, position: int) -> Row:
        """Give the request its own copy of the shared block at ``position``."""
        src = row.ids[position]
        (dst,) = self.take(1)
        if self.sink is not None:
            self.sink.copied.append((self.key, request_id, position, src, dst))
            self.sink.order.append("C")
        self.release((src,))
        new = replace_entry(row, position, dst)
        if position < new.stored:  # the copy holds nothing cached yet
            new = _new(Row, (new.ids, new.length, new.nulls, new.shared, position))
        return new

    # -- the hash store -----------------------------------------------------------------
    def lookup(self, block_hash: bytes) -> tuple[int, ...]:
        """Blocks cached under ``block_hash`` (ascending)."""
        return valid_blocks(self.index, self.hash_of, block_hash)

    def cache_block(self, b: int, block_hash: bytes) -> None:
        """Cache block ``b`` under ``block_hash`` (no delta row: the caller records it)."""
        self.cache_blocks((b,), (block_hash,))

    def cache_blocks(self, blocks: Sequence[int], block_hashes: Sequence[bytes]) -> None:
        """Cache each block under its hash (a run of a prefill, or one block)."""
        if not self.writable:
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
                if len(have) > _LONG:  # a long list: rebuild the index if it is mostly stale
                    valid = sum(1 for x in have if hash_of[x] == h)
                    if len(have) > 2 * valid + _LONG:
                        self.candidates = self._limit() + 1
        self.num_cached += len(blocks)
        self.candidates += len(blocks)

    def store(self, request_id: int | str, row: Row, upto: int, hashes: Any) -> Row:
        """Cache the row's full blocks from ``max(stored, nulls)`` to ``upto - 1``.

        ``hashes`` covers them (the caller checked); a block already cached
        (one this request shares) is passed over.
        """
        p = row.stored if row.stored > row.nulls else row.nulls
        if p >= upto:
            return row
        ids, hash_of, bs = row.ids, self.hash_of, self.block_size
        m = bs // hashes.block_size
        digests, tokens = hashes._digests, hashes._tokens  # the value owns what ``upto`` reads
        if upto == p + 1:  # one block filled: the decode step
            run = [p] if hash_of[ids[p]] is None else []
        else:
            run = [q for q in range(p, upto) if hash_of[ids[q]] is None]  # shared: cached
        blocks = [ids[q] for q in run]
        new = [digests[(q + 1) * m - 1] for q in run]
        self.cache_blocks(blocks, new)
        sink = self.sink
        if sink is not None and run:
            key = self.key
            sink.stored.extend([
                (key, request_id, q, b, h, digests[q * m - 1] if q else None,
                 tuple(tokens[q * bs:(q + 1) * bs])) for q, b, h in zip(run, blocks, new,
                                                                         strict=True)])
            sink.order.append("T" * len(run))
        return _new(Row, (ids, row.length, row.nulls, max(row.shared, upto), upto))

    def save_state(self, request_id: int | str, row: Row, index: int, hashes: Any) -> None:
        """Copy the request's state into a free block cached under hash ``index`` (once)."""
        h = hashes._digests[index]
        if self.lookup(h):
            return
        (dst,) = self.take(1)
        sink = self.sink
        if sink is not None:
            sink.copied.append((self.key, request_id, COPY_SAVED, row.ids[row.nulls], dst))
            sink.order.append("C")
        self.cache_block(dst, h)
        if sink is not None:
            parent = hashes.parent_hash(index)
            sink.stored.append((self.key, request_id, COPY_SAVED, dst, h, parent, ()))
            sink.order.append("T")
        self.release((dst,))

    def clear(self) -> int:
        """Forget every cached hash (held blocks stay held); returns how many were cached."""
        self.writing()
        hash_of = self.hash_of
        for b in range(self.policy.num_blocks):
            if hash_of[b] is not None:
                hash_of[b] = None
        n, self.num_cached = self.num_cached, 0
        self.index = {}
        self.candidates = 0
        rows = self.rows
        for slot in range(len(rows)):
            row = rows[slot]
            if row is not None and row.stored:
                self.put(slot, _new(Row, (row.ids, row.length, row.nulls, row.shared, 0)))
        if self.sink is not None:
            self.sink.cleared.append((self.key,))
            self.sink.order.append("Z")
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
                           self.entries, self.stack.persistent(), self.top, self.num_cached,
                           candidates)
        self._open(cache)  # the published vectors are shared from now on
        return cache


CACHING_KIND.append(CachingGroupCopy)
