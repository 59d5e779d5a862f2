"""Settling moves: the second phase of every move between tiers.

See :mod:`kvfunc.core._tiers` for the theory of operation.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

from kvfunc.core._checks import check_request_id, excerpt
from kvfunc.core._delta import EMPTY_DELTA, BlocksChanged
from kvfunc.core._detach import evict_blocks
from kvfunc.core._errors import InvalidArgumentError, InvalidTypeError, UnknownRequestError
from kvfunc.core._state import RequestId
from kvfunc.core._tier_delta import TierDelta
from kvfunc.core._tier_state import (
    DEVICE_TO_HOST,
    HOST_TO_DEVICE,
    REMOTE_TO_DEVICE,
    TieredState,
    TierMove,
    check_tiered,
)
from kvfunc.core._tier_work import TierWork
from kvfunc.core._transitions import get_block_ids

__all__ = ["MovesResult", "complete_moves", "loads_pending"]


class MovesResult(NamedTuple):
    """Outcome of :func:`complete_moves`.

    ``recompute_from`` maps each request a failed load was for to the tokens
    that are still good: the scheduler computes it again from there once
    :func:`loads_pending` says its loads have settled.

    >>> from kvfunc.core import FullAttention, KVState, TieredState
    >>> dev = KVState.create({"f": FullAttention(num_blocks=2, block_size=4)}, 64,
    ...                      enable_prefix_caching=True)
    >>> complete_moves(TieredState.create(dev)).recompute_from
    {}
    """

    state: TieredState
    delta: TierDelta
    recompute_from: dict[RequestId, int]


def _ids(name: str, value: Any, state: TieredState) -> list[int]:
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise InvalidTypeError(f"{name} must be an iterable of move ids, got {excerpt(value)}")
    out = list(value)
    for i in out:
        if type(i) is not int:
            raise InvalidTypeError(f"{name} must hold int move ids, got {excerpt(i)}")
        if i not in state.moves:
            raise UnknownRequestError(f"move {i} is not pending")
    return out


def complete_moves(state: TieredState, *, done: Iterable[int] = (),
                   failed: Iterable[int] = ()) -> MovesResult:
    """Report pending moves done or failed (by move id).

    A done store makes its lower copy a hit; a done load lets its request go
    on.  A failed store drops its lower copy; a failed load makes the device
    forget the block and reports where its request recomputes from.  With
    ``"write-through"`` and a remote tier, a done host store starts a remote
    store.

    Raises:
        InvalidTypeError: ids that are not ints.
        UnknownRequestError: an id that is not pending (unknown, or settled).
        InvalidArgumentError: an id named twice.

    >>> from kvfunc.core import BlockHashes, FullAttention, KVState, TieredState
    >>> from kvfunc.core import allocate_tiered, free_tiered
    >>> dev = KVState.create({"f": FullAttention(num_blocks=3, block_size=4)}, 64,
    ...                      enable_prefix_caching=True)
    >>> t = TieredState.create(dev, host_blocks=4)
    >>> t = allocate_tiered(t, [("a", 0, 8)], block_hashes={"a": BlockHashes.of(range(8), 4)}
    ...                     ).state
    >>> t = allocate_tiered(free_tiered(t, "a")[0], [("b", 0, 8)]).state
    >>> list(t.moves), t.host.index.get(t.moves[0].digest)
    ([0, 1], None)
    >>> r = complete_moves(t, done=[0], failed=[1])
    >>> len(r.state.host.index), r.state.host.num_free, dict(r.state.moves)
    (1, 3, {})
    """
    check_tiered(state)
    ok, bad = _ids("done", done, state), _ids("failed", failed, state)
    seen = ok + bad
    if len(set(seen)) != len(seen):
        raise InvalidArgumentError(f"a move id is reported twice: {excerpt(seen)}")
    work = TierWork(state)
    lost = [state.moves[i] for i in bad
            if state.moves[i].direction in (HOST_TO_DEVICE, REMOTE_TO_DEVICE)]
    recompute, delta = _forget_failed(work, lost)
    for i in ok:
        move = work.settle(i, True)
        if move.direction == DEVICE_TO_HOST and state.write_policy == "write-through":
            work.store_remote(move.digest, move.dst, move.priority)
    for i in bad:
        move = work.settle(i, False)
        if move.direction == REMOTE_TO_DEVICE:
            entry = work.r_index.get(move.digest)
            if entry is not None and not entry.pins:
                work.drop_remote(move.digest)
    return MovesResult(work.freeze(), work.sink.build(delta or EMPTY_DELTA), recompute)


def _forget_failed(work: TierWork, lost: list[TierMove]
                   ) -> tuple[dict[RequestId, int], BlocksChanged | None]:
    """Where each request of a failed load recomputes from; the device forgets its blocks
    from there on (they hold nothing good until it computes again; with ``cache_loaded``
    the device caches them all)."""
    recompute: dict[RequestId, int] = {}
    if not lost:
        return recompute, None
    state, bs = work.src, work.src.block_size
    for move in lost:
        rid = move.request_id
        assert rid is not None, move
        at = get_block_ids(state.device, rid)[move.key].index(move.dst) * bs
        recompute[rid] = min(at, recompute.get(rid, at))
    forget = [b for rid, at in recompute.items()
              for table in get_block_ids(state.device, rid).values()
              for b in table[at // bs:] if b]
    work.device, delta = evict_blocks(state.device, forget)
    work.note_device(delta)
    return recompute, delta


def loads_pending(state: TieredState, request_id: RequestId) -> int:
    """Loads in flight for ``request_id`` (0 when it may compute).

    >>> from kvfunc.core import FullAttention, KVState, TieredState
    >>> dev = KVState.create({"f": FullAttention(num_blocks=3, block_size=4)}, 64,
    ...                      enable_prefix_caching=True)
    >>> loads_pending(TieredState.create(dev), "a")
    0
    """
    check_tiered(state)
    check_request_id(request_id)
    return int(state.loads.get(request_id, 0))
