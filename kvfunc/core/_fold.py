"""The fold of a scheduler step: every request through the one step, in order.

Theory of operation
-------------------
A step's input is a sequence of entries, one per request.  The natural form
is a plain tuple ``(request_id, computed_tokens, num_new_tokens)``; a
:class:`SlotRequest` (or a tuple of up to its eight fields) carries the rarer
arguments: its own lookahead, a reservation, a manager-key subset, block
hashes, a prefix hit.  :func:`fold` checks each entry once and runs
:func:`~kvfunc.core._step.step` on it, so the result is by definition that
of calling ``allocate_slots`` for each entry in order.

Most entries of a decode step change nothing: the request writes into a
block it already holds alone, nothing slides out of a window, nothing is
left to cache.  The fold recognises such a *quiet* entry from the request's
row alone, O(1) fields per group and no per-block vector, and skips the step
for it: the quiet lane.  It applies when every group's policy grows with
tokens and is described by its window (the built-in full-attention and
sliding-window policies); a property test checks that the lane skips only
entries for which the step does nothing, and the benchmark lane
``bench_core.py`` (b) measures what it earns.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from kvfunc.core._checks import check_count, check_manager_keys, check_request_id, excerpt
from kvfunc.core._errors import InvalidArgumentError, InvalidTypeError
from kvfunc.core._group import Transient
from kvfunc.core._hashing import BlockHashes
from kvfunc.core._prefix import check_hashes, check_hit
from kvfunc.core._step import cache_step, step

__all__ = ["SlotRequest", "check_lookahead", "fold", "quiet_lane", "slot_entry"]


class SlotRequest(NamedTuple):
    """One request's slot demand in a scheduler step, with every optional argument.

    A plain tuple ``(request_id, computed_tokens, num_new_tokens)`` is the
    natural, fastest form; a ``SlotRequest`` (or a tuple of its first 4-8
    fields) carries the rest.  ``block_hashes`` and ``prefix_hit`` are
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


Lane = list[tuple[int, Any, int, int | None]]


def slot_entry(request_id: Any, computed: Any, new: Any, lookahead: Any = 0, reserved: Any = 0,
               keys: Any = None, hashes: Any = None, hit: Any = None) -> tuple[Any, ...]:
    """The cheapest entry equal to these arguments: a plain 3-tuple when the rest are defaults.

    >>> slot_entry("a", 0, 5), slot_entry("a", 0, 5, False)
    (('a', 0, 5), SlotRequest(request_id='a', ..., lookahead_tokens=False, ...))
    """
    if (type(lookahead) is int and type(reserved) is int and not lookahead and not reserved
            and keys is None and hashes is None and hit is None):
        return (request_id, computed, new)
    return SlotRequest(request_id, computed, new, lookahead, reserved, keys, hashes, hit)


def quiet_lane(tr: Transient) -> Lane | None:
    """Per group ``(index, rows, block_size, window - 1 or None)``; None if a policy needs the step.

    The transient keeps it until a group's working copy is made (its rows move).
    """
    lane: Lane = []
    for view in tr.views:
        policy = view.policy
        if not policy.grows_with_tokens:
            return None
        window = policy.window
        if window is None and policy.may_skip:
            return None
        lane.append((len(lane), view.rows, policy.block_size,
                     None if window is None else window - 1))
    tr.lane = lane
    if not any(tr.copies):  # the state's own rows: any transient of it may reuse the lane
        object.__setattr__(tr.src, "_lane", lane)
    return lane


def _entry(e: Any, lookahead: int, tr: Transient) -> tuple[Any, ...]:
    """Any entry, each field checked: ``(rid, computed, written, total, reserved, keys,
    hashes, hit)`` (the fold checks the plain 3-tuple inline, and calls this to raise)."""
    if not isinstance(e, tuple) or not 3 <= len(e) <= 8:
        msg = (f"a step entry must be a tuple (request_id, computed_tokens, num_new_tokens) or "
               f"a SlotRequest, got {excerpt(e)}")
        raise InvalidTypeError(msg)
    fields = SlotRequest(*e) if type(e) is not SlotRequest else e
    rid, computed, new, la, reserved, keys, hashes, hit = fields
    if len(e) < 4:
        la = lookahead
    check_request_id(rid)
    check_count("computed_tokens", computed)
    check_count("num_new_tokens", new)
    check_lookahead(la)
    check_count("reserved_tokens", reserved)
    keys = check_manager_keys(keys)
    written, total = computed + new, computed + new + la
    if total < 0:  # a negative lookahead
        if keys is None or any(v.key in keys for v in tr.views):
            raise InvalidArgumentError(f"num_tokens must be non-negative, got {total}")
        total = 0
    limit = tr.max_model_len
    if total > limit or written > limit:
        computed, written, total = min(computed, limit), min(written, limit), min(total, limit)
    return rid, computed, written, total, reserved, keys, hashes, hit


def check_lookahead(value: object) -> int:
    """Lookahead tokens are an int (not a bool) and, as in the seed, may be negative."""
    if type(value) is not int:
        msg = f"lookahead_tokens must be an int, but got {excerpt(value)}"
        raise InvalidTypeError(msg)
    return value


def _apply_lane(tr: Transient, slot: int, request_id: int | str,
                actions: list[tuple[int, Any, int, bool]], computed: int, written: int,
                hashes: Any, block_hashes: Any) -> bool:
    """Grow and cache as the step would for an entry on the lane; False if a pool lacks room.

    ``actions`` holds, per group that is not quiet, ``(index, row, new blocks, fills)``:
    the step would append the new blocks, then cache the blocks the step fills.
    """
    copies = []
    fills_any = False
    for i, row, need, fills in actions:
        g = tr.copies[i] or tr.copy(i)
        if need > g.count:
            return False  # the step refuses it (or recycles first): let it
        copies.append((g, row, need, fills))
        fills_any = fills_any or fills
    if fills_any:
        hashes = _hashes_of(tr, request_id, hashes, block_hashes, None, None, computed)
    for g, row, need, fills in copies:
        if need:
            row = g.rows[slot] = g.grow(request_id, row, need)  # the row exists: a rebind
        if fills and hashes is not None:
            cache_step(g, slot, request_id, row, computed, written, hashes)
    return True


def _hashes_of(tr: Transient, request_id: int | str, hashes: Any, block_hashes: Any,
               hit: Any, keys: Any, computed: int) -> Any:
    """The entry's hashes (its own, or the step's mapping's), checked; a hit is checked too.

    A block size checked once (``tr.checked``) is not checked against the groups again.
    """
    if hashes is None and block_hashes is not None and tr.caching:
        hashes = block_hashes.get(request_id)
    if hit is not None or (hashes is not None and (type(hashes) is not BlockHashes
                                                   or hashes.block_size not in tr.checked)):
        check_hashes(tr, hashes, hit is not None)  # hashes is a BlockHashes from here on
        if hit is not None:
            check_hit(tr, request_id, computed, keys, hashes, hit)
        tr.checked.add(hashes.block_size)
    return hashes


def fold(tr: Transient, entries: Iterable[Any], block_hashes: Mapping[Any, Any] | None = None,
         lookahead: int = 0) -> Sequence[int | str]:
    """Run the step for every entry in order on ``tr``; the refused request ids (see above)."""
    refused: list[int | str] | None = None
    limit, slots, caching = tr.max_model_len, tr.slots.slots, tr.caching
    lane = tr.lane if tr.lane is not None else quiet_lane(tr)
    inline = lookahead >= 0  # then a plain entry's total passes the limit when its written does
    for e in entries:
        if inline and type(e) is tuple and len(e) == 3:  # the natural form, checked here
            rid, computed, new = e
            t = type(rid)
            if ((t is not int and t is not str) or type(computed) is not int
                    or type(new) is not int or (computed | new) < 0):
                _entry(e, lookahead, tr)  # raises the precise error
            written = computed + new
            total = written + lookahead
            if total > limit:
                computed, written, total = min(computed, limit), min(written, limit), limit
            fields = None
        else:
            fields = _entry(e, lookahead, tr)
            rid, computed, written, total = fields[:4]
        if lane is not None and (fields is None or not (fields[4] or fields[5] is not None
                                                        or fields[7] is not None)):
            slot = slots.get(rid)
            if slot is not None:
                actions = None
                for i, rows, bs, w1 in lane:  # the lane (see the module docstring)
                    try:
                        row = rows[slot]
                    except IndexError:  # a slot past the vector: not registered here
                        break
                    if row is None or (not (length := row[1]) and total):
                        break  # not registered here, or its first allocation
                    if w1 is not None and (computed - w1) // bs > row[2] < length:
                        break  # a block slid out of the window: the step recycles it
                    fills = False
                    if caching:
                        if total and computed // bs < row[3]:
                            break  # a write into a block others may hold: copy-on-write
                        fills = written // bs > row[4] and written // bs > row[2]
                    if total > length * bs or fills:  # grows, or fills a block to cache
                        need = (total + bs - 1) // bs - length if total > length * bs else 0
                        actions = actions or []
                        actions.append((i, row, need, fills))
                else:
                    if actions is None:
                        continue  # quiet in every group
                    if _apply_lane(tr, slot, rid, actions, computed, written,
                                   None if fields is None else fields[6], block_hashes):
                        lane = tr.lane if tr.lane is not None else quiet_lane(tr)
                        continue
        reserved, keys, hashes, hit = (0, None, None, None) if fields is None else fields[4:]
        hashes = _hashes_of(tr, rid, hashes, block_hashes, hit, keys, computed)
        if not step(tr, rid, computed, written, total, reserved, keys, hashes, hit):
            refused = refused or []
            refused.append(rid)
        lane = tr.lane if tr.lane is not None or lane is None else quiet_lane(tr)
    return refused or ()
