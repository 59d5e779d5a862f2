"""Replay: a state and the deltas that followed it give the final state exactly.

Replay is a fold of the same primitives the transitions use, over each
delta's operations in order (:meth:`~kvfunc.BlocksChanged.operations`), and
it checks every operation against the state it applies to: a block the pool
would not hand out, a free of a block nobody released (or that is free
already), a release whose blocks are never freed, a null entry where the
policy keeps every token, a request id that is not a ``str`` or ``int``, a
shared block that is neither held nor cached, and so on.  The first
operation that does not fit raises :class:`~kvfunc.ReplayMismatchError`
naming the delta and the operation, and nothing is returned.

Blocks a release, a null or a copy-on-write leaves without a holder are
*pending* until the delta's Freed rows return them, in the order the
transition did; a delta that leaves one pending does not fit.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvfunc.core._checks import excerpt, is_request_id
from kvfunc.core._delta import COPY_INTO_NEW, COPY_SAVED, BlocksChanged
from kvfunc.core._errors import ReplayMismatchError, UnknownRequestError
from kvfunc.core._group import GroupCopy, Transient
from kvfunc.core._ops import (
    Appended,
    Cleared,
    Copied,
    Evicted,
    Freed,
    LookedUp,
    Nulled,
    Registered,
    Released,
    Shared,
    Stored,
)
from kvfunc.core._rows import EMPTY_ROW, Row, extend_row, replace_entry
from kvfunc.core._state import KVState, check_state

__all__ = ["apply_delta_into", "replay"]

_new = tuple.__new__


class _Mismatch(Exception):
    """An operation that does not fit (turned into a ReplayMismatchError naming it)."""


def replay(state: KVState, deltas: Iterable[BlocksChanged]) -> KVState:
    """Apply ``deltas`` in order to ``state``, checking that each one fits.

    The deltas are a complete log: ``replay(s0, [d1, d2, ...])`` equals the
    state the transitions produced.

    Raises:
        ReplayMismatchError: a delta does not fit the state it applies to (the
            message names the delta's index and the operation).

    >>> from kvfunc.core import FullAttention, KVState, allocate_slots, free_request
    >>> s0 = KVState.create({"full": FullAttention(num_blocks=8, block_size=4)}, 64)
    >>> r = allocate_slots(s0, "a", 0, 9)
    >>> s2, d2 = free_request(r.state, "a")
    >>> replay(s0, [r.delta, d2]) == s2
    True
    >>> replay(s0, [d2])
    Traceback (most recent call last):
    ...
    kvfunc.core._errors.ReplayMismatchError: delta 0, operation 0 Released(...): ...
    """
    check_state(state)
    tr = Transient(state)
    for n, delta in enumerate(deltas):
        apply_delta_into(tr, delta, n)
    return tr.freeze()


def apply_delta_into(tr: Transient, delta: BlocksChanged, index: int = 0) -> None:
    """Apply one delta to a transient (see the module docstring)."""
    if not isinstance(delta, BlocksChanged):
        msg = f"delta {index}: expected a BlocksChanged delta, got {type(delta).__name__}"
        raise ReplayMismatchError(msg)
    pending: dict[str, list[int]] = {}
    op: Any = None
    i = -1
    try:
        for op in delta.operations():
            i += 1
            _apply(tr, op, pending)
    except ReplayMismatchError as exc:  # a malformed delta: its own message
        raise ReplayMismatchError(f"delta {index}: {exc}") from None
    except (_Mismatch, UnknownRequestError) as exc:
        msg = f"delta {index}, operation {i} {excerpt(op, 120)}: {exc}"
        raise ReplayMismatchError(msg) from None
    left = {k: v for k, v in pending.items() if v}
    if left:
        msg = f"delta {index}: blocks left without a holder are never freed: {excerpt(left)}"
        raise ReplayMismatchError(msg)


def _apply(tr: Transient, op: Any, pending: dict[str, list[int]]) -> None:
    if type(op) is LookedUp:
        _request_id(op.request_id)
        return
    if type(op.key) is not str:
        _fail(f"manager key {excerpt(op.key)} is not a str")
    g = tr.group(op.key)
    _HANDLERS[type(op)](tr, g, op, pending.setdefault(g.key, []))


def _fail(msg: str) -> Any:
    raise _Mismatch(msg)


def _request_id(value: object) -> None:
    if not is_request_id(value):
        _fail(f"request id {excerpt(value)} is not a str or an int")


def _block(g: GroupCopy, value: object) -> int:
    if type(value) is not int or not 0 < value < g.policy.num_blocks:
        _fail(f"block {excerpt(value)} is out of range for {g.key!r}")
    return value  # type: ignore[return-value]


def _keeps_every_token(g: GroupCopy) -> bool:
    """True when the group's policy never skips a token (no null entries, nothing slides out)."""
    return g.policy.window is None and not g.policy.may_skip


def _take(g: GroupCopy, b: int) -> None:
    """Take the head of the free queue, which must be block ``b``."""
    if g.count == 0:
        _fail(f"{g.key!r} has no free block for {b}")
    (taken,) = g.take(1)
    if taken != b:
        _fail(f"{g.key!r} hands out block {taken}, the delta says {b}")


def _row(tr: Transient, g: GroupCopy, request_id: object) -> tuple[int, Row]:
    _request_id(request_id)
    slot = tr.slots.get(request_id)  # type: ignore[arg-type]
    row = g.row(slot) if slot is not None else None
    if row is None:
        _fail(f"request {excerpt(request_id)} is not registered in {g.key!r}")
    return slot, row  # type: ignore[return-value]


def _drop_holder(g: Any, b: int, pending: list[int]) -> None:
    """One holder of ``b`` is gone; it waits for its Freed row if it was the last."""
    if g.caching:
        g.writing()
        r = g.refs[b] - 1
        g.refs[b] = r
        if r:
            return
    pending.append(b)


def _registered(tr: Transient, g: GroupCopy, op: Any, pending: list[int]) -> None:
    _request_id(op.request_id)
    slot = tr.slots.slot_of(op.request_id)
    if g.row(slot) is not None:
        _fail("the request is registered already")
    g.put(slot, EMPTY_ROW)


def _released(tr: Transient, g: GroupCopy, op: Any, pending: list[int]) -> None:
    slot, row = _row(tr, g, op.request_id)
    g.drop(slot, op.request_id)
    for b in g.release_order(row):
        _drop_holder(g, b, pending)


def _nulled(tr: Transient, g: GroupCopy, op: Any, pending: list[int]) -> None:
    slot, row = _row(tr, g, op.request_id)
    if op.position != row.nulls or row.nulls >= row.length:
        _fail(f"position {excerpt(op.position)} does not extend the null prefix {row.nulls}")
    if _keeps_every_token(g):
        _fail(f"{g.key!r} keeps every token: nothing slides out")
    g.put(slot, _new(Row, (row.ids, row.length, row.nulls + 1, row.shared, row.stored)))
    _drop_holder(g, row.ids[op.position], pending)


def _freed(tr: Transient, g: GroupCopy, op: Any, pending: list[int]) -> None:
    b = _block(g, op.block_id)
    if b not in pending:
        _fail(f"block {b} is freed, but no operation of the delta left it without a holder")
    pending.remove(b)
    g.free((b,))


def _appended(tr: Transient, g: GroupCopy, op: Any, pending: list[int]) -> None:
    slot, row = _row(tr, g, op.request_id)
    if op.block_id == 0:
        if _keeps_every_token(g):
            _fail(f"a null entry in {g.key!r}, whose policy keeps every token")
        if row.length != row.nulls:
            _fail("a null entry after a real one")
        g.put(slot, extend_row(row, (), 1))
        return
    b = _block(g, op.block_id)
    _take(g, b)
    g.put(slot, extend_row(row, (b,)))


def _shared(tr: Transient, g: GroupCopy, op: Any, pending: list[int]) -> None:
    slot, row = _row(tr, g, op.request_id)
    b = _block(g, op.block_id)
    if not g.caching:
        _fail(f"{g.key!r} has no reference counts: nothing can be shared")
    cache: Any = g
    if not cache.refs[b] and cache.hash_of[b] is None:
        _fail(f"block {b} is free and holds nothing cached: it cannot be shared")
    g.put(slot, cache.share(op.request_id, row, (b,)))


def _copied(tr: Transient, g: GroupCopy, op: Any, pending: list[int]) -> None:
    if not g.caching:
        _fail(f"{g.key!r} has no reference counts: nothing is copied")
    slot, row = _row(tr, g, op.request_id)
    src, dst, pos = _block(g, op.src_block_id), _block(g, op.dst_block_id), op.position
    if pos == COPY_INTO_NEW:
        if row.nulls >= row.length or row.ids[row.nulls] != dst:
            _fail(f"block {dst} is not the request's new block")
        return
    if type(pos) is not int or not (pos == COPY_SAVED or row.nulls <= pos < row.length):
        _fail(f"position {excerpt(pos)} is not in the request's table")
    if pos >= 0 and row.ids[pos] != src:
        _fail(f"position {pos} holds block {row.ids[pos]}, not {src}")
    _take(g, dst)
    if pos == COPY_SAVED:
        return  # held by nobody once its Stored row caches it
    new = replace_entry(row, pos, dst)
    g.put(slot, _new(Row, (new.ids, new.length, new.nulls, new.shared, min(new.stored, pos))))
    _drop_holder(g, src, pending)


def _stored(tr: Transient, g: GroupCopy, op: Any, pending: list[int]) -> None:
    cache: Any = g
    if not g.caching:
        _fail(f"{g.key!r} has no prefix cache")
    b = _block(g, op.block_id)
    if type(op.block_hash) is not bytes or cache.hash_of[b] is not None:
        _fail(f"block {b} cannot be cached under {excerpt(op.block_hash)}")
    if op.position == COPY_SAVED:
        if cache.refs[b] != 1:
            _fail(f"block {b} was not just taken to save a state")
        cache.cache_block(b, op.block_hash)
        _drop_holder(g, b, pending)
        return
    slot, row = _row(tr, g, op.request_id)
    pos = op.position
    if type(pos) is not int or not 0 <= pos < row.length or row.ids[pos] != b or pos < row.nulls:
        _fail(f"block {b} is not at position {excerpt(pos)} of the request's table")
    if any(cache.hash_of[row.ids[q]] is None for q in range(max(row.stored, row.nulls), pos)):
        _fail("a block before it is not cached")
    cache.cache_block(b, op.block_hash)
    g.put(slot, _new(Row, (row.ids, row.length, row.nulls, max(row.shared, pos + 1), pos + 1)))


def _evicted(tr: Transient, g: GroupCopy, op: Any, pending: list[int]) -> None:
    cache: Any = g
    b = _block(g, op.block_id)
    if not g.caching or cache.refs[b] or cache.hash_of[b] != op.block_hash:
        _fail(f"block {b} is not a free block cached under {excerpt(op.block_hash)}")
    cache.writing()
    cache.hash_of[b] = None
    cache.num_cached -= 1


def _cleared(tr: Transient, g: GroupCopy, op: Any, pending: list[int]) -> None:
    if not g.caching:
        _fail(f"{g.key!r} has no prefix cache")
    g.clear()  # type: ignore[attr-defined]


_HANDLERS: dict[type[Any], Any] = {
    Registered: _registered, Released: _released, Nulled: _nulled, Freed: _freed,
    Appended: _appended, Shared: _shared, Copied: _copied, Stored: _stored, Evicted: _evicted,
    Cleared: _cleared,
}
