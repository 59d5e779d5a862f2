"""``allocate_batch``: one transition for a whole scheduler step.

The result is defined as :func:`~kvfunc.allocate_slots` applied to each
request in order.  It is computed in one of two ways:

* **group-major** (the common case): when no request carries a reservation
  or a ``manager_keys`` subset, no request id repeats, and in every group the
  blocks the step needs fit in the blocks free at its start, no request can be
  refused, and taking from the head / returning to the tail commute.  Each
  group is then planned in one tight loop over the step's requests and
  applied in request order, which gives exactly the sequential result at a
  fraction of the per-request overhead;
* **request-major** otherwise: the per-request step of ``_transitions``,
  request after request, on one transient.

A property test checks that both equal sequential ``allocate_slots``.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from typing import Any, NamedTuple

import attrs

from kvfunc.core._delta import BlocksChanged, DeltaBuilder
from kvfunc.core._errors import InvalidArgumentError, InvalidTypeError
from kvfunc.core._hashing import BlockHashes
from kvfunc.core._prefix import PrefixHit, check_prefix_args, finish_cached
from kvfunc.core._prefix_batch import cached_batch
from kvfunc.core._state import NULL_BLOCK, KVState, RequestId
from kvfunc.core._steps import apply_plan, plan_group
from kvfunc.core._transient import Transient
from kvfunc.core._transitions import (
    allocate_into,
    check_counts,
    check_manager_keys,
    check_request_id,
)

__all__ = ["BatchResult", "SlotRequest", "allocate_batch"]

_RID_TYPES = frozenset({int, str})


@attrs.frozen(slots=True)
class BatchResult:
    """Outcome of :func:`allocate_batch`: one state and one delta for the step."""

    state: KVState
    delta: BlocksChanged
    refused: tuple[RequestId, ...]


class SlotRequest(NamedTuple):
    """One request's slot demand in a scheduler step.

    A plain tuple ``(request_id, computed, new[, lookahead[, reserved[, keys]]])``
    is accepted wherever a ``SlotRequest`` is, and is cheaper to build.
    ``block_hashes`` and ``prefix_hit`` are :func:`~kvfunc.allocate_slots`'s
    prefix-caching arguments.
    """

    request_id: RequestId
    computed_tokens: int
    num_new_tokens: int
    lookahead_tokens: int = 0
    reserved_tokens: int = 0
    manager_keys: Collection[str] | None = None
    block_hashes: BlockHashes | None = None
    prefix_hit: PrefixHit | None = None


def allocate_batch(state: KVState, requests: Iterable[SlotRequest | tuple[Any, ...]]
                   ) -> BatchResult:
    """One transition for a scheduler step: :func:`allocate_slots` for each request in order.

    Refused requests change nothing and are listed in ``refused``; the
    result equals calling :func:`allocate_slots` one request at a time.
    An invalid request raises and the input state stays as it was; so does
    a request id named twice (a step names each request once, which keeps
    the step's single delta replayable).

    >>> from kvfunc.core import FullAttention, KVState, get_block_ids
    >>> s = KVState.create({"full": FullAttention(num_blocks=4, block_size=16)}, 1024)
    >>> r = allocate_batch(s, [SlotRequest("a", 0, 20), ("b", 0, 40)])
    >>> get_block_ids(r.state, "a"), r.refused
    ({'full': (1, 2)}, ('b',))
    """
    reqs = requests if isinstance(requests, list | tuple) else list(requests)
    sink = DeltaBuilder()
    tr = Transient(state)
    if tr.caching:
        quick = cached_batch(tr, reqs, sink)
        if quick is not None:
            finish_cached(tr, sink)
            return BatchResult(tr.freeze(), sink.build(), tuple(quick))
    elif _group_major(tr, reqs, sink):
        return BatchResult(tr.freeze(), sink.build(), ())
    tr = Transient(state)
    sink = DeltaBuilder()
    refused: list[RequestId] = []
    seen: set[RequestId] = set()
    checked: set[int] = set()  # hash block sizes already checked against the groups
    for req in reqs:
        try:
            rid, computed, new, lookahead, reserved, keys, hashes, hit = _unpack(req)
            if rid in seen:
                msg = f"request {rid!r} appears twice in one batch; a step names it once"
                raise InvalidArgumentError(msg)
            seen.add(rid)
            check_request_id(rid)  # what allocate_slots checks, so a batch refuses the same
            check_manager_keys(keys)
            check_counts(computed, new, lookahead, reserved)
            if hit is not None or (hashes is not None and (
                    type(hashes) is not BlockHashes or hashes.block_size not in checked)):
                check_prefix_args(state, rid, computed, keys, hashes, hit)
                if hashes is not None:
                    checked.add(hashes.block_size)
            if not allocate_into(tr, rid, computed, new, lookahead, reserved, keys, sink,
                                 hashes, hit):
                refused.append(rid)
        except TypeError:
            _recheck(req)
            raise
    if tr.caching:
        finish_cached(tr, sink)
    return BatchResult(tr.freeze(), sink.build(), tuple(refused))


def _rows(reqs: Sequence[Any], limit: int) -> list[tuple[Any, int, int]] | None:
    """``(request id, computed, total)`` per request, clamped; None if the fast path may not run."""
    rows: list[tuple[Any, int, int]] = []
    add = rows.append
    for req in reqs:
        width = len(req)
        if width == 3:
            rid, computed, new = req
            lookahead = 0
        elif width == 4:
            rid, computed, new, lookahead = req
        elif width == 8:  # a SlotRequest
            rid, computed, new, lookahead, reserved, keys, hashes, hit = req
            if (reserved != 0 or type(reserved) is not int or keys is not None
                    or hashes is not None or hit is not None):
                return None
        elif width == 6:
            rid, computed, new, lookahead, reserved, keys = req
            if reserved != 0 or type(reserved) is not int or keys is not None:
                return None
        else:
            return None
        if not (type(computed) is type(new) is type(lookahead) is int) or new < 0:
            return None  # the request-major path raises the precise error
        total = computed + new + lookahead
        if total < 0:
            return None
        if total > limit:
            add((rid, computed if computed < limit else limit, limit))
        else:
            add((rid, computed, total))
    seen = {row[0] for row in rows}
    if len(seen) != len(rows) or not _RID_TYPES.issuperset(map(type, seen)):
        return None
    return rows


def _group_major(tr: Transient, reqs: Sequence[Any], sink: DeltaBuilder) -> bool:
    """Plan and apply the step group by group; False (``tr`` untouched) if it may not."""
    rows = _rows(reqs, tr.max_model_len)
    if rows is None:
        return False
    plans = []
    for g in tr.groups:
        get = g.tables.get
        bs = g.block_size
        w1 = g.window - 1 if g.window is not None else None
        quiet_if_no_growth = g.grows and not (w1 is None and g.may_skip)
        group_plans = []
        total_need = 0
        for rid, computed, total in rows:
            table = get(rid)
            if quiet_if_no_growth and table and total <= len(table) * bs:
                if w1 is None:
                    continue
                # No growth: the table changes only if a block newly left the window.
                k = (computed - w1) // bs
                held = len(table)
                if k <= 0 or table[(k if k < held else held) - 1] == NULL_BLOCK:
                    continue
            lo, k, nulls, need = plan_group(g, table, computed, total)
            if need or nulls or k > lo or table is None:
                group_plans.append((rid, table, lo, k, nulls, need))
                total_need += need
        if total_need > g.count:
            return False
        plans.append((g, group_plans))
    for g, group_plans in plans:
        for rid, table, lo, k, nulls, need in group_plans:
            apply_plan(g, rid, table, lo, k, nulls, need, sink)
    return True


def _unpack(req: Any) -> tuple[Any, int, int, int, int, Any, Any, Any]:
    n = len(req)
    if n == 8:
        return req  # type: ignore[no-any-return]
    if n == 3:
        return req[0], req[1], req[2], 0, 0, None, None, None
    if n == 4:
        return req[0], req[1], req[2], req[3], 0, None, None, None
    return SlotRequest(*req)


def _recheck(req: Any) -> None:
    """Turn a bare TypeError from a malformed request into a typed, named one."""
    try:
        rid, computed, new, lookahead, reserved, keys, _, _ = _unpack(req)
    except TypeError:
        msg = f"a batch entry must be a SlotRequest or a tuple of 3-8 fields, got {req!r}"
        raise InvalidTypeError(msg) from None
    check_request_id(rid)
    check_manager_keys(keys)
    check_counts(computed, new, lookahead, reserved)
