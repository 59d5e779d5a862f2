"""The one step: plan and apply one request's allocation in every selected group.

Theory of operation
-------------------
``allocate_slots`` is the seed's two-phase allocation made strictly atomic.

1. **Plan.**  For each selected group, :func:`plan_group` reads the
   request's row and asks the group's policy (``_policy``: what slid out of
   the window, how many null entries and new blocks) and the caching
   strategy (a prefix hit's blocks, copy-on-write, the blocks the step
   completes) what the request needs, as one :class:`Plan`, changing
   nothing.  A group with nothing to do plans nothing: the common decode
   step reads one row per group and stops here.
2. **Room.**  :func:`has_room` sums, per pool, what every group of the pool
   needs, before anything is taken: a pool shared by several groups must
   hold all of it at once.  Recycled blocks count as free, so every accepted
   call hands out exactly the seed's ids.  If any pool lacks room the
   request is refused as a value and nothing changed.
3. **Apply.**  :func:`apply_plans` runs the plans through the groups'
   primitives (recycle, register, share, grow, copy, store: ``_group``),
   which take and return blocks through the group's pool (``_pool``) and
   record the delta (``_delta``).

Every entry point folds over this step: ``allocate_slots`` is a fold of
one, ``allocate_batch`` a fold of a scheduler step (``_fold``), the compat
facade a fold kept open, and ``replay`` a fold of the same primitives over a
log.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import compress, repeat
from typing import Any, NamedTuple

from kvfunc.core._delta import COPY_INTO_NEW
from kvfunc.core._group import GroupCopy
from kvfunc.core._policy import blocks_needed, slid_out
from kvfunc.core._pool import cache_key
from kvfunc.core._rows import Row, leading_nulls, recycled_free
from kvfunc.core._transient import Transient

__all__ = ["Plan", "apply_plans", "bind_rows", "completes", "has_room", "lean_step",
           "plan_group", "recycle_first", "step"]

_new = tuple.__new__


class Plan(NamedTuple):
    """What one request's step does in one group (phase 1's answer).

    Attributes:
        group: the group's position in the state.
        row: the request's row, or None when the step registers it.
        hit: a prefix hit's table (shared entries), when admitted with one.
        src: a saved state to copy into the request's new block (0: none).
        upto: positions ``row.nulls .. upto - 1`` are recycled.
        nulls: null entries to append.
        need: new blocks to take and append.
        cow: positions to copy before writing (their block is shared).
        extra: blocks the hit takes out of the free queue (free cached ones).
        store: the step completes blocks to cache (or a state to save).
    """

    group: int
    row: Row | None
    hit: tuple[int, ...] | None
    src: int
    upto: int
    nulls: int
    need: int
    cow: tuple[int, ...]
    extra: int
    store: bool


def plan_group(tr: Transient, i: int, g: Any, row: Row | None, computed: int, written: int,
               total: int, hashes: Any, hit: Any) -> Plan | bool | None:
    """Phase 1 in group ``i``: a :class:`Plan`, None (nothing to do) or False (refused).

    A registered request costs a row read and the policy's two answers
    (:func:`~kvfunc.core._policy.slid_out`, :func:`~kvfunc.core._policy.blocks_needed`);
    most decode entries stop here.  A prefix hit whose blocks no longer hold
    its hashes (evicted since the lookup) is refused: the scheduler looks up
    again.
    """
    _, grows, mode, _ = g.traits
    if row is not None and hit is None:
        nulls, held = row[1], row[9]
        upto = slid_out(g.policy, mode, computed, held) if mode else 0
        add_nulls, need = blocks_needed(g.policy, grows, held, total, tr.caching)
        cow: tuple[int, ...] = ()
        store = False
        if tr.caching:
            if total and row[3] and computed < row[8]:  # a write below ``cow_from``
                cow = cow_positions(tr, i, row, computed, total)
            if hashes is not None:
                done = row[2] if row[2] > nulls else nulls
                store = completes(g.traits, held + add_nulls + need, done, computed, written,
                                  hashes)
        if upto <= nulls and not add_nulls and not need and not cow and not store:
            return None
        return _new(Plan, (i, row, None, 0, upto, add_nulls, need, cow, 0, store))
    return _plan_new(tr, i, g, row, computed, written, total, hashes, hit)


def _plan_new(tr: Transient, i: int, g: Any, row: Row | None, computed: int, written: int,
              total: int, hashes: Any, hit: Any) -> Plan | bool:
    """Phase 1 for a request new to group ``i`` (or admitted with a prefix hit)."""
    _, grows, mode, _ = g.traits
    entries, src, extra = None, 0, 0
    if hit is not None and hit.num_tokens:
        entries = hit.block_ids[g.key]
        found = hit_fits(tr, i, entries, hashes, hit.num_tokens)
        if found is None:
            return False
        extra = found
        if not grows:
            src, entries = entries[0], None
    if entries is not None:
        held, nulls = len(entries), leading_nulls(entries)
    elif row is not None:
        nulls, held = row[1], row[9]
    else:
        held = nulls = 0
    upto = slid_out(g.policy, mode, computed, held) if mode else 0
    add_nulls, need = blocks_needed(g.policy, grows, held, total, tr.caching)
    store = tr.caching and hashes is not None and completes(
        g.traits, held + add_nulls + need, nulls, computed, written, hashes)
    return _new(Plan, (i, row, entries, src, upto, add_nulls, need, (), extra, store))


def completes(traits: tuple[int, bool, int, int | None], length: int, done: int, computed: int,
              written: int, hashes: Any) -> bool:
    """Whether the step leaves a block to cache (or, for a state, a state to save)."""
    bs, grows = traits[0], traits[1]
    if grows:
        upto: int = min(written // bs, length, hashes.num_blocks * hashes.block_size // bs)
        return upto > done
    return bool(computed) and not computed % bs and computed <= int(hashes.num_tokens)


def hit_fits(tr: Transient, i: int, entries: tuple[int, ...], hashes: Any, num_tokens: int
             ) -> int | None:
    """How many of a hit's blocks are free now, or None if one no longer holds its hash."""
    g = tr.views[i]
    pool = tr.pools[tr.group_pool[i]]
    hash_of, refs, tag = pool.hash_of, pool.refs, pool.tag_of(g.key)
    digests, hbs = hashes._digests, hashes.block_size
    if not g.traits[1]:  # a saved state: one block, copied, never shared
        return 0 if hash_of[entries[0]] == cache_key(digests[num_tokens // hbs - 1], tag) else None
    m = g.traits[0] // hbs
    keys: Any = digests[m - 1:len(entries) * m:m]
    held: Sequence[int] = entries
    if 0 in entries:  # null entries (slid out of a window) need nothing
        keep = list(map(bool, entries))
        held, keys = list(compress(entries, keep)), list(compress(keys, keep))
    if tag is not None:
        keys = list(map(bytes.__add__, keys, repeat(tag)))
    if list(map(hash_of.__getitem__, held)) != keys:
        return None
    return list(map(refs.__getitem__, held)).count(0)


def cow_positions(tr: Transient, i: int, row: Row, computed: int, total: int) -> tuple[int, ...]:
    """Positions the step writes whose block someone else holds too (only below ``row.shared``)."""
    g = tr.views[i]
    bs, grows = g.traits[0], g.traits[1]
    refs, ids, nulls, length = tr.pools[tr.group_pool[i]].refs, row.ids, row.nulls, row.length
    if grows:
        first, last = max(computed // bs, nulls), min(length, -(-total // bs), row.shared)
    else:
        first, last = nulls, min(length, row.shared)
    return tuple(p for p in range(first, last) if refs[ids[p]] > 1)


def has_room(tr: Transient, plans: list[Plan], reserved: int) -> bool:
    """Whether every pool holds what the plans take from it, reservations kept (phase 2)."""
    if len(plans) == 1 and not reserved:  # one group
        i, row, _, _, upto, _, need, cow, extra, _ = plans[0]
        need += extra + len(cow)
        if not need:
            return True
        return fits(tr, i, need - (_gain(tr, plans[0]) if row is not None and upto > row[1]
                                   else 0))  # a new row recycles nothing (``recycle_first``)
    want: dict[int, int] = {}
    pool_of, pools = tr.group_pool, tr.pools
    for p in plans:  # one read of the plan's fields (a named field costs a lookup)
        i, row, _, _, upto, _, need, cow, extra, _ = p
        n = need + extra + len(cow)
        if row is not None and upto > row[1]:
            n -= _gain(tr, p)
        if reserved:
            g = tr.views[i]
            n += g.policy.num_reserved_blocks(reserved, len(g.rows))
        j = pool_of[i]
        want[j] = want.get(j, 0) + n
    return all(n <= pools[j].queue.count for j, n in want.items())  # ``tr.free_count``, inlined


def fits(tr: Transient, i: int, need: int) -> bool:
    """Whether group ``i``'s pool holds ``need`` free blocks now (one group's room check)."""
    return need <= tr.pools[tr.group_pool[i]].queue.count  # type: ignore[no-any-return]


def _gain(tr: Transient, p: Plan) -> int:
    """Blocks that the plan's recycling returns to its pool."""
    row = p.row
    assert row is not None
    return recycled_free(row, p.upto, tr.pools[tr.group_pool[p.group]].refs)


def recycle_first(tr: Transient, request_id: Any, plans: list[Plan]) -> list[Any]:
    """The plans' rows, each with its slid-out positions recycled (None: not registered yet).

    Every group recycles before any group takes a block, as the seed's
    phase 1 and vLLM's ``remove_skipped_blocks`` do: in a pool shared by
    several groups, a block one group recycles is the next another takes.
    The step (:func:`apply_plans`) and the lane's :func:`lean_step` both
    begin here.
    """
    rows: list[Any] = [p[1] for p in plans]
    for k, p in enumerate(plans):
        row = rows[k]
        if row is not None and p[4] > row[1]:
            rows[k] = tr.copy(p[0]).recycle(request_id, row, p[4])
    return rows


def apply_plans(tr: Transient, request_id: Any, plans: list[Plan]) -> list[Row]:
    """Phase 3: the plans' rows after recycling (:func:`recycle_first`), registering,
    sharing, growing and copying."""
    copies = [tr.copy(p.group) for p in plans]
    rows = recycle_first(tr, request_id, plans)
    if any(r is None for r in rows):
        seq, tr.seq = tr.seq, tr.seq + 1
        for k, p in enumerate(plans):
            if rows[k] is None:
                row = rows[k] = copies[k].register(request_id, seq)
                if p.hit is not None:
                    rows[k] = copies[k].share(request_id, row, p.hit)
    for k, p in enumerate(plans):
        g, row = copies[k], rows[k]
        if p.need or p.nulls:
            row = g.grow(request_id, row, p.need, p.nulls)
        if p.src:
            sink = g.sink
            if sink is not None:  # the saved state seeds the block just appended
                sink.rows.append((g.key, request_id, COPY_INTO_NEW, p.src, row.ids[row.nulls]))
                sink.codes.append("C")
        for position in p.cow:
            row = g.copy_on_write(request_id, row, position)
        rows[k] = row
    return rows


def cache_step(g: GroupCopy, request_id: Any, row: Row, computed: int, written: int,
               hashes: Any) -> Row:
    """Cache what the step completed: full blocks, or a state saved at a block boundary."""
    bs = g.block_size
    if g.grows:
        upto = min(written // bs, row.length, hashes.num_blocks * hashes.block_size // bs)
        if upto > row.stored and upto > row.nulls:
            return g.store(request_id, row, upto, hashes)
    elif g.pool.count:
        g.save_state(request_id, row, computed // hashes.block_size - 1, hashes)
    return row


def lean_step(tr: Transient, request_id: Any, work: list[tuple[Any, Row, bool]],
              computed: int, written: int, total: int, hashes: Any) -> bool:
    """The step of an entry whose only work is growing tables, sliding a block out and
    caching the blocks that complete.

    The fold's lane calls it with ``(group, row, slides)`` for each group
    whose rows' quiet limits hold but for room, for the window's next block
    leaving or for a block completing, every other group quiet: nothing is
    copied on write, nothing registers or shares.  Its plans are the general
    step's: what slid out (:func:`slid_out`), the blocks needed
    (:func:`blocks_needed`), what completes (:func:`completes`), the room
    check (:func:`has_room`), the recycling first (:func:`recycle_first`),
    the caching (:func:`cache_step`); only registering, sharing and copying,
    which it never needs, are left out.  An entry that only grows takes its
    blocks at once, as :func:`step`'s own decode case does: one group after
    :func:`fits` (then caches what completes, if anything, as
    :func:`bind_rows` would), several after one :func:`has_room`, with no
    recycling pass; one that only caches what completes (nothing taken,
    nothing slid out) goes straight to :func:`bind_rows`.
    False (``tr`` untouched) when a pool lacks the blocks.
    """
    views, plans, grows, still, takes = tr.views, [], True, True, False
    for view, row, slides in work:
        i = 0
        while views[i] is not view:
            i += 1
        upto = slid_out(view.policy, view.traits[2], computed, row[9]) if slides else 0
        need = blocks_needed(view.policy, True, row[9], total)[1] if total > row[5] else 0
        store = hashes is not None and completes(
            view.traits, row[9] + need, row[2] if row[2] > row[1] else row[1], computed,
            written, hashes)
        if len(work) == 1 and need and upto <= row[1]:  # one group grows, may cache: no plan
            return _grow_one(tr, i, request_id, row, need, store, computed, written, hashes)
        grows = grows and need > 0 and not store and upto <= row[1]
        still = still and not need and upto <= row[1]
        takes = takes or need > 0
        plans.append(_new(Plan, (i, row, None, 0, upto, 0, need, (), 0, store)))
    if still:  # every group only caches what completes: nothing to take, nothing recycled
        bind_rows(tr, request_id, [(p, p[1]) for p in plans], computed, written, hashes)
        return True
    if takes and not has_room(tr, plans, 0):  # (recycling alone always fits)
        return False
    if grows:  # every group only grows: the common decode step, as :func:`step` serves it
        for p in plans:
            tr.copy(p[0]).extend(request_id, p[1], p[6])  # type: ignore[arg-type]
        return True
    rows = recycle_first(tr, request_id, plans)
    caching = []  # cached by :func:`bind_rows` once every group grew (the step's order)
    for p, row in zip(plans, rows, strict=True):
        g = tr.copy(p[0])
        if p[9]:
            caching.append((p, g.grow(request_id, row, p[6]) if p[6] else row))
        elif p[6]:
            g.extend(request_id, row, p[6])
        else:
            g.put(request_id, row)
    if caching:
        bind_rows(tr, request_id, caching, computed, written, hashes)
    return True


def _grow_one(tr: Transient, i: int, request_id: Any, row: Row, need: int, store: bool,
              computed: int, written: int, hashes: Any) -> bool:
    """:func:`lean_step` of one group that takes ``need`` blocks, sliding nothing out, then
    caches what completes (``store``) as :func:`bind_rows` does; False when they do not fit."""
    if not fits(tr, i, need):
        return False
    g = tr.copy(i)
    if store:
        g.put(request_id, cache_step(g, request_id, g.grow(request_id, row, need), computed,
                                     written, hashes))
    else:
        g.extend(request_id, row, need)
    return True


def bind_rows(tr: Transient, request_id: Any, done: Any, computed: int, written: int,
              hashes: Any) -> None:
    """The step's last phase: each ``(plan, row)`` caches what it completed, then binds.

    :func:`step` ends here for every plan, :func:`lean_step` for those that cache.
    """
    for p, row in done:
        g = tr.copy(p[0])
        g.put(request_id, cache_step(g, request_id, row, computed, written, hashes) if p[9]
              else row)


def step(tr: Transient, request_id: Any, computed: int, written: int, total: int,
         reserved: int, keys: frozenset[str] | None, hashes: Any, hit: Any) -> bool:
    """One request's two-phase step on ``tr``; False (``tr`` untouched) when refused.

    Counts are clamped to ``max_model_len`` and checked by the caller.
    """
    plans: list[Plan] | None = None
    views = tr.views
    for i in range(len(views)):
        g = views[i]
        if keys is not None and g.key not in keys:
            continue
        row = g.rows.get(request_id)
        plan = plan_group(tr, i, g, row, computed, written, total, hashes, hit)
        if plan is None:
            if not reserved or row is None:
                continue
            plan = _new(Plan, (i, row, None, 0, 0, 0, 0, (), 0, False))  # its reservation
        elif plan is False:
            return False
        if plans is None:
            plans = [plan]  # type: ignore[list-item]
        else:
            plans.append(plan)  # type: ignore[arg-type]
    if plans is None:
        return True
    if not has_room(tr, plans, reserved):
        return False
    if len(plans) == 1:  # one read of the plan's fields (a named field costs a lookup)
        i, row, _, _, upto, nulls, need, cow, _, store = plans[0]
        if (row is not None and upto <= row[1] and not (nulls or cow or store)
                and need):  # the common decode step: it grows, nothing else
            tr.copy(i).extend(request_id, row, need)
            return True
    if reserved:  # idle plans were there for their reservation only
        plans = [p for p in plans if p.row is None or p.upto > p.row.nulls or p.nulls
                 or p.need or p.cow or p.store]
    bind_rows(tr, request_id, zip(plans, apply_plans(tr, request_id, plans), strict=True),
              computed, written, hashes)
    if hit is not None and tr.sink is not None:
        tr.sink.rows.append((request_id, hit.num_tokens, hit.query_tokens))
        tr.sink.codes.append("H")
    return True
