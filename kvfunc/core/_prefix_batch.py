"""``allocate_batch`` on a caching state: plan group by group, apply in request order.

In a decode step almost every request writes one token into a block it
already holds alone: no block is taken, nothing slides out of a window, no
shared block is written.  Such a request is *quiet*: at most it has filled a
block, which it caches.
*Simple* requests need new blocks or recycle some; *complex* ones carry a
prefix hit, a reservation or a key subset, write a block they share (a copy),
or are new to a state group.

Pass 1 changes nothing.  It walks the step's requests once to validate
them and bound what the odd ones (a hit, a reservation, a key subset) could
take, then each group's plain requests in one tight loop (as the
caching-off ``allocate_batch`` does): it plans the simple requests, notes
which quiet ones filled a block, and bounds what the complex ones could
take.  If, in every group, the simple requests' new blocks plus that bound
fit in the blocks free at the start, no simple request can be refused.
Pass 2 then walks only the requests with something to do, in request
order: a simple request applies its plan, a complex one runs the full
per-request step (which may refuse it).  A simple request's plan depends
only on its own table, which no other request touches, and on which of its
blocks are shared; if one of the step's hits would share a block that a
simple request writes in place, the step is not planned this way.  So the
result is the sequential one; a property test checks it.  Otherwise (or on
malformed input) the caller runs every request through the full step.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import itemgetter
from typing import Any

from kvfunc.core._cache_transient import CacheGroupTransient
from kvfunc.core._delta import DeltaBuilder
from kvfunc.core._hashing import BlockHashes
from kvfunc.core._prefix import (
    PrefixHit,
    cache_after_step,
    check_prefix_args,
    store_full_blocks,
)
from kvfunc.core._state import NULL_BLOCK, RequestId
from kvfunc.core._steps import apply_plan, plan_group
from kvfunc.core._transient import Transient
from kvfunc.core._transitions import allocate_into, check_counts, check_manager_keys

__all__ = ["cached_batch"]

_RID_TYPES = frozenset({int, str})
_STORE = "store"
_first = itemgetter(0)


def cached_batch(tr: Transient, reqs: Sequence[Any], sink: DeltaBuilder
                 ) -> list[RequestId] | None:
    """Run the step on ``tr``; the refused request ids, or None (``tr`` untouched)."""
    groups: list[CacheGroupTransient] = tr.groups  # type: ignore[assignment]
    limit = tr.max_model_len
    sizes = {g.block_size for g in groups}
    actions: list[dict[int, Any]] = [{} for _ in groups]
    need = [0] * len(groups)
    todo: list[tuple[int, Any, int, int, Any, bool]] = []  # (index, rid, computed, written, ...)
    rows: list[tuple[int, Any, int, int, int, Any]] = []  # the plain requests, for pass 1b
    complex_: set[int] = set()
    seen: set[Any] = set()
    hbs_ok: int | None = None  # a hash block size already checked against every group
    hits: list[PrefixHit] = []
    try:
        for i, req in enumerate(reqs):  # pass 1a: validate, bound the odd requests
            width = len(req)
            if width == 8:
                rid, computed, new, lookahead, reserved, keys, hashes, hit = req
                odd = reserved != 0 or keys is not None
                if type(reserved) is not int:
                    return None
                if hit is not None:
                    if type(hit) is not PrefixHit:
                        return None
                    hits.append(hit)
                    odd = True
                if hashes is not None:
                    if type(hashes) is not BlockHashes:
                        return None
                    if hashes.block_size != hbs_ok:
                        hbs_ok = hashes.block_size
                        if any(bs % hbs_ok for bs in sizes):
                            return None
            elif width == 3:
                rid, computed, new = req
                lookahead, hashes, odd = 0, None, False
            elif width == 4:
                rid, computed, new, lookahead = req
                hashes, odd = None, False
            else:
                return None
            if not (type(computed) is type(new) is type(lookahead) is int) or new < 0 \
                    or computed < 0:
                return None
            seen.add(rid)
            total = computed + new + lookahead
            if total < 0:
                return None
            written = computed + new
            if total > limit:
                total = limit
            if written > limit:
                written = limit
            if computed > limit:
                computed = limit
            if not odd:
                rows.append((i, rid, computed, written, total, hashes))
                continue
            todo.append((i, rid, computed, written, hashes, True))  # the full step in pass 2
            for gi, g in enumerate(groups):  # bound what it may take
                table = g.tables.get(rid)
                entries = hit.block_ids.get(g.key, ()) if hit is not None else ()
                base = entries if entries and g.grows else table
                need[gi] += (plan_group(g, base, computed, total)[3] + len(entries)
                             + len(table or ()))
        acting: set[int] = set()
        for gi, g in enumerate(groups):  # pass 1b, group by group: plan, change nothing
            # the blocks the step's hits share: no simple request may write one in place
            shared = {b for h in hits for b in h.block_ids.get(g.key, ())} if hits else None
            get, refs, hash_of, bs = g.tables.get, g.refs, g.hash_of, g.block_size
            w, grows, may_skip, group_actions = g.window, g.grows, g.may_skip, actions[gi]
            for i, rid, computed, written, total, hashes in rows:
                table = get(rid)
                if table and grows:
                    held = len(table)
                    p = computed // bs
                    writes_shared = False
                    # blocks written in place (``quiet``'s check, inlined: the hot loop)
                    while p < held and p * bs < total:
                        b = table[p]
                        if b:
                            if refs[b] > 1:
                                writes_shared = True
                                break
                            if shared and b in shared:
                                return None  # a hit shares it: one request after another
                        p += 1
                    if writes_shared:  # copies (at most one per held block) and new blocks
                        complex_.add(i)
                        need[gi] += held + plan_group(g, table, computed, total)[3]
                        acting.add(i)
                        continue
                    if total <= held * bs:
                        if w is not None:
                            k = (computed - w + 1) // bs
                            quiet = k <= 0 or table[(k if k < held else held) - 1] == NULL_BLOCK
                        else:
                            quiet = not may_skip
                        if quiet:  # only caching may be left: ``uncached_full_block`` inlined
                            if hashes is not None:
                                full = written // bs
                                if full > held:
                                    full = held
                                if hashes.num_blocks * hashes.block_size < full * bs:
                                    full = hashes.num_blocks * hashes.block_size // bs
                                if full and table[full - 1] and hash_of[table[full - 1]] is None:
                                    group_actions[i] = _STORE
                                    acting.add(i)
                            continue
                elif table and not grows and any(b and refs[b] > 1 for b in table):
                    complex_.add(i)  # a state it shares: copy-on-write
                    need[gi] += plan_group(g, table, computed, total)[3] + len(table)
                    acting.add(i)
                    continue
                plan = plan_group(g, table, computed, total)
                lo, k, nulls, more = plan
                if more or nulls or k > lo or table is None:
                    group_actions[i] = (table, *plan)
                    need[gi] += more
                    acting.add(i)
                elif grows:
                    if hashes is not None:
                        group_actions[i] = _STORE
                        acting.add(i)
                elif (hashes is not None and computed and not computed % bs
                      and computed <= hashes.num_tokens):
                    group_actions[i] = _STORE  # a state at a block boundary: saved at the end
                    acting.add(i)
        if acting:
            todo += [(i, rid, computed, written, hashes, False)
                     for i, rid, computed, written, _, hashes in rows if i in acting]
            todo.sort(key=_first)
    except (TypeError, AttributeError, ValueError):  # malformed: the full step reports it
        return None
    if len(seen) != len(reqs) or not _RID_TYPES.issuperset(map(type, seen)):
        return None
    if any(n > g.count for n, g in zip(need, groups, strict=True)):
        return None
    refused: list[RequestId] = []
    state = tr.src
    for i, rid, computed, written, hashes, odd in todo:  # pass 2: in request order
        if odd or i in complex_:
            req = reqs[i]
            new, lookahead = req[2], req[3] if len(req) > 3 else 0
            reserved, keys, hit = (req[4], req[5], req[7]) if len(req) == 8 else (0, None, None)
            if odd:
                check_counts(req[1], new, lookahead, reserved)
                check_manager_keys(keys)
                check_prefix_args(state, rid, req[1], keys, hashes, hit)
            if not allocate_into(tr, rid, req[1], new, lookahead, reserved, keys, sink, hashes,
                                 hit):
                refused.append(rid)
            continue
        for g, group_actions in zip(groups, actions, strict=True):
            action = group_actions.get(i)
            if action is None:
                continue
            if action is _STORE:
                if g.grows:
                    store_full_blocks(g, rid, written, hashes, sink.cache_rows().stored)
                    continue
            else:
                table, lo, k, nulls, more = action
                apply_plan(g, rid, table, lo, k, nulls, more, sink)
            if hashes is not None:
                cache_after_step(g, rid, computed, written, hashes, sink)
    return refused
