"""Prefix caching: look up a request's cached prefix and allocate with it.

Theory of operation
-------------------
A state created with ``enable_prefix_caching=True`` counts references and
caches full blocks under their chained hash (:class:`~kvfunc.BlockHashes`).
A scheduler admits a request in two steps, like vLLM's:

1. ``hit = lookup_prefix(state, hashes, max_tokens=len(prompt) - 1)`` finds
   the longest prefix that is cached for *every* group at once;
2. ``allocate_slots(state, rid, hit.num_tokens, len(prompt) - hit.num_tokens,
   block_hashes=hashes, prefix_hit=hit)`` puts the hit blocks in the new
   request's tables (shared, reference counted) and allocates the rest.

Later calls pass ``block_hashes`` too, so that each block caches itself once
it is full (once the tokens scheduled in the step cover it).

What a hit of ``L`` tokens needs, per group (``L`` is a multiple of every
group's block size)::

    full attention   every block before L cached         [h0 h1 h2 h3] L = 4 blocks
    sliding window   only the blocks inside the window   [ -  - h2 h3] window 2 blocks
    state (Mamba)    a state saved exactly at L          (copied into a new block)

Full attention hits are prefix-closed, sliding windows and states are not,
so the lookup tries lengths from the full-attention hit downwards until every
group accepts one.  States are saved by copying the running state into a
cached block whenever a request's computed tokens reach a multiple of the
state group's block size; a hit copies the saved state into the new
request's own block (states change in place, so they are never shared).

Order within a transition: each request's step applies its plan, then its
copy-on-write copies, then caches its full blocks or saves its state, before
the next request's step, so a batch equals the same calls made one by one.
Copies and appended blocks take from the same pool; each copy row records
how many appended rows preceded it (``copied_after``) so that replay takes
them in the same order.  Only evictions are collected until the transition
ends (:func:`finish_cached`).

A sliding-window group keeps only the blocks of its window: a one-shot
prefill of a long prompt never holds the blocks before its last window, so a
later prompt that shares only a prefix of it finds nothing cached for that
group (identical prompts, shorter prompts and chunked prefills do).  A forked
child must hash its *own* tokens (``BlockHashes.of(child_tokens)``): the
parent's hashes may name tokens the child never had.
"""

from __future__ import annotations

from math import lcm
from typing import Any

import attrs

from kvfunc.core._cache_state import valid_blocks
from kvfunc.core._cache_transient import CacheGroupTransient
from kvfunc.core._delta import COPY_INTO_NEW, COPY_SAVED, DeltaBuilder
from kvfunc.core._errors import InvalidArgumentError, InvalidTypeError, NotSupportedError
from kvfunc.core._hashing import BlockHashes, check_block_hashes
from kvfunc.core._state import NULL_BLOCK, BlockId, FrozenDict, KVState, RequestId
from kvfunc.core._steps import apply_plan, plan_group
from kvfunc.core._transient import Transient

__all__ = ["PrefixHit", "allocate_cached", "cache_after_step", "check_prefix_args",
           "copy_on_write", "finish_cached", "lookup_prefix", "quiet", "uncached_full_block"]


@attrs.frozen(slots=True)
class PrefixHit:
    """The cached prefix of a request: what :func:`lookup_prefix` found.

    Attributes:
        num_tokens: tokens whose KV is cached (pass as ``computed_tokens``).
        block_ids: per group, the table the hit gives the request (null
            entries before a sliding window; a state group's saved block).
        query_tokens: tokens that were looked up (for the hit rate).
    """

    num_tokens: int
    block_ids: FrozenDict[str, tuple[BlockId, ...]]
    query_tokens: int


def _require_caching(state: KVState, what: str) -> None:
    if not state.prefix_caching:
        msg = f"{what} needs a state created with enable_prefix_caching=True"
        raise NotSupportedError(msg)


def _ratio(block_size: int, hashes: BlockHashes, key: str) -> int:
    if block_size % hashes.block_size:
        msg = (f"group {key!r} has block_size {block_size}, not a multiple of the hashes' "
               f"block_size {hashes.block_size}")
        raise InvalidArgumentError(msg)
    return block_size // hashes.block_size


def lookup_prefix(state: KVState, block_hashes: BlockHashes, *,
                  max_tokens: int | None = None) -> PrefixHit:
    """The longest prefix of ``block_hashes`` cached in every group (a query).

    ``max_tokens`` caps the hit (pass ``len(prompt) - 1`` so that at least
    one token is computed).

    Raises:
        NotSupportedError: the state has no prefix cache.
        InvalidTypeError, InvalidArgumentError: bad hashes or cap, or a group
            block size that is not a multiple of the hashes' block size.

    >>> from kvfunc.core import BlockHashes, FullAttention, KVState, allocate_slots
    >>> s = KVState.create({"full": FullAttention(num_blocks=8, block_size=4)}, 64,
    ...                    enable_prefix_caching=True)
    >>> h = BlockHashes.of(range(10), 4)
    >>> s = allocate_slots(s, "a", 0, 10, block_hashes=h).state
    >>> hit = lookup_prefix(s, h, max_tokens=9)
    >>> hit.num_tokens, dict(hit.block_ids)
    (8, {'full': (1, 2)})
    """
    _require_caching(state, "lookup_prefix")
    hashes = check_block_hashes(block_hashes)
    if max_tokens is not None and (type(max_tokens) is not int or max_tokens < 0):
        msg = f"max_tokens must be None or a non-negative int, got {max_tokens!r}"
        raise InvalidArgumentError(msg)
    hbs, hs = hashes.block_size, hashes._digests
    tr = Transient(state)
    groups: list[CacheGroupTransient] = list(tr.groups)  # type: ignore[arg-type]
    step = lcm(*(g.block_size for g in groups)) if groups else 1
    ratios = [_ratio(g.block_size, hashes, g.key) for g in groups]
    limit = hashes.num_blocks * hbs
    query = limit if max_tokens is None else min(limit, max_tokens)
    best = query
    scanned: dict[int, list[BlockId]] = {}  # full attention: the blocks its scan found
    for i, g in enumerate(groups):  # full attention: one forward scan
        if g.grows and g.window is None and not g.may_skip:
            index, hash_of, bs, m = g.index, g.hash_of, g.block_size, ratios[i]
            ids = scanned[i] = []
            # ``g.lookup`` inlined: the admission's longest loop
            for h in hs[m - 1:best // bs * m:m]:
                found = index.get(h)
                if found is None:
                    break
                if len(found) == 1 and hash_of[found[0]] == h:
                    ids.append(found[0])
                    continue
                valid = valid_blocks(index, hash_of, h)
                if not valid:
                    break
                ids.append(valid[0])
            best = len(ids) * bs
    best -= best % step
    memo: dict[tuple[int, int], bool] = {}

    def cached(i: int, pos: int) -> bool:  # is group i's block at ``pos`` cached?
        got = memo.get((i, pos))
        if got is None:
            got = memo[(i, pos)] = bool(groups[i].lookup(hs[(pos + 1) * ratios[i] - 1]))
        return got

    def accepts(i: int, length: int) -> int:
        """``length`` if group ``i`` accepts it, else a bound below it for the next try."""
        g = groups[i]
        bs = g.block_size
        if not g.grows:
            return length if cached(i, length // bs - 1) else length - step
        if g.window is not None:  # lengths whose window holds an uncached block all fail
            first = max(0, length - g.window + 1) // bs
            for p in range(length // bs - 1, first - 1, -1):
                if not cached(i, p):
                    return p * bs
            return length
        return length if not g.may_skip else 0  # a full group accepts any shorter length

    while best > 0:
        bound = min(accepts(i, best) for i in range(len(groups)))
        if bound == best:
            break
        best = bound - bound % step
    tables: dict[str, tuple[BlockId, ...]] = {}
    for i, g in enumerate(groups):
        bs, m = g.block_size, ratios[i]
        if best == 0:
            tables[g.key] = ()
        elif not g.grows:
            tables[g.key] = (g.lookup(hs[best // hbs - 1])[0],)
        elif i in scanned:
            tables[g.key] = tuple(scanned[i][:best // bs])
        else:
            first = 0 if g.window is None else max(0, best - g.window + 1) // bs
            tables[g.key] = (NULL_BLOCK,) * first + tuple(
                g.lookup(hs[(p + 1) * m - 1])[0] for p in range(first, best // bs))
    return PrefixHit(best, FrozenDict(tables), query)


def check_prefix_args(state: KVState, request_id: RequestId, computed: int,
                      manager_keys: Any, block_hashes: object, prefix_hit: object) -> None:
    """Checks the caching arguments of an allocation before anything changes."""
    if block_hashes is None and prefix_hit is None:
        return
    _require_caching(state, "block_hashes / prefix_hit")
    if block_hashes is not None:
        hashes = check_block_hashes(block_hashes)
        for g in state.groups:
            _ratio(g.policy.block_size, hashes, g.key)
    if prefix_hit is None:
        return
    if not isinstance(prefix_hit, PrefixHit):
        raise InvalidTypeError(f"prefix_hit must be a PrefixHit, got {type(prefix_hit).__name__}")
    if block_hashes is None:
        raise InvalidArgumentError("a prefix_hit needs the block_hashes it was looked up with")
    if manager_keys is not None:
        raise InvalidArgumentError("a prefix_hit applies to every group: manager_keys must be None")
    if computed != prefix_hit.num_tokens:
        msg = (f"computed_tokens must equal the hit's num_tokens ({prefix_hit.num_tokens}) "
               f"when admitting with a prefix_hit, got {computed}")
        raise InvalidArgumentError(msg)
    if set(prefix_hit.block_ids) != set(state.manager_keys):
        raise InvalidArgumentError("the prefix_hit was looked up on a state with other groups")
    n = prefix_hit.num_tokens
    if type(n) is not int or not 0 <= n <= hashes.num_tokens:
        msg = f"the prefix_hit's {n!r} tokens are not covered by the block_hashes"
        raise InvalidArgumentError(msg)
    for g in state.groups:
        entries, policy = prefix_hit.block_ids[g.key], g.policy
        want = 0 if not n else n // policy.block_size if policy.grows_with_tokens else 1
        if (not isinstance(entries, tuple) or len(entries) != want
                or not set(map(type, entries)) <= {int}
                or (entries and not 0 <= min(entries) <= max(entries) < policy.num_blocks)):
            msg = f"the prefix_hit's blocks of {g.key!r} do not fit the state: {entries!r}"
            raise InvalidArgumentError(msg)
    if any(request_id in g.tables for g in state.groups):
        msg = f"request {request_id!r} is already registered; a prefix_hit admits new requests"
        raise InvalidArgumentError(msg)


def _hit_fits(g: CacheGroupTransient, entries: tuple[BlockId, ...], hashes: BlockHashes,
              num_tokens: int) -> tuple[bool, int]:
    """Whether the hit's blocks still hold its hashes, and how many are free now."""
    hs, hash_of, refs = hashes._digests, g.hash_of, g.refs
    if not g.grows:
        return hash_of[entries[0]] == hs[num_tokens // hashes.block_size - 1], 0
    m = g.block_size // hashes.block_size
    free = 0
    for p, b in enumerate(entries):
        if b:
            if hash_of[b] != hs[(p + 1) * m - 1]:
                return False, 0
            if not refs[b]:
                free += 1
    return True, free


def _cow_positions(g: CacheGroupTransient, table: tuple[BlockId, ...], computed: int,
                   total: int) -> list[int]:
    """Table positions the step writes whose block someone else holds too."""
    refs = g.refs
    if g.grows:
        first, last = computed // g.block_size, min(len(table), -(-total // g.block_size))
        return [p for p in range(first, last) if table[p] and refs[table[p]] > 1]
    return [p for p, b in enumerate(table) if b and refs[b] > 1]


def allocate_cached(tr: Transient, groups: Any, request_id: RequestId, computed: int,
                    written: int, total: int, reserved: int, sink: DeltaBuilder,
                    hashes: BlockHashes | None, hit: PrefixHit | None) -> bool:
    """The per-request step on a caching transient; on refusal nothing changes."""
    plans = []
    stores = []
    for g in groups:
        table = g.tables.get(request_id)
        if (table and hit is None and not reserved and g.grows
                and quiet(g.block_size, g.window, g.may_skip, g.refs, table, computed, total)):
            # The common decode step: no new block, nothing slid out, nothing shared written.
            if hashes is not None and uncached_full_block(g.block_size, g.hash_of, table, written,
                                                          hashes):
                stores.append(g)  # after every group has accepted the request
            continue
        base, extra, src = table, 0, NULL_BLOCK
        if hit is not None and hit.num_tokens:
            entries = hit.block_ids[g.key]
            assert hashes is not None
            fits, extra = _hit_fits(g, entries, hashes, hit.num_tokens)
            if not fits:
                return False  # evicted since the lookup: the scheduler looks up again
            if g.grows:
                base = entries
            else:
                src = entries[0]
        lo, k, nulls, need = plan_group(g, base, computed, total)
        cow = _cow_positions(g, table, computed, total) if table else []
        refs = g.refs
        avail = g.count + sum(1 for p in range(lo, k) if refs[base[p]] == 1)  # type: ignore[index,unused-ignore]
        if reserved:
            avail -= g.policy.num_reserved_blocks(reserved, len(g.tables))
        if need + extra + len(cow) > avail:
            return False
        plans.append((g, table, base, lo, k, nulls, need, src, cow))
    for g in stores:
        store_full_blocks(g, request_id, written, hashes, sink.cache_rows().stored)  # type: ignore[arg-type]
    rows = sink.cache_rows() if plans or hit is not None else None
    for g, table, base, lo, k, nulls, need, src, cow in plans:
        assert rows is not None
        key = g.key
        if table is None and base is not None:  # admitted with a hit: share its blocks
            sink.registered.append((key, request_id))
            sink.appended.extend([(key, request_id, b) for b in base])
            rows.shared.extend([(key, request_id, b) for b in base if b])
            rows.touched.extend([(key, b) for b in g.share(base)])
            g.set_table(request_id, base)
        apply_plan(g, request_id, base, lo, k, nulls, need, sink)
        if src:
            rows.copied.append((key, request_id, COPY_INTO_NEW, src, g.tables[request_id][0],
                                len(sink.appended)))
        for pos in cow:
            copy_on_write(g, request_id, pos, sink)
        if hashes is not None:
            cache_after_step(g, request_id, computed, written, hashes, sink)
    if rows is not None and hit is not None:
        rows.hits.append((request_id, hit.num_tokens, hit.query_tokens))
    return True


def quiet(bs: int, w: int | None, may_skip: bool, refs: Any, table: tuple[BlockId, ...],
          computed: int, total: int) -> bool:
    """True when a step needs no block, recycles none and writes no shared block.

    ``bs``, ``w``, ``may_skip`` describe a growing group; ``refs`` is its
    reference counts (None without caching: nothing is shared).
    """
    held = len(table)
    if total > held * bs:
        return False
    if w is not None:
        k = (computed - w + 1) // bs
        if k > 0 and table[(k if k < held else held) - 1] != NULL_BLOCK:
            return False
    elif may_skip:
        return False
    if refs is not None and total:
        p, last = computed // bs, (total - 1) // bs
        while p <= last:
            b = table[p]
            if b and refs[b] > 1:
                return False
            p += 1
    return True


def uncached_full_block(bs: int, hash_of: Any, table: tuple[BlockId, ...], written: int,
                         hashes: BlockHashes) -> bool:
    """Whether the last full block a step leaves behind still has to be cached."""
    full = written // bs
    held = len(table)
    if full > held:
        full = held
    covered = hashes.num_blocks * hashes.block_size // bs
    if covered < full:
        full = covered
    if not full:
        return False
    b = table[full - 1]
    return bool(b) and hash_of[b] is None


def cache_after_step(g: CacheGroupTransient, rid: RequestId, computed: int, written: int,
                     hashes: BlockHashes, sink: DeltaBuilder) -> None:
    """Cache what the request's step completed: full blocks, or a state at a boundary."""
    if g.grows:
        if uncached_full_block(g.block_size, g.hash_of, g.tables[rid], written, hashes):
            store_full_blocks(g, rid, written, hashes, sink.cache_rows().stored)
    elif (computed and not computed % g.block_size and computed <= hashes.num_tokens
          and g.count):
        save_state(g, rid, computed, hashes, sink)


def finish_cached(tr: Transient, sink: DeltaBuilder) -> None:
    """Move the transition's evictions into the delta.

    A state saved and evicted again within one transition (a batch whose
    later requests used up the free queue) leaves no trace: its stored row
    and its eviction cancel, and its copy becomes a copy of the block onto
    itself (replay still takes and returns the block), so every stored row of
    a delta is still cached at its end and events stay in the order
    removals, then stores.
    """
    undone: list[int] = []
    for g in tr.groups:
        assert isinstance(g, CacheGroupTransient)
        evicted, saved = g.evicted, g.saved
        if saved:
            g.saved = []
            gone: set[int] = set()  # evictions that undo a save of this transition
            rows = sink.cache_rows()
            for b, h, first, stored_at, copied_at in saved:
                for i in range(first, len(evicted)):  # the first eviction after the save
                    if i not in gone and evicted[i][1] == b and evicted[i][2] == h:
                        gone.add(i)
                        undone.append(stored_at)
                        c = rows.copied[copied_at]  # copies onto itself: replay takes, gives
                        rows.copied[copied_at] = (c[0], c[1], COPY_SAVED, b, b, c[5])
                        break
            if gone:
                evicted = [row for i, row in enumerate(evicted) if i not in gone]
        if evicted:
            sink.cache_rows().evicted.extend(evicted)
            g.evicted = []
    if undone:
        stored = sink.cache_rows().stored
        for i in sorted(undone, reverse=True):
            del stored[i]


def copy_on_write(g: CacheGroupTransient, rid: RequestId, pos: int, sink: DeltaBuilder) -> None:
    """Give ``rid`` its own copy of the block at ``pos`` (phase 1 counted the block)."""
    table = g.tables[rid]
    src = table[pos]
    (dst,) = g.take(1)
    g.set_table(rid, table[:pos] + (dst,) + table[pos + 1:])
    g.release_blocks((src,))  # replay releases it at the copy row too (no freed row)
    sink.cache_rows().copied.append((g.key, rid, pos, src, dst, len(sink.appended)))


def store_full_blocks(g: CacheGroupTransient, rid: RequestId, written: int,
                       hashes: BlockHashes, out: list[Any]) -> None:
    """Cache the request's full blocks that are not cached yet (newest first found)."""
    table = g.tables.get(rid)
    if not table:
        return
    bs, hs, hash_of = g.block_size, hashes._digests, g.hash_of
    m = bs // hashes.block_size
    full = min(hashes.num_blocks // m, written // bs, len(table))
    p = full - 1
    while p >= 0 and table[p] and hash_of[table[p]] is None:
        p -= 1
    first = p + 1
    if first >= full:
        return
    key = g.key
    if first == full - 1:  # the common case: the block a decode step just filled
        b, h = table[first], hs[full * m - 1]
        g.store(b, h)
        out.append((key, b, h, hashes.parent_hash(first * m),
                    hashes.token_ids_by_block(first, full, bs)[0]))
        return
    blocks = list(table[first:full])
    tokens = hashes.token_ids_by_block(first, full, bs)
    if m == 1:
        new = hs[first:full]
        parents = [hs[first - 1] if first else None, *new[:-1]]
    else:
        new = [hs[(q + 1) * m - 1] for q in range(first, full)]
        parents = [hs[q * m - 1] if q else None for q in range(first, full)]
    g.store_run(blocks, new)
    out.extend(zip([key] * len(blocks), blocks, new, parents, tokens, strict=True))


def save_state(g: CacheGroupTransient, rid: RequestId, computed: int, hashes: BlockHashes,
               sink: DeltaBuilder) -> None:
    """Copy the request's state into a free cached block, unless that state is cached."""
    index = computed // hashes.block_size - 1
    h = hashes._digests[index]
    table = g.tables.get(rid)
    if not table or g.lookup(h):
        return
    (dst,) = g.take(1)
    g.refs[dst] = 0
    g.store(dst, h)
    g.give((dst,))
    rows = sink.cache_rows()
    g.saved.append((dst, h, len(g.evicted), len(rows.stored), len(rows.copied)))
    rows.copied.append((g.key, rid, COPY_SAVED, table[0], dst, len(sink.appended)))
    rows.stored.append((g.key, dst, h, hashes.parent_hash(index), ()))
