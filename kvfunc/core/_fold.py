"""The fold of a scheduler step: every entry checked, then through the one step, in order.

Theory of operation
-------------------
A step's input is a sequence of entries, one per request.  The natural form
is a plain tuple ``(request_id, computed_tokens, num_new_tokens)``; a
:class:`SlotRequest` (or a tuple of up to its eight fields) carries the rarer
arguments: its own lookahead, a reservation, a manager-key subset, block
hashes, a prefix hit.  ``allocate_batch``'s ``block_hashes`` mapping gives
the hashes of entries that carry none.

:func:`fold` reads each entry once: :func:`check_entry` checks every field
of every form, the mapping's hashes included, the same way whatever the
form, then the one step (``_step``) runs on it.  The result is by
definition that of calling ``allocate_slots`` for each entry in order.

Most entries of a decode step have nothing to do: the request writes into a
block it holds alone, nothing slides out of its window, no block completes.
Each row carries its *quiet limits* (``_rows``), computed by the policy when
the row was stored (:func:`~kvfunc.core._policy.row_limits`), so the fold
recognises such an entry from four comparisons per group and skips the step:
the lane.  An entry whose only work is growing tables (its tokens passed the
blocks they hold), sliding one block out of a window (the window's next
block left it) and caching the blocks it completes, nothing copied on write,
goes straight to :func:`~kvfunc.core._step.lean_step`.  The lane decides nothing
of its own; ``tests/test_lane.py`` runs random
programs with and without it and compares every state and delta, and
``bench_core.py`` measures what it earns.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from kvfunc.core._checks import check_count, check_manager_keys, check_request_id, excerpt
from kvfunc.core._errors import InvalidArgumentError, InvalidTypeError, NotSupportedError
from kvfunc.core._hashing import BlockHashes
from kvfunc.core._policy import blocks_needed, slid_out
from kvfunc.core._prefix import PrefixHit
from kvfunc.core._step import lean_step, step
from kvfunc.core._transient import Transient

__all__ = ["BUSY", "CACHING", "LANE", "NOTHING", "SLIDES", "SlotRequest", "check_entry",
           "check_lookahead", "fold", "quiet", "slot_entry", "work_of"]

#: Whether the fold skips the step for entries that the rows' quiet limits call quiet
#: (the lane).  Tests turn it off to compare the lane with the step on random programs.
LANE = True


class SlotRequest(NamedTuple):
    """One request's slot demand in a scheduler step, with every optional argument.

    A plain tuple ``(request_id, computed_tokens, num_new_tokens)`` is the
    natural form; a ``SlotRequest`` (or a tuple of its first 4-8 fields)
    carries the rest.  ``block_hashes`` and ``prefix_hit`` are
    :func:`~kvfunc.allocate_slots`'s prefix-caching arguments.
    """

    request_id: int | str
    computed_tokens: int
    num_new_tokens: int
    lookahead_tokens: int = 0
    reserved_tokens: int = 0
    manager_keys: Collection[str] | None = None
    block_hashes: Any = None
    prefix_hit: Any = None


#: A checked entry: ``(rid, computed, written, total, reserved, keys, hashes, hit)``.
Checked = tuple[Any, int, int, int, int, frozenset[str] | None, Any, Any]


def slot_entry(request_id: Any, computed: Any, new: Any, lookahead: Any = 0, reserved: Any = 0,
               keys: Any = None, hashes: Any = None, hit: Any = None) -> tuple[Any, ...]:
    """The cheapest entry equal to these arguments: a plain 3-tuple when the rest are defaults.

    >>> slot_entry("a", 0, 5), slot_entry("a", 0, 5, False)
    (('a', 0, 5), ('a', 0, 5, False, 0, None, None, None))
    """
    if (type(lookahead) is int and type(reserved) is int and not lookahead and not reserved
            and keys is None and hashes is None and hit is None):
        return (request_id, computed, new)
    return (request_id, computed, new, lookahead, reserved, keys, hashes, hit)


def check_lookahead(value: object) -> int:
    """Lookahead tokens are an int (not a bool) and, as in the seed, may be negative."""
    if type(value) is not int:
        msg = f"lookahead_tokens must be an int, but got {excerpt(value)}"
        raise InvalidTypeError(msg)
    return value


def check_entry(tr: Transient, e: Any, lookahead: int, mapping: Mapping[Any, Any] | None
                ) -> Checked:
    """Every field of an entry of any form checked and normalised (see the module docstring)."""
    if type(e) is tuple and len(e) == 3:
        rid, computed, new = e
        la, reserved, keys, hashes, hit = lookahead, 0, None, None, None
    elif isinstance(e, tuple) and 3 <= len(e) <= 8:
        rid, computed, new, la, reserved, keys, hashes, hit = (
            e if type(e) is SlotRequest else SlotRequest(*e))
        if len(e) < 4:
            la = lookahead
    else:
        msg = (f"a step entry must be a tuple (request_id, computed_tokens, num_new_tokens) or "
               f"a SlotRequest, got {excerpt(e)}")
        raise InvalidTypeError(msg)
    check_request_id(rid)
    check_count("computed_tokens", computed)
    check_count("num_new_tokens", new)
    check_lookahead(la)
    check_count("reserved_tokens", reserved)
    keys = check_manager_keys(keys)
    if hashes is None and mapping is not None:
        hashes = mapping.get(rid)
    if hashes is not None or hit is not None:
        check_hashes(tr, hashes, hit is not None)
        if hit is not None:
            check_hit(tr, rid, computed, keys, hashes, hit)  # type: ignore[arg-type]
    written = computed + new
    total = written + la
    if total < 0:  # a negative lookahead
        if keys is None or any(v.key in keys for v in tr.views):
            raise InvalidArgumentError(f"num_tokens must be non-negative, got {excerpt(total)}")
        total = 0
    limit = tr.max_model_len
    if total > limit or written > limit:
        computed, written, total = min(computed, limit), min(written, limit), min(total, limit)
    return rid, computed, written, total, reserved, keys, hashes, hit


def check_hashes(tr: Transient, hashes: object, with_hit: bool) -> None:
    """The caching arguments need a caching state and hashes that fit every group."""
    if not tr.caching:
        raise NotSupportedError("block_hashes / prefix_hit need a state created with "
                                "enable_prefix_caching=True")
    if hashes is None:
        if with_hit:
            raise InvalidArgumentError("a prefix_hit needs the block_hashes it was looked up with")
        return
    if type(hashes) is not BlockHashes:
        msg = f"block_hashes must be a BlockHashes, got {excerpt(hashes)}"
        raise InvalidTypeError(msg)
    if hashes.block_size in tr.checked:
        return
    for g in tr.views:
        if g.policy.block_size % hashes.block_size:
            msg = (f"group {g.key!r} has block_size {g.policy.block_size}, not a multiple of the "
                   f"hashes' block_size {hashes.block_size}")
            raise InvalidArgumentError(msg)
    tr.checked.add(hashes.block_size)


def check_hit(tr: Transient, request_id: Any, computed: int, keys: Any, hashes: BlockHashes,
              hit: object) -> None:
    """A prefix hit admits a new request with every group's hit table, checked for fit."""
    if type(hit) is not PrefixHit:
        raise InvalidTypeError(f"prefix_hit must be a PrefixHit, got {excerpt(hit)}")
    if keys is not None:
        raise InvalidArgumentError("a prefix_hit applies to every group: manager_keys must be None")
    n = hit.num_tokens
    if computed != n:
        msg = (f"computed_tokens must equal the hit's num_tokens ({n}) when admitting with a "
               f"prefix_hit, got {excerpt(computed)}")
        raise InvalidArgumentError(msg)
    if set(hit.block_ids) != {g.key for g in tr.views}:
        raise InvalidArgumentError("the prefix_hit was looked up on a state with other groups")
    if n > hashes.num_tokens:
        raise InvalidArgumentError(f"the prefix_hit's {n} tokens are not covered by the "
                                   f"block_hashes ({hashes.num_tokens} tokens)")
    for i, g in enumerate(tr.views):
        entries, policy = hit.block_ids[g.key], g.policy
        want = 0 if not n else n // policy.block_size if policy.grows_with_tokens else 1
        size = tr.pools[tr.group_pool[i]].num_blocks
        if (len(entries) != want or (entries and not 0 <= min(entries) <= max(entries) < size)
                or (n and n % policy.block_size)):
            msg = f"the prefix_hit's blocks of {g.key!r} do not fit the state: {excerpt(entries)}"
            raise InvalidArgumentError(msg)
        if g.rows.get(request_id) is not None:
            msg = (f"request {excerpt(request_id)} is already registered; a prefix_hit admits "
                   "new requests")
            raise InvalidArgumentError(msg)


def fold(tr: Transient, entries: Iterable[Any], block_hashes: Mapping[Any, Any] | None = None,
         lookahead: int = 0, own: Any = None) -> Sequence[Any]:
    """Every entry, of any form, checked, then served in order on ``tr``: the refused ids (the
    lane's forms, a 3-tuple or a ``SlotRequest``/8-tuple with no reservation, keys or hit, are
    checked here as :func:`check_entry` checks any; ``own``: a 3-tuple's hashes)."""
    if block_hashes and not tr.caching:
        check_hashes(tr, None, False)  # raises: hashes need a caching state
    mapping, refused = block_hashes if tr.caching else None, []
    limit, lane, la_plain = tr.max_model_len, LANE, lookahead >= 0  # la_plain: 3-tuples' >= 0
    hashed, checked = mapping is not None or own is not None, tr.checked  # 3-tuples' hashes
    for e in entries:
        if type(e) is tuple and len(e) == 3:
            rid, computed, new = e
            la, fit = lookahead, la_plain  # fit: None off the lane, True if new + la >= 0 holds
            hashes = (own if own is not None else mapping.get(rid)) if hashed else None  # type: ignore[union-attr]
        elif type(e) is SlotRequest or (type(e) is tuple and len(e) == 8):
            rid, computed, new, la, reserved, keys, hashes, hit = e
            fit = (la >= 0 if type(la) is int and type(reserved) is int and not reserved
                   and keys is None and hit is None else None)  # type: ignore[assignment]
            if hashes is None and mapping is not None:
                hashes = mapping.get(rid)
        else:
            rid = fit = None
        t = type(rid)
        if not (fit is not None and (t is int or t is str) and type(computed) is int is type(new)
                and (computed | new) >= 0 and (fit or new + la >= 0)):
            if not _general(tr, e, lookahead, mapping, own):
                refused.append(e[0])
            continue
        if hashes is not None and (type(hashes) is not BlockHashes
                                   or hashes.block_size not in checked):
            check_hashes(tr, hashes, False)  # raises: not hashes, or a size that cannot fit
        written = computed + new
        total = written + la
        if total > limit or written > limit:
            computed, written, total = min(computed, limit), min(written, limit), min(total, limit)
        if lane:  # quiet in every group, or growing or sliding in some: the rows' limits tell
            work = None
            for view in tr.views:  # the working copies once written: rows as of now
                try:
                    row = view.rows[rid]  # a subscript costs half a ``get`` here
                except KeyError:
                    break  # not registered in this group
                if not row[8] <= computed:
                    break  # a write below ``cow_from``: the step copies
                slides = computed >= row[6]  # the window's next block leaves it
                if slides and computed >= row[6] + view.traits[0]:
                    break  # more than one block slides out
                if not (slides or total > row[5]
                        or (hashes is not None and written >= row[7] <= hashes.num_tokens)):
                    continue  # quiet here: nothing slides, grows or completes for the cache
                work = [(view, row, slides)] if work is None else [*work, (view, row, slides)]
            else:
                if work is not None and not lean_step(tr, rid, work, computed, written, total,
                                                      hashes):
                    refused.append(rid)
                continue
        if not step(tr, rid, computed, written, total, 0, None, hashes, None):
            refused.append(rid)
    return refused


def quiet(views: Sequence[Any], limit: int, checked: Collection[int], rid: Any, computed: Any,
          new: Any, lookahead: Any, hashes: Any) -> bool:
    """Whether a plain entry ``(rid, computed, new)`` is quiet in every group of ``views``.

    The lane's question for one entry, asked before a transition is opened
    (``allocate_slots``, the compat facade): True only for valid counts of
    a request registered in every group whose rows' quiet limits say the
    step has nothing to do, with hashes (if any) of a block size the state
    has already ``checked``.  Anything else is False and goes through the
    fold, which checks it fully.  It reads the rows as :func:`fold`'s lane
    does (``tests/test_lane.py`` runs programs with both off and on).
    """
    t = type(rid)
    if not (LANE and (t is int or t is str) and type(computed) is int is type(new)
            and type(lookahead) is int and (computed | new) >= 0 and new + lookahead >= 0
            and (hashes is None or (type(hashes) is BlockHashes
                                    and hashes.block_size in checked))):
        return False
    written = computed + new
    total = written + lookahead
    if total > limit or written > limit:
        return False
    for view in views:
        try:
            row = view.rows[rid]  # a subscript costs half a ``get`` here
        except KeyError:
            return False
        if (not row[8] <= computed < row[6] or total > row[5]
                or (hashes is not None and written >= row[7] and hashes.num_tokens >= row[7])):
            return False
    return True


#: :func:`work_of`'s answer, bits: a block may complete (caching), a block leaves a window
#: (slides), anything else to do (busy; sliding is busy too).
NOTHING, CACHING, BUSY, SLIDES = 0, 1, 2, 4


def work_of(views: Sequence[Any], limit: int, rid: Any, computed: int, written: int,
            total: int) -> int:
    """What ``(computed, written, total)`` tokens of ``rid`` leave to do, whatever hashes
    came with them: :data:`NOTHING`, or the bits :data:`CACHING`, :data:`BUSY` and
    :data:`SLIDES`.

    :func:`quiet`'s question for a caller that has not fetched the request's
    hashes yet, read from the rows' quiet limits.  CACHING: ``written``
    reaches some row's ``fill``, or a block past its room (one the step
    takes) fills, so a block completes that hashes could cache; without it
    no transition on these counts caches anything.  BUSY: some row's other
    limits do not hold (a block to take or to let go, a write to copy), or
    the request has no row; SLIDES (with BUSY): a window lets a block go.
    NOTHING: a transition on these counts returns its state unchanged;
    CACHING alone: it has nothing to do but cache.  The counts are the
    caller's own ints (a running request's), not checked here; without the
    lane every answer has every bit.
    """
    if not (LANE and total <= limit and written <= limit):
        return BUSY | CACHING | SLIDES
    answer = NOTHING
    for view in views:
        row = view.rows.get(rid)
        if row is None:
            return BUSY | CACHING | SLIDES
        if computed >= row[6]:
            answer |= BUSY | SLIDES
        elif not row[8] <= computed or total > row[5]:
            answer |= BUSY
        if written >= row[7] or written >= row[5] + view.traits[0]:
            answer |= CACHING
    return answer


def lane_plan(views: Sequence[Any], rid: Any, computed: int, total: int
              ) -> list[tuple[int, bool]] | None:
    """Per group of ``views``, what a step of ``rid`` from ``computed`` tokens to ``total``
    does as the rows tell: ``(blocks it takes, whether a block it lets go caches nothing)``;
    None when a group has no row or the step writes below ``cow_from`` (it copies).

    For a caller that owes the step (``kvfunc.vllm``): a block let go that caches nothing
    joins the front of a linked pool's free queue, one that caches something the back (with
    no priority in use).  Ask :func:`work_of` first: past the state's limit, or with the
    lane off, it answers every bit, and the plan means nothing then.
    """
    out = []
    for view in views:
        row = view.rows.get(rid)
        if row is None or not row[8] <= computed:
            return None
        out.append((blocks_needed(view.policy, True, row[9], total)[1] if total > row[5] else 0,
                    computed >= row[6] and slid_out(view.policy, view.traits[2], computed,
                                                    row[9]) > max(row[1], row[2])))
    return out


def _general(tr: Transient, e: Any, lookahead: int, mapping: Mapping[Any, Any] | None,
             own: Any) -> bool:
    """An entry of a rarer form through :func:`check_entry` and the step; False if refused."""
    if own is not None:  # a 3-tuple's own hashes: the general form carries them
        e = (*e, lookahead, 0, None, own, None)
    return step(tr, *check_entry(tr, e, lookahead, mapping))
