"""The per-request step's building blocks, shared by every allocating transition.

``plan_group`` decides (phase 1) and ``apply_plan`` applies (phase 2) one
request's allocation in one group; ``skip_range`` / ``recycle_range`` find and
recycle the blocks that slid out of a window.  They edit a transient and
never decide refusals: the transitions around them do.
"""

from __future__ import annotations

from kvfunc.core._delta import DeltaBuilder
from kvfunc.core._state import NULL_BLOCK, BlockId, RequestId
from kvfunc.core._transient import GroupTransient

__all__ = ["apply_plan", "plan_group", "recycle_into", "recycle_range", "skip_range"]


def skip_range(g: GroupTransient, table: tuple[BlockId, ...], computed: int) -> tuple[int, int]:
    """Positions ``lo .. k-1`` of ``table`` that slid out and are not null yet."""
    w = g.window
    skipped = (computed - w + 1) if w is not None else g.policy.num_skipped_tokens(computed)
    if skipped <= 0:
        return 0, 0
    k = min(skipped // g.block_size, len(table))
    lo = k
    while lo > 0 and table[lo - 1] != NULL_BLOCK:
        lo -= 1
    return lo, k


def recycle_range(g: GroupTransient, request_id: RequestId, table: tuple[BlockId, ...],
                  lo: int, k: int, sink: DeltaBuilder | None) -> tuple[BlockId, ...]:
    """Null positions ``lo .. k-1`` and free their blocks, highest index first."""
    if k - lo == 1:  # the common case: one block left the window
        b = table[lo]
        freed = g.release_blocks((b,))
        if sink is not None:
            sink.nulled.append((g.key, request_id, lo))
            if freed:
                sink.freed.append((g.key, b))
        return table[:lo] + (NULL_BLOCK,) + table[k:]
    freed = g.release_blocks([table[i] for i in range(k - 1, lo - 1, -1)])
    if sink is not None:
        key = g.key
        sink.nulled.extend([(key, request_id, i) for i in range(k - 1, lo - 1, -1)])
        sink.freed.extend([(key, b) for b in freed])
    return table[:lo] + (NULL_BLOCK,) * (k - lo) + table[k:]


def plan_group(g: GroupTransient, table: tuple[BlockId, ...] | None, computed: int,
               total: int) -> tuple[int, int, int, int]:
    """Phase 1 for one request in one group: ``(lo, k, nulls, need)``.

    Positions ``lo .. k-1`` slid out and will be recycled; the table then
    gets ``nulls`` null entries and ``need`` new blocks.
    """
    if not table:
        nulls, need = g.policy.plan_blocks(0, total)
        return 0, 0, nulls, need
    lo = k = 0
    if g.window is not None or g.may_skip:
        lo, k = skip_range(g, table, computed)
    held = len(table)
    if g.grows:
        need = (total + g.block_size - 1) // g.block_size - held
        return lo, k, 0, need if need > 0 else 0
    nulls, need = g.policy.plan_blocks(held, total)
    return lo, k, nulls, need


def recycle_into(g: GroupTransient, request_id: RequestId, computed: int,
                 sink: DeltaBuilder | None) -> None:
    """Recycle whatever slid out of ``request_id``'s window in one group (no clamping)."""
    table = g.tables.get(request_id)
    if table:
        lo, k = skip_range(g, table, computed)
        if k > lo:
            g.set_table(request_id, recycle_range(g, request_id, table, lo, k, sink))


def apply_plan(g: GroupTransient, request_id: RequestId, table: tuple[BlockId, ...] | None,
               lo: int, k: int, nulls: int, need: int, sink: DeltaBuilder | None) -> None:
    """Phase 2 for one request in one group: register, recycle, then take and append."""
    if table is None:
        table = ()
        if sink is not None:
            sink.registered.append((g.key, request_id))
    if k > lo:
        table = recycle_range(g, request_id, table, lo, k, sink)
    if need:
        ids = g.take(need)
        added = (NULL_BLOCK,) * nulls + ids if nulls else ids
    elif nulls:
        added = (NULL_BLOCK,) * nulls
    else:
        added = ()
    g.set_table(request_id, table + added if added else table)
    if sink is not None and added:
        key = g.key
        if len(added) == 1:
            sink.appended.append((key, request_id, added[0]))
        else:
            sink.appended.extend([(key, request_id, b) for b in added])
