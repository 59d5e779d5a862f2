"""KV events of tiered transitions: the device's events, then the lower tiers', by medium.

A lower tier announces a block when its store is *done* (a pending or failed
store was never a hit) and withdraws it when it evicts or drops it::

    device delta                        -> events_from_delta, medium "GPU"
    K done of a device->host store      -> BlockStored(medium "CPU", block_ids=(host block,))
    K done of a host->remote store      -> BlockStored(medium "REMOTE", block_ids=None)
    V host_evicted                      -> BlockRemoved(medium "CPU", block_ids=(host block,))
    W remote_dropped                    -> BlockRemoved(medium "REMOTE")

Lower-tier ``BlockStored`` events carry no token ids and no parent hash (the
tiers keep neither), as vLLM's offloading events do.  Each names the block's
hash and its group (a tier keeps a device of several groups' blocks under
tier keys; :meth:`~kvfunc.TieredState.split_key` reads them back).
"""

from __future__ import annotations

from typing import Any

from kvfunc.core import (
    TIER_MEDIUMS,
    InvalidTypeError,
    TierDelta,
    TieredState,
)
from kvfunc.events._events import (
    MEDIUM_GPU,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    events_from_delta,
)

__all__ = ["MEDIUM_CPU", "MEDIUM_REMOTE", "events_from_tier_delta"]

MEDIUM_CPU: str = TIER_MEDIUMS["host"]
"""The ``medium`` of events about host blocks (vLLM's value)."""
MEDIUM_REMOTE: str = TIER_MEDIUMS["remote"]
"""The ``medium`` of events about the remote tier (a kvfunc value)."""


def events_from_tier_delta(delta: TierDelta, before: TieredState) -> tuple[KVCacheEvent, ...]:
    """The KV events of one tiered transition, every tier's, with its medium.

    Args:
        delta: the transition's :class:`~kvfunc.TierDelta`.
        before: the state the transition started from (it names the moves
            that the delta reports done).

    Raises:
        InvalidTypeError: ``delta`` or ``before`` of a wrong type.

    >>> import kvfunc as kf
    >>> dev = kf.KVState.create({"f": kf.FullAttention(num_blocks=3, block_size=4)}, 64,
    ...                         enable_prefix_caching=True)
    >>> t = kf.TieredState.create(dev, host_blocks=4)
    >>> h = kf.BlockHashes.of(range(8), 4)
    >>> t = kf.allocate_tiered(t, [("a", 0, 8)], block_hashes={"a": h}).state
    >>> t = kf.allocate_tiered(kf.free_tiered(t, "a")[0], [("b", 0, 8)]).state
    >>> r = kf.complete_moves(t, done=[0, 1])
    >>> [(e.medium, e.block_ids) for e in events_from_tier_delta(r.delta, t)]
    [('CPU', (0,)), ('CPU', (1,))]
    """
    if type(delta) is not TierDelta:
        raise InvalidTypeError(f"delta must be a TierDelta, got {type(delta).__name__}")
    if type(before) is not TieredState:
        raise InvalidTypeError(f"before must be a TieredState, got {type(before).__name__}")
    events = list(events_from_delta(delta.device, before.device, medium=MEDIUM_GPU))
    split, bs = before.split_key, before.block_size
    started: dict[int, Any] = {m[0]: (m[1], m[2], m[4]) for m in delta.moves()}
    for code, row in delta.rows():
        if code == "K" and row[1] == "done":
            move = before.moves.get(row[0])
            direction, digest, dst = ((move.direction, move.digest, move.dst)
                                      if move is not None else started[row[0]])
            key, h = split(digest)
            if direction == "device->host":
                events.append(BlockStored((h,), None, (), bs, None, MEDIUM_CPU, key, (dst,)))
            elif direction == "host->remote":
                events.append(BlockStored((h,), None, (), bs, None, MEDIUM_REMOTE, key))
        elif code == "V":
            key, h = split(row[1])
            events.append(BlockRemoved((h,), MEDIUM_CPU, key, (row[0],)))
        elif code == "W":
            key, h = split(row[0])
            events.append(BlockRemoved((h,), MEDIUM_REMOTE, key))
    return tuple(events)
