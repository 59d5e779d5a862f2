"""The one step: plan and apply one request's allocation in every selected group.

Theory of operation
-------------------
``allocate_slots`` is the seed's two-phase allocation made strictly atomic.
For each selected group, :func:`plan_group` asks the group's policy (the
arithmetic: what slid out of the window, how many null entries and new
blocks) and its caching strategy (a prefix hit's blocks, copy-on-write)
what the request needs, as one :class:`Plan`, changing nothing.  If any
group cannot serve the request, it is refused as a value and nothing
changed.  Otherwise :func:`apply_plan` applies each plan through the group's
primitives (register, share, recycle, take and append, copy), and
:func:`cache_step` caches what the step completed.  Recycled blocks count as
free in phase 1, so every accepted call hands out exactly the seed's ids.

Every entry point folds over this step: ``allocate_slots`` is a fold of
one, ``allocate_batch`` a fold of a scheduler step (``_fold``), the compat
facade a fold kept open, and ``replay`` a fold of the same primitives over a
log.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from kvfunc.core._delta import COPY_INTO_NEW
from kvfunc.core._group import GroupCopy, Transient
from kvfunc.core._policy import plan_step
from kvfunc.core._rows import Row, leading_nulls

__all__ = ["Plan", "apply_plan", "cache_step", "plan_group", "step"]

_new = tuple.__new__


class Plan(NamedTuple):
    """What one request's step does in one group (phase 1's answer).

    Attributes:
        row: the request's row, or None when the step registers it.
        hit: a prefix hit's table (shared entries), when admitted with one.
        src: a saved state to copy into the request's new block (0: none).
        upto: positions ``row.nulls .. upto - 1`` are recycled.
        nulls: null entries to append.
        need: new blocks to take and append.
        cow: positions to copy before writing (their block is shared).
    """

    row: Row | None
    hit: tuple[int, ...] | None
    src: int
    upto: int
    nulls: int
    need: int
    cow: tuple[int, ...]


def plan_group(g: GroupCopy, row: Row | None, computed: int, total: int, reserved: int,
               hit: Any, hashes: Any) -> Plan | bool | None:
    """Phase 1 in one group: a :class:`Plan`, None (nothing to do) or False (refused)."""
    entries, src, extra = None, 0, 0
    if hit is not None and hit.num_tokens:
        hit_table = hit.block_ids[g.key]
        fits, extra = hit_fits(g, hit_table, hashes, hit.num_tokens)
        if not fits:
            return False  # evicted since the lookup: the scheduler looks up again
        if g.grows:
            entries = hit_table
        else:
            src = hit_table[0]
    if entries is not None:
        held, nulls = len(entries), leading_nulls(entries)
    elif row is not None:
        held, nulls = row.length, row.nulls
    else:
        held = nulls = 0
    upto, add_nulls, need = plan_step(g.policy, held, nulls, computed, total)
    cow = cow_positions(g, row, computed, total) if row is not None and g.caching else ()
    idle = row is not None and upto <= nulls and not add_nulls and not need and not cow
    if idle and not reserved:
        return None
    gain = g.reclaimable(row, upto) if row is not None and upto > nulls else 0
    room = g.count + gain
    if reserved:  # the reservation applies even to a step that needs nothing (the seed's)
        room -= g.policy.num_reserved_blocks(reserved, g.num_rows)
    if need + extra + len(cow) > room:
        return False
    return None if idle else _new(Plan, (row, entries, src, upto, add_nulls, need, cow))


def hit_fits(g: Any, entries: tuple[int, ...], hashes: Any, num_tokens: int) -> tuple[bool, int]:
    """Whether a hit's blocks still hold its hashes, and how many of them are free now."""
    digests, hash_of, refs = hashes._digests, g.hash_of, g.refs
    if not g.grows:
        return hash_of[entries[0]] == digests[num_tokens // hashes.block_size - 1], 0
    m = g.block_size // hashes.block_size
    free = 0
    for p, b in enumerate(entries):
        if b:
            if hash_of[b] != digests[(p + 1) * m - 1]:
                return False, 0
            if not refs[b]:
                free += 1
    return True, free


def cow_positions(g: Any, row: Row, computed: int, total: int) -> tuple[int, ...]:
    """Positions the step writes whose block someone else holds too (only below ``row.shared``)."""
    if not total or not row.shared:
        return ()
    refs, ids = g.refs, row.ids
    if g.grows:
        first = computed // g.block_size
        last = min(row.length, -(-total // g.block_size), row.shared)
    else:
        first, last = row.nulls, min(row.length, row.shared)
    return tuple(p for p in range(first, last) if ids[p] and refs[ids[p]] > 1)


def apply_plan(g: GroupCopy, slot: int, request_id: int | str, plan: Plan) -> Row:
    """Phase 2 in one group: register, share a hit, recycle, take and append, copy."""
    row = plan.row
    if row is None:
        row = g.register(request_id)
        if plan.hit is not None:
            row = g.share(request_id, row, plan.hit)  # type: ignore[attr-defined]
    if plan.upto > row.nulls:
        row = g.recycle(request_id, row, plan.upto)
    if plan.need or plan.nulls:
        row = g.grow(request_id, row, plan.need, plan.nulls)
    if plan.src:
        sink = g.sink
        if sink is not None:  # the saved state seeds the block just appended
            sink.copied.append((g.key, request_id, COPY_INTO_NEW, plan.src, row.ids[row.nulls]))
            sink.order.append("C")
    for position in plan.cow:
        row = g.copy_on_write(request_id, row, position)  # type: ignore[attr-defined]
    g.put(slot, row)
    return row


def cache_step(g: Any, slot: int, request_id: int | str, row: Row, computed: int, written: int,
               hashes: Any) -> None:
    """Cache what the step completed: full blocks, or a state saved at a block boundary."""
    bs = g.block_size
    if g.grows:
        upto = min(written // bs, row.length, hashes.num_blocks * hashes.block_size // bs)
        if upto > row.stored and upto > row.nulls:
            g.put(slot, g.store(request_id, row, upto, hashes))
    elif computed and not computed % bs and computed <= hashes.num_tokens and g.count:
        g.save_state(request_id, row, computed // hashes.block_size - 1, hashes)


def step(tr: Transient, request_id: int | str, computed: int, written: int, total: int,
         reserved: int, keys: frozenset[str] | None, hashes: Any, hit: Any) -> bool:
    """One request's two-phase step on ``tr``; False (``tr`` untouched) when refused.

    Counts are clamped to ``max_model_len`` and checked by the caller.
    """
    slot = tr.slots.slot_of(request_id)
    plans: list[tuple[GroupCopy, Plan | None, Row | None]] = []
    copies = tr.copies
    for i in range(len(copies)):
        g = copies[i] or tr.copy(i)
        if keys is not None and g.key not in keys:
            continue
        rows = g.rows
        row = rows[slot] if slot < len(rows) else None
        plan = plan_group(g, row, computed, total, reserved, hit, hashes)
        if plan is False:
            return False
        if plan is not None or (hashes is not None and row is not None):
            plans.append((g, plan, row))  # type: ignore[arg-type]
    for g, plan, row in plans:
        if plan is not None:
            row = apply_plan(g, slot, request_id, plan)
        if hashes is not None and row is not None:
            cache_step(g, slot, request_id, row, computed, written, hashes)
    if hit is not None and tr.sink is not None:
        tr.sink.hit.append((request_id, hit.num_tokens, hit.query_tokens))
        tr.sink.order.append("H")
    return True
