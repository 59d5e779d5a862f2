"""Paying calls that were owed: decode steps whose work the rows told when they were made.

``kvfunc.vllm`` answers some decode calls at once and makes their
transitions later, together, in the order they came (its "owed calls"):

* a call that only **takes** blocks: its rows said it needs new blocks and
  nothing else (nothing slides out, nothing is copied on write, it caches
  nothing: no hashes), and it was promised the free queue's next blocks
  past those promised before it;
* a call that only **caches** the blocks it fills: its rows said it needs
  no block, nothing slides out, nothing is copied.

:func:`pay_into` makes such calls on a working copy by the same primitives
the step would use (``GroupCopy.extend``, :func:`~kvfunc.core._step.cache_step`),
skipping only the planning that the rows made needless.  It asks the rows
again first, with the same quiet limits and :func:`blocks_needed` the fold
asks; a call whose rows say anything else (or of another form) goes through
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
from kvfunc.core._errors import KVFuncError
from kvfunc.core._fold import SlotRequest, fold
from kvfunc.core._hashing import BlockHashes
from kvfunc.core._policy import blocks_needed
from kvfunc.core._step import cache_step
from kvfunc.core._transient import Transient

__all__ = ["pay_into"]


def pay_into(tr: Transient, owed: Iterable[tuple[Any, Sequence[Sequence[int]] | None]]
             ) -> list[Any]:
    """Serve each owed ``(request, tables)`` on ``tr`` in order: the refused request ids.

    ``request`` is a :class:`SlotRequest` (any other entry form goes through the fold);
    ``tables`` None for a call that only caches, else per group of ``tr`` the blocks it
    was promised (the free queue's next ones), in group order.  A take that took other
    blocks than those promised raises :class:`~kvfunc.KVFuncError` (the caller's promise
    was wrong: ``tr`` must be aborted).
    """
    refused = []
    for e, tables in owed:
        if _served(tr, e, tables):
            continue
        if fold(tr, (e,)):
            refused.append(e[0])
        elif tables is not None:
            _check_promised(tr, e[0], tables)
    return refused


def _served(tr: Transient, e: Any, tables: Sequence[Sequence[int]] | None) -> bool:
    """Whether the owed call ``e`` was a take or a caching call that the rows agree with,
    now served (else False, ``tr`` untouched: the fold serves it)."""
    if type(e) is not SlotRequest:
        return False
    rid, computed, new, la, reserved, keys, hashes, hit = e
    t = type(rid)
    if not ((t is int or t is str) and type(computed) is int is type(new) is type(la)
            and (computed | new | la) >= 0 and not reserved and keys is hit is None):
        return False  # the fold's checks and clamps for any other entry
    written = computed + new
    total = written + la
    if total > tr.max_model_len:
        return False
    if tables is not None:
        return hashes is None and _take(tr, rid, computed, total, tables)
    return (type(hashes) is BlockHashes and hashes.block_size in tr.checked
            and _cache(tr, rid, computed, written, total, hashes))


def _check_promised(tr: Transient, rid: Any, tables: Sequence[Sequence[int]]) -> None:
    """That each group's table of ``rid`` ends with the blocks promised to it (null entries)."""
    views = tr.views
    kept = len(tables) == len(views)
    for view, table in zip(views, tables, strict=False):  # (the lengths were compared)
        if table:
            row = view.rows.get(rid)
            end = 0 if row is None else row[9]  # a take's blocks end the table, past its
            kept = kept and row is not None and row[0][end - len(table):end] == list(table)
    if not kept:
        raise KVFuncError(f"the owed take of {excerpt(rid)} did not take the blocks it "
                          "promised")


def _take(tr: Transient, rid: Any, computed: int, total: int, tables: Sequence[Sequence[int]]
          ) -> bool:
    """A call that only takes: each group's promised blocks, if the rows agree and they fit
    (else False, ``tr`` untouched)."""
    views = tr.views
    if len(tables) != len(views):
        return False
    want: dict[int, int] = {}
    for i, view in enumerate(views):
        row = view.rows.get(rid)
        if row is None or not (row[8] <= computed < row[6]):
            return False  # not registered, a write to copy, or a block slides out
        n = len(tables[i])
        if n != (blocks_needed(view.policy, True, row[9], total)[1] if total > row[5] else 0):
            return False
        if n:
            j = tr.group_pool[i]
            want[j] = want.get(j, 0) + n
    pools = tr.pools
    if not all(n <= pools[j].queue.count for j, n in want.items()):
        return False
    for i, view in enumerate(views):
        n = len(tables[i])
        if n:
            tr.copy(i).extend(rid, view.rows[rid], n)
    _check_promised(tr, rid, tables)
    return True


def _cache(tr: Transient, rid: Any, computed: int, written: int, total: int,
           hashes: BlockHashes) -> bool:
    """A call that only caches what it fills, if the rows agree (else False, ``tr``
    untouched)."""
    views = tr.views
    rows = []
    for view in views:
        row = view.rows.get(rid)
        if row is None or not (row[8] <= computed < row[6] and total <= row[5]) or not (
                view.traits[1]):
            return False  # not registered, a write to copy, a block to take or to let go,
        rows.append(row)  # or a state to save
    for i, row in enumerate(rows):
        if written >= row[7]:  # a block completes here (``_policy.row_limits``)
            g = tr.copy(i)
            new = cache_step(g, rid, row, computed, written, hashes)
            if new is not row:
                g.put(rid, new)
    return True
