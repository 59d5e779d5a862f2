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

from kvfunc.core._checks import excerpt, is_priority, is_request_id
from kvfunc.core._delta import COPY_INTO_NEW, COPY_SAVED, BlocksChanged
from kvfunc.core._digests import only_ints
from kvfunc.core._errors import InvalidTypeError, ReplayMismatchError, UnknownRequestError
from kvfunc.core._group import GroupCopy
from kvfunc.core._ops import (
    Appended,
    Cleared,
    Copied,
    Detached,
    Dropped,
    Evicted,
    Freed,
    LookedUp,
    Nulled,
    Registered,
    Released,
    Retained,
    Shared,
    Stored,
)
from kvfunc.core._pool import cache_key
from kvfunc.core._rows import NULL, Row, grown, make_row, remade, replaced
from kvfunc.core._state import KVState, check_state
from kvfunc.core._transient import Transient

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
    if isinstance(deltas, BlocksChanged) or not isinstance(deltas, Iterable):
        msg = f"deltas must be an iterable of BlocksChanged, got {excerpt(deltas)}"
        raise InvalidTypeError(msg)
    tr = Transient(state)
    try:
        for n, delta in enumerate(deltas):
            apply_delta_into(tr, delta, n)
    except BaseException:
        tr.abort()
        raise
    return tr.freeze()


def apply_delta_into(tr: Transient, delta: BlocksChanged, index: int = 0) -> None:
    """Apply one delta to a transient (see the module docstring)."""
    if not isinstance(delta, BlocksChanged):
        msg = f"delta {index}: expected a BlocksChanged delta, got {type(delta).__name__}"
        raise ReplayMismatchError(msg)
    pending: dict[str, list[int]] = {}
    seqs: dict[Any, int] = {}  # a request registered by this delta: its seq
    run: list[Any] = []  # consecutive Freed rows: one free call of the transition
    level: list[Any] = []  # a Retained row waiting for its Freed run
    op: Any = None
    i = -1
    try:
        for op in delta.operations():
            i += 1
            if run and (type(op) is not Freed or op.key != run[0].key):
                _freed_run(tr, run, pending, level)
            if type(op) is Freed:
                run.append(op)
                continue
            if level or type(op) is Retained:
                _retained(tr, op, level)
                continue
            _apply(tr, op, pending, seqs)
        if run:
            op = run[-1]
            _freed_run(tr, run, pending, level)
        if level:
            _fail("a retention priority with no Freed run after it")
    except ReplayMismatchError as exc:  # a malformed delta: its own message
        raise ReplayMismatchError(f"delta {index}: {exc}") from None
    except (_Mismatch, UnknownRequestError) as exc:
        msg = f"delta {index}, operation {i} {excerpt(op, 120)}: {exc}"
        raise ReplayMismatchError(msg) from None
    left = {k: v for k, v in pending.items() if v}
    if left:
        msg = f"delta {index}: blocks left without a holder are never freed: {excerpt(left)}"
        raise ReplayMismatchError(msg)


def _apply(tr: Transient, op: Any, pending: dict[str, Any], seqs: dict[Any, int]) -> None:
    if type(op) is LookedUp:
        _looked_up(tr, op)
        return
    if type(op.key) is not str:
        _fail(f"manager key {excerpt(op.key)} is not a str")
    g = tr.group(op.key)
    if type(op) is Registered:
        _registered(tr, g, op, seqs)
        return
    if type(op) is Evicted:
        _evicted(tr, g, op)
        return
    _HANDLERS[type(op)](g, op, pending.setdefault(g.pool.members[0], []))


def _looked_up(tr: Transient, op: Any) -> None:
    """A lookup's row: a caching state, a request admitted in every group, a hit it asked for."""
    _request_id(op.request_id)
    if not tr.caching:
        _fail("the state has no prefix cache: nothing was looked up")
    tokens, query = op.tokens, op.query_tokens
    if type(tokens) is not int or type(query) is not int or not 0 <= tokens <= query:
        _fail(f"a hit of {excerpt(tokens)} tokens out of {excerpt(query)} looked up")
    for view in tr.views:
        if view.rows.get(op.request_id) is None:
            _fail(f"request {excerpt(op.request_id)} is not registered in {view.key!r}")
        if tokens % view.policy.block_size:
            _fail(f"{excerpt(tokens)} tokens are not whole blocks of {view.key!r}")


def _fail(msg: str) -> Any:
    raise _Mismatch(msg)


def _request_id(value: object) -> None:
    if not is_request_id(value):
        _fail(f"request id {excerpt(value)} is not a str or an int")


def _block(g: GroupCopy, value: object) -> int:
    if type(value) is not int or not 0 < value < g.pool.num_blocks:
        _fail(f"block {excerpt(value)} is out of range for {g.key!r}")
    return value  # type: ignore[return-value]


def _take(g: GroupCopy, b: int) -> None:
    """Take the head of the pool's free queue, which must be block ``b``."""
    if g.pool.count == 0:
        _fail(f"{g.key!r} has no free block for {b}")
    (taken,) = g.pool.take(1)
    if taken != b:
        _fail(f"{g.key!r} hands out block {taken}, the delta says {b}")


def _row(g: GroupCopy, request_id: object) -> Row:
    _request_id(request_id)
    row = g.row(request_id)
    if row is None:
        _fail(f"request {excerpt(request_id)} is not registered in {g.key!r}")
    return row  # type: ignore[return-value]


def _drop_holder(g: GroupCopy, b: int, pending: list[int]) -> None:
    """One holder of ``b`` is gone; it waits for its Freed row if it was the last."""
    if not g.pool.linked or not g.pool.unhold(b):
        pending.append(b)


def _registered(tr: Transient, g: GroupCopy, op: Any, seqs: dict[Any, int]) -> None:
    _request_id(op.request_id)
    if g.row(op.request_id) is not None:
        _fail("the request is registered already")
    seq = seqs.get(op.request_id)
    if seq is None:
        seq = seqs[op.request_id] = tr.seq
        tr.seq += 1
    g.put(op.request_id, make_row((), 0, 0, 0, seq))


def _released(g: GroupCopy, op: Any, pending: list[int]) -> None:
    row = _row(g, op.request_id)
    g.rows.pop(op.request_id)
    g.changed = True
    for b in g.release_order(row):
        _drop_holder(g, b, pending)


def _nulled(g: GroupCopy, op: Any, pending: list[int]) -> None:
    row = _row(g, op.request_id)
    if op.position != row.nulls or row.length == row.nulls:
        _fail(f"position {excerpt(op.position)} does not extend the null prefix {row.nulls}")
    if g.keeps_every_token:
        _fail(f"{g.key!r} keeps every token: nothing slides out")
    g.put(op.request_id, remade(row, row.nulls + 1, row.stored, row.shared))
    _drop_holder(g, row.ids[row.nulls], pending)


def _retained(tr: Transient, op: Any, level: list[Any]) -> None:
    """A retention priority (of a caching group) for the Freed run right after it."""
    if level or type(op) is not Retained:
        _fail("a retention priority with no Freed run after it")
    if type(op.key) is not str or not tr.group(op.key).pool.caching:
        _fail(f"{excerpt(op.key)} is not a group with a prefix cache")
    if not is_priority(op.priority) or not op.priority:
        _fail(f"priority {excerpt(op.priority)} is not a retention priority other than 0")
    level.append(op)


def _freed_run(tr: Transient, run: list[Any], pending: dict[str, Any], level: list[Any]) -> None:
    """A run of Freed rows: the blocks one free call of the transition returned, at once."""
    key = run[0].key
    if type(key) is not str:
        _fail(f"manager key {excerpt(key)} is not a str")
    lead = level.pop() if level else None
    if lead is not None and lead.key != key:
        _fail(f"a retention priority of {excerpt(lead.key)} before a Freed run of {excerpt(key)}")
    g = tr.group(key)
    left = pending.setdefault(g.pool.members[0], [])
    ids = []
    for op in run:
        b = _block(g, op.block_id)
        if b not in left:
            _fail(f"block {b} is freed, but no operation of the delta left it without a holder")
        left.remove(b)
        ids.append(b)
    run.clear()
    g.pool.free(ids, g.key, 0 if lead is None else lead.priority)


def _appended(g: GroupCopy, op: Any, pending: list[int]) -> None:
    row = _row(g, op.request_id)
    if op.block_id == 0:
        if g.keeps_every_token:
            _fail(f"a null entry in {g.key!r}, whose policy keeps every token")
        if row.length > row.nulls:
            _fail("a null entry after a real one")
        g.put(op.request_id, grown(row, [NULL], row.nulls + 1, row.stored, row.shared))
        return
    b = _block(g, op.block_id)
    _take(g, b)
    g.put(op.request_id, grown(row, [b], row.nulls, row.stored, row.shared))


def _shared(g: GroupCopy, op: Any, pending: list[int]) -> None:
    row = _row(g, op.request_id)
    b = _block(g, op.block_id)
    pool = g.pool
    if not pool.caching:
        _fail(f"{g.key!r} has no prefix cache: nothing can be shared")
    if not pool.refs[b] and pool.hash_of[b] is None:
        _fail(f"block {b} is free and holds nothing cached: it cannot be shared")
    if b in pending:
        _fail(f"block {b} was released and waits for its Freed row: it cannot be shared")
    if pool.refs[b] and pool.hash_of[b] is None:  # a fork: the holders now share a block
        for rid, other in g.items():              # they may write into, so they copy first
            if b in other.blocks:
                pos = other.nulls + other.blocks.index(b) + 1
                if other.shared < pos:
                    g.put(rid, remade(other, other.nulls, other.stored, pos))
        row = g.row(op.request_id) or row
    g.put(op.request_id, g.share(op.request_id, row, (b,)))


def _copied(g: GroupCopy, op: Any, pending: list[int]) -> None:
    if not g.pool.caching:
        _fail(f"{g.key!r} has no prefix cache: nothing is copied")
    row = _row(g, op.request_id)
    src, dst, pos = _block(g, op.src_block_id), _block(g, op.dst_block_id), op.position
    if pos == COPY_INTO_NEW:
        if row.length == row.nulls or row.ids[row.nulls] != dst:
            _fail(f"block {dst} is not the request's new block")
        return
    if type(pos) is not int or not (pos == COPY_SAVED or row.nulls <= pos < row.length):
        _fail(f"position {excerpt(pos)} is not in the request's table")
    if pos >= 0 and row.ids[pos] != src:
        _fail(f"position {pos} holds block {row.ids[pos]}, not {src}")
    _take(g, dst)
    if pos == COPY_SAVED:
        return  # held by nobody once its Stored row caches it
    g.put(op.request_id, replaced(row, pos, dst, min(row.stored, pos)))
    _drop_holder(g, src, pending)


def _stored(g: GroupCopy, op: Any, pending: list[int]) -> None:
    pool = g.pool
    if not pool.caching:
        _fail(f"{g.key!r} has no prefix cache")
    b = _block(g, op.block_id)
    if type(op.block_hash) is not bytes or not op.block_hash or pool.hash_of[b] is not None:
        _fail(f"block {b} cannot be cached under {excerpt(op.block_hash)}")
    key = cache_key(op.block_hash, g.tag)
    _stored_tokens(g, op)
    if op.position == COPY_SAVED:
        if pool.refs[b] != 1:
            _fail(f"block {b} was not just taken to save a state")
        pool.store_run((b,), (key,))
        _drop_holder(g, b, pending)
        return
    row = _row(g, op.request_id)
    pos = op.position
    if (type(pos) is not int or not row.nulls <= pos < row.length
            or row.ids[pos] != b):
        _fail(f"block {b} is not at position {excerpt(pos)} of the request's table")
    if any(pool.hash_of[row.ids[q]] is None
           for q in range(max(row.stored, row.nulls), pos)):
        _fail("a block before it is not cached")
    pool.store_run((b,), (key,))
    g.put(op.request_id, remade(row, row.nulls, pos + 1, max(row.shared, pos + 1)))


def _stored_tokens(g: GroupCopy, op: Any) -> None:
    """A table block's row carries its block of tokens and, past block 0, a parent hash.

    A saved state (``COPY_SAVED``) holds none, nor do hashes kept without (None).
    KV events pass them on: fewer tokens would describe a block nobody could match.
    """
    tokens, parent = op.token_ids, op.parent_hash
    if tokens is not None and (type(tokens) is not tuple or not only_ints(tokens)):
        _fail(f"token ids {excerpt(tokens)} are not a tuple of ints")
    if op.position == COPY_SAVED:
        if tokens:
            _fail("a saved state holds no tokens")
        return
    if tokens is not None and len(tokens) != g.block_size:
        _fail(f"{len(tokens)} token ids for a block of {g.block_size} in {g.key!r}")
    if (parent is None) != (op.position == 0) or (parent is not None and (
            type(parent) is not bytes or not parent)):
        _fail(f"parent hash {excerpt(parent)} does not fit position {excerpt(op.position)}")


def _evicted(tr: Transient, g: GroupCopy, op: Any) -> None:
    pool = g.pool
    b = _block(g, op.block_id)
    if (not pool.caching or type(op.block_hash) is not bytes
            or pool.hash_of[b] != cache_key(op.block_hash, g.tag)):
        _fail(f"block {b} is not a block cached under {excerpt(op.block_hash)}")
    held = pool.refs[b] > 0
    pool.evict(b)
    if held:  # an explicit eviction: the rows that hold it no longer count it stored
        for key in pool.members:
            tr.group(key).unstore(b)


def _detached(g: GroupCopy, op: Any, pending: list[int]) -> None:
    _row(g, op.request_id)
    g.detach(op.request_id)


def _dropped(g: GroupCopy, op: Any, pending: list[int]) -> None:
    b = _block(g, op.block_id)
    if not g.pool.detached.get(b):
        _fail(f"block {b} is not detached")
    g.pool.attach((b,))
    _drop_holder(g, b, pending)


def _cleared(g: GroupCopy, op: Any, pending: list[int]) -> None:
    if not g.pool.caching:
        _fail(f"{g.key!r} has no prefix cache")
    g.pool.clear()
    g.unstore_all()


_HANDLERS: dict[type[Any], Any] = {
    Released: _released, Nulled: _nulled, Appended: _appended, Shared: _shared,
    Copied: _copied, Stored: _stored, Cleared: _cleared, Detached: _detached,
    Dropped: _dropped,
}
