"""Replay: a state and the deltas that followed it give the final state exactly."""

from __future__ import annotations

from collections.abc import Iterable

from kvfunc.core._delta import DELTA_VERSION, BlocksChanged
from kvfunc.core._errors import ReplayMismatchError, UnknownRequestError
from kvfunc.core._prefix_replay import apply_cached_delta
from kvfunc.core._state import NULL_BLOCK, BlockId, KVState, RequestId
from kvfunc.core._transient import Transient

__all__ = ["apply_delta_into", "replay"]


def replay(state: KVState, deltas: Iterable[BlocksChanged]) -> KVState:
    """Apply ``deltas`` in order to ``state``; checks each one fits.

    The deltas are a complete log: ``replay(s0, [d1, d2, ...])`` equals the
    state the transitions produced.  A delta that does not fit (a block the
    pool would not hand out, an unknown request) raises
    :class:`~kvfunc.ReplayMismatchError` and nothing is returned.

    >>> from kvfunc.core import FullAttention, KVState, allocate_slots, free_request
    >>> s0 = KVState.create({"full": FullAttention(num_blocks=8, block_size=4)}, 64)
    >>> r = allocate_slots(s0, "a", 0, 9)
    >>> s2, d2 = free_request(r.state, "a")
    >>> replay(s0, [r.delta, d2]) == s2
    True
    """
    tr = Transient(state)
    for delta in deltas:
        apply_delta_into(tr, delta)
    return tr.freeze()


def _mismatch(msg: str) -> ReplayMismatchError:
    return ReplayMismatchError(msg)


def apply_delta_into(tr: Transient, delta: BlocksChanged) -> None:
    """Apply one delta to a transient (see :mod:`kvfunc.core._delta` for the order)."""
    if not isinstance(delta, BlocksChanged):
        raise _mismatch(f"expected a BlocksChanged delta, got {type(delta).__name__}")
    if delta.version != DELTA_VERSION:
        raise _mismatch(f"delta version {delta.version} is not {DELTA_VERSION}")
    try:
        _apply(tr, delta)
    except UnknownRequestError as exc:
        raise _mismatch(f"delta names an unknown manager key: {exc}") from None


def _apply(tr: Transient, d: BlocksChanged) -> None:
    if tr.caching:
        apply_cached_delta(tr, d, _mismatch)
        return
    for key, rid, pos in zip(d.nulled_keys, d.nulled_request_ids, d.nulled_positions,
                             strict=True):
        g = tr.group(key)
        table = g.tables.get(rid)
        if table is None or not 0 <= pos < len(table) or table[pos] == NULL_BLOCK:
            raise _mismatch(f"cannot null position {pos} of {rid!r} in {key!r}: {table!r}")
        g.set_table(rid, table[:pos] + (NULL_BLOCK,) + table[pos + 1:])
    for key, block in zip(d.freed_keys, d.freed_block_ids, strict=True):
        g = tr.group(key)
        if not 0 < block < g.policy.num_blocks or g.count >= g.cap:
            raise _mismatch(f"cannot free block {block!r} into {key!r}")
        g.give((block,))
    for key, rid in zip(d.released_keys, d.released_request_ids, strict=True):
        g = tr.group(key)
        if rid not in g.tables:
            raise _mismatch(f"cannot release unknown request {rid!r} in {key!r}")
        g.drop_table(rid)
    for key, rid in zip(d.registered_keys, d.registered_request_ids, strict=True):
        g = tr.group(key)
        if rid in g.tables:
            raise _mismatch(f"request {rid!r} is already registered in {key!r}")
        g.set_table(rid, ())
    runs: dict[tuple[str, RequestId], list[BlockId]] = {}
    for key, rid, block in zip(d.appended_keys, d.appended_request_ids, d.appended_block_ids,
                               strict=True):
        runs.setdefault((key, rid), []).append(block)
    for (key, rid), blocks in runs.items():
        g = tr.group(key)
        table = g.tables.get(rid)
        if table is None:
            raise _mismatch(f"cannot append to unknown request {rid!r} in {key!r}")
        for block in blocks:
            if block != NULL_BLOCK:
                if g.count == 0:
                    raise _mismatch(f"{key!r} has no free block for {block!r}")
                (taken,) = g.take(1)
                if taken != block:
                    raise _mismatch(f"{key!r} hands out block {taken}, the delta says {block}")
        g.set_table(rid, table + tuple(blocks))
