"""``allocate_batch`` on a caching state: plan group by group, apply in request order.

In a decode step almost every request writes one token into a block it
already holds alone: no block is taken, nothing slides out of a window, no
shared block is written.  Such a request is *quiet*: at most it has filled a
block, which it caches.
*Simple* requests need new blocks or recycle some; *complex* ones carry a
prefix hit, a reservation or a key subset, write a block they share (a copy),
or are new to a state group.

Pass 1 visits each group in one tight loop over the step's requests and
changes nothing: it plans the simple requests, notes which quiet ones filled
a block, and bounds what the complex ones could take.  If, in every group,
the simple requests' new blocks plus that bound fit in the blocks free at the
start, no simple request can be refused.  Pass 2 then walks only the
requests with something to do, in request order: a simple request applies
its plan, a complex one runs the full per-request step (which may refuse
it).  A simple request's plan depends only on its own table, which no other
request touches, and on which of its blocks are shared: a block the step's
hits will share counts as shared already, so the result is the sequential
one; a property test checks it.  Otherwise (or on malformed input) the caller runs every request
through the full step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvfunc.core._cache_transient import CacheGroupTransient
from kvfunc.core._delta import DeltaBuilder
from kvfunc.core._hashing import BlockHashes
from kvfunc.core._prefix import PrefixHit, cache_after_step, check_prefix_args
from kvfunc.core._state import NULL_BLOCK, RequestId
from kvfunc.core._steps import apply_plan, plan_group
from kvfunc.core._transient import Transient
from kvfunc.core._transitions import allocate_into, check_counts, check_manager_keys

__all__ = ["cached_batch"]

_RID_TYPES = (int, str)
_STORE = "store"


def _rows(reqs: Sequence[Any], limit: int, sizes: set[int]) -> list[tuple[Any, ...]] | None:
    """``(rid, computed, written, total, hashes, odd)`` per request, clamped.

    None when a request is malformed (the full step raises the precise error),
    its hashes' block size does not divide every group's ``sizes``, or a
    request id repeats.
    """
    rows = []
    checked: set[int] = set()
    for req in reqs:
        width = len(req)
        if width == 8:
            rid, computed, new, lookahead, reserved, keys, hashes, hit = req
            if type(reserved) is not int or (hit is not None and type(hit) is not PrefixHit):
                return None
            odd = bool(reserved) or keys is not None or hit is not None
            if hashes is not None:
                if type(hashes) is not BlockHashes:
                    return None
                hbs = hashes.block_size
                if hbs not in checked:
                    if any(bs % hbs for bs in sizes):
                        return None
                    checked.add(hbs)
        elif width == 3:
            rid, computed, new = req
            lookahead, hashes, odd = 0, None, False
        elif width == 4:
            rid, computed, new, lookahead = req
            hashes, odd = None, False
        else:
            return None
        if (type(computed) is not int or type(new) is not int or type(lookahead) is not int
                or type(rid) not in _RID_TYPES or new < 0 or computed + new + lookahead < 0):
            return None
        total = computed + new + lookahead
        written = computed + new
        if computed > limit:
            computed = limit
        rows.append((rid, computed, written if written < limit else limit,
                     total if total < limit else limit, hashes, odd))
    if len({row[0] for row in rows}) != len(rows):
        return None
    return rows


def _plan_group(g: CacheGroupTransient, rows: list[tuple[Any, ...]], reqs: Sequence[Any],
                complex_: set[int]) -> tuple[dict[int, Any], int]:
    """One group's actions by request index, and the blocks they may take (pass 1)."""
    get, refs, hash_of, bs = g.tables.get, g.refs, g.hash_of, g.block_size
    # Blocks the step's hits will share: writing one of them needs a copy, as it would
    # after the hit in sequential calls.
    hit_blocks = {b for row, req in zip(rows, reqs, strict=True) if row[5] and req[7] is not None
                  for b in req[7].block_ids.get(g.key, ())}
    w, grows, may_skip = g.window, g.grows, g.may_skip
    actions: dict[int, Any] = {}
    need_total = 0
    for i, (rid, computed, written, total, hashes, odd) in enumerate(rows):
        table = get(rid)
        if odd:
            hit = reqs[i][7]
            entries = hit.block_ids.get(g.key, ()) if hit is not None else ()
            base = entries if entries and grows else table
            need_total += plan_group(g, base, computed, total)[3] + len(entries) + len(table or ())
            continue
        if table and grows:
            held = len(table)
            p = computed // bs
            shared = False
            while p < held and p * bs < total:  # writes into a block someone else holds
                b = table[p]
                if b and (refs[b] > 1 or b in hit_blocks):
                    shared = True
                    break
                p += 1
            if shared:  # copies (at most one per held block) and new blocks: a bound
                complex_.add(i)
                need_total += held + plan_group(g, table, computed, total)[3]
                continue
            if total <= held * bs:
                if w is not None:
                    k = (computed - w + 1) // bs
                    quiet = k <= 0 or table[(k if k < held else held) - 1] == NULL_BLOCK
                else:
                    quiet = not may_skip
                if quiet:  # only caching may be left to do: a block filled up
                    if hashes is not None:
                        full = hashes.num_blocks * hashes.block_size // bs
                        if written // bs < full:
                            full = written // bs
                        if full > held:
                            full = held
                        if full and table[full - 1] and hash_of[table[full - 1]] is None:
                            actions[i] = _STORE
                    continue
        elif table and not grows and any(b and refs[b] > 1 for b in table):
            complex_.add(i)  # a state it shares: copy-on-write
            need_total += plan_group(g, table, computed, total)[3] + len(table)
            continue
        plan = plan_group(g, table, computed, total)
        lo, k, nulls, need = plan
        if need or nulls or k > lo or table is None:
            actions[i] = (table, *plan)
            need_total += need
        elif grows:
            if hashes is not None:
                actions[i] = _STORE
        elif (hashes is not None and computed and not computed % bs
              and computed <= hashes.num_tokens):
            actions[i] = _STORE  # a state at a block boundary: saved at the end
    return actions, need_total


def cached_batch(tr: Transient, reqs: Sequence[Any], sink: DeltaBuilder
                 ) -> list[RequestId] | None:
    """Run the step on ``tr``; the refused request ids, or None (``tr`` untouched)."""
    groups: list[CacheGroupTransient] = tr.groups  # type: ignore[assignment]
    rows = _rows(reqs, tr.max_model_len, {g.block_size for g in groups})
    if rows is None:
        return None
    complex_: set[int] = set()
    per_group = []
    for g in groups:  # pass 1: plan, change nothing
        actions, need = _plan_group(g, rows, reqs, complex_)
        if need > g.count:
            return None
        per_group.append(actions)
    todo = set(complex_).union(*per_group)
    todo.update(i for i, row in enumerate(rows) if row[5])
    refused: list[RequestId] = []
    state = tr.src
    for i in sorted(todo):  # pass 2: in request order
        rid, computed, written, _, hashes, odd = rows[i]
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
        for g, actions in zip(groups, per_group, strict=True):
            action = actions.get(i)
            if action is None:
                continue
            if action is not _STORE:
                table, lo, k, nulls, need = action
                apply_plan(g, rid, table, lo, k, nulls, need, sink)
            if hashes is not None:
                cache_after_step(g, rid, computed, written, hashes, sink)
    return refused
