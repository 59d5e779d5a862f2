"""Paying calls that were owed: decode steps whose work the rows told when they were made.

``kvfunc.vllm`` answers some decode calls at once and makes their
transitions later, together, in the order they came (its "owed calls").
Three kinds are served here without the step's planning:

* a call that only **takes** blocks: its rows say it needs new blocks and
  nothing else (nothing slides out, nothing is copied on write, it caches
  nothing: no hashes), and it was promised the free queue's next blocks
  past those promised before it;
* a call that takes nothing and **caches** the blocks it fills, or **lets
  go** what slid out of a window, or both: its rows say it needs no block
  and nothing is copied.

:func:`pay_into` makes such calls on a working copy by the same primitives
the step would use (``GroupCopy.extend``, ``GroupCopy.recycle``,
:func:`~kvfunc.core._step.cache_step`), skipping only the planning that the
rows made needless.  It asks the rows again first, with the same quiet
limits, :func:`slid_out` and :func:`blocks_needed` the fold asks; a call of
any other kind or form (an owed take that also caches, for one) goes through
:func:`~kvfunc.core._fold.fold` as any entry does, so the result is by
definition that of :func:`~kvfunc.core._runs.run_batch` of the same
requests.  ``tests/on_vllm/test_vllm_manager.py`` compares managers that owe
with managers that do not on random programs, and ``tests/test_owed.py``
this function with the fold.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from kvfunc.core._checks import excerpt
from kvfunc.core._errors import InvalidTypeError, KVFuncError
from kvfunc.core._fold import SlotRequest, fold
from kvfunc.core._hashing import BlockHashes
from kvfunc.core._policy import blocks_needed, slid_out
from kvfunc.core._step import cache_step
from kvfunc.core._transient import Transient

__all__ = ["pay_into"]


def pay_into(tr: Transient, owed: Iterable[tuple[Any, Sequence[Sequence[int]] | None]]
             ) -> list[Any]:
    """Serve each owed ``(request, tables)`` on ``tr`` in order: the refused request ids.

    ``request`` is a :class:`SlotRequest` (any other entry form goes through the fold);
    ``tables`` None for a call that takes nothing, else per group of ``tr`` the blocks it
    was promised (the free queue's next ones), in group order.  A take that took other
    blocks than those promised raises :class:`~kvfunc.KVFuncError` (the caller's promise
    was wrong: ``tr`` must be aborted).

    When every call is served directly, nothing is recorded and one pool holds every
    group, the takes pop their blocks in one run (:func:`_together`): the same blocks, in
    the same order, as one pop per call (caching a block the run evicts a copy of gives
    the same index either way: a store adds its block, an eviction drops its own).
    """
    owed = list(owed)
    for item in owed:
        if type(item) is not tuple or len(item) != 2 or not (
                item[1] is None or type(item[1]) is list or type(item[1]) is tuple):
            raise InvalidTypeError(f"an owed call is (request, tables or None), got "
                                   f"{excerpt(item)}")  # (each table: see ``_table``)
    if tr.sink is None and len(tr.pools) == 1 and _together(tr, owed):
        return []
    refused = []
    for e, tables in owed:
        plan = _plan(tr, e, tables)
        if plan is None or not _serve(tr, plan):
            if fold(tr, (e,)):
                refused.append(e[0])
            elif tables is not None:
                _check_promised(tr, e[0], tables)
    return refused


def _plan(tr: Transient, e: Any, tables: Sequence[Sequence[int]] | None) -> Any:
    """What serving the owed call ``e`` directly does, as its rows tell: ``(rid, rows,
    tables)`` for a take, ``(rid, rows, computed, written, hashes, slid, lets_go)`` for a
    call that takes nothing (``slid``: per group, the positions its window lets go up to,
    as :func:`slid_out` answers, or None; ``lets_go``: 0, 1 when a block let go caches
    something, 2 when one may not; ``hashes`` None: it caches nothing); None when the rows
    or its form say otherwise (the fold serves it).  Reads ``tr`` only."""
    if type(e) is not SlotRequest:
        return None
    rid, computed, new, la, reserved, keys, hashes, hit = e
    t = type(rid)
    if not ((t is int or t is str) and type(computed) is int is type(new) is type(la)
            and (computed | new | la) >= 0 and type(reserved) is int and not reserved
            and keys is hit is None):
        return None  # the fold's checks and clamps for any other entry
    written = computed + new
    total = written + la
    views = tr.views
    if total > tr.max_model_len or (tables is not None and (
            hashes is not None or len(tables) != len(views))):
        return None
    if hashes is not None and not (type(hashes) is BlockHashes
                                   and hashes.block_size in tr.checked):
        return None
    rows: list[Any] = []
    slid: list[int] | None = None
    lets_go = 0  # 1: a block let go joins the back of the free queue; 2: maybe the front
    for i, view in enumerate(views):
        row = view.rows.get(rid)
        if row is None or not row[8] <= computed:
            return None  # not registered, or a write to copy
        if tables is None:
            if total > row[5] or not view.traits[1]:
                return None  # a block to take, or a state to save
            if computed >= row[6]:
                upto = slid_out(view.policy, view.traits[2], computed, row[9])
                if upto > row[1]:
                    slid = slid or [0] * len(views)
                    slid[i] = upto
                    lets_go = max(lets_go, 2 if upto > row[2] else 1)  # past the cached
        elif computed >= row[6] or len(_table(tables, i)) != (
                blocks_needed(view.policy, True, row[9], total)[1] if total > row[5] else 0):
            return None  # a take that lets a block go, or needs other blocks than promised
        rows.append(row)
    if tables is not None:
        return rid, rows, tables
    return rid, rows, computed, written, hashes, slid, lets_go


def _table(tables: Sequence[Sequence[int]], i: int) -> Sequence[int]:
    """Group ``i``'s promised blocks, checked to be a list or tuple (a typed error)."""
    table = tables[i]
    if type(table) is not list and type(table) is not tuple:
        raise InvalidTypeError(f"an owed take's table must be a list, got {excerpt(table)}")
    return table


def _serve(tr: Transient, plan: Any) -> bool:
    """Serve one planned call (False, ``tr`` untouched, when its takes do not fit)."""
    if len(plan) == 7:
        _cache(tr, *plan[:6])
        return True
    rid, rows, tables = plan
    want: dict[int, int] = {}
    for i, table in enumerate(tables):
        if table:
            j = tr.group_pool[i]
            want[j] = want.get(j, 0) + len(table)
    pools = tr.pools
    if not all(n <= pools[j].queue.count for j, n in want.items()):
        return False
    for i, table in enumerate(tables):
        if table:
            tr.copy(i).extend(rid, rows[i], len(table))
    _check_promised(tr, rid, tables)
    return True


def _together(tr: Transient, owed: list[tuple[Any, Any]]) -> bool:
    """Serve calls of distinct requests that all plan and whose takes fit, every take's
    blocks popped in one run (the promises checked against it) and handed out in order,
    then every caching call; False (``tr`` untouched) otherwise."""
    plans = []
    lets_go = 0
    for e, tables in owed:
        plan = _plan(tr, e, tables)
        if plan is None:
            return False
        if len(plan) == 7 and plan[6] > lets_go:
            lets_go = plan[6]
        plans.append(plan)
    promised = [b for plan in plans if len(plan) == 3 for table in plan[2] for b in table]
    queue = tr.pools[0].queue
    if (len({plan[0] for plan in plans}) < len(plans) or len(promised) > queue.count
            or (promised and (lets_go == 2 or (lets_go and queue.levels)))):
        return False  # a request twice (planned from rows it changes), a refusal, or a
    # block let go that could come before a take's (popped first here): one that caches
    # nothing joins the front, any the back of its priority's segment while priorities
    # order the queue
    if promised:
        taken = tr.pool(0).take(len(promised))
        if taken != promised:
            raise KVFuncError("the owed takes did not take the blocks they promised")
        at = 0
        for plan in plans:
            if len(plan) == 3:
                rid, rows, tables = plan
                for i, table in enumerate(tables):
                    if table:
                        n = len(table)
                        tr.copy(i).append(rid, rows[i], taken[at:at + n])
                        at += n
    for plan in plans:
        if len(plan) == 7:
            _cache(tr, *plan[:6])
    return True


def _check_promised(tr: Transient, rid: Any, tables: Sequence[Sequence[int]]) -> None:
    """That each group's table of ``rid`` ends with the blocks promised to it (null entries)."""
    views = tr.views
    kept = len(tables) == len(views)
    for i, view in enumerate(views[:len(tables)]):  # (the lengths were compared)
        table = _table(tables, i)
        if table:
            row = view.rows.get(rid)
            end = 0 if row is None else row[9]  # a take's blocks end the table, past its
            kept = kept and row is not None and row[0][end - len(table):end] == list(table)
    if not kept:
        raise KVFuncError(f"the owed take of {excerpt(rid)} did not take the blocks it "
                          "promised")


def _cache(tr: Transient, rid: Any, rows: list[Any], computed: int, written: int,
           hashes: BlockHashes | None, slid: list[int] | None) -> None:
    """A call that takes nothing: every group lets go what slid out of its window (``slid``,
    None when nothing does), as the step recycles before anything else, then caches what
    it fills where its row says a block completes."""
    new = list(rows)
    if slid is not None:
        for i, upto in enumerate(slid):
            if upto:
                new[i] = tr.copy(i).recycle(rid, rows[i], upto)
    for i, row in enumerate(rows):
        if hashes is not None and written >= row[7]:  # a block completes (``row_limits``)
            g = tr.copy(i)
            new[i] = cache_step(g, rid, new[i], computed, written, hashes)
        if new[i] is not row:
            tr.copy(i).put(rid, new[i])
