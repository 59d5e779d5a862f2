"""Invariants and replay of tiered states.

:func:`check_tiered_invariants` checks the device state's invariants and the
tiers' books; :func:`replay_tiered` folds a log of
:class:`~kvfunc.core._tier_delta.TierDelta` over a tiered state through the
primitives the transitions use (:class:`~kvfunc.core._tier_work.TierWork`):
the device part through :func:`~kvfunc.replay`, then the delta's leading
priorities, the device's caching, and the other tier rows in order.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

from kvfunc.core._checks import excerpt, is_priority, is_request_id
from kvfunc.core._errors import InvalidTypeError, KVFuncError, ReplayMismatchError
from kvfunc.core._invariants import check_invariants
from kvfunc.core._ops import Evicted, Stored
from kvfunc.core._replay import replay
from kvfunc.core._tier_delta import TIER_DELTA_VERSION, TierDelta
from kvfunc.core._tier_index import TierIndex
from kvfunc.core._tier_state import (
    DEVICE_TO_HOST,
    DIRECTIONS,
    HOST_TO_DEVICE,
    HOST_TO_REMOTE,
    REMOTE_TO_DEVICE,
    TieredState,
    check_tiered,
)
from kvfunc.core._tier_work import TierWork
from kvfunc.core._transitions import get_block_ids

__all__ = ["check_tiered_invariants", "replay_tiered"]


def check_tiered_invariants(state: TieredState) -> None:
    """Assert the device's invariants and the tiers' books (a broken one is a bug).

    No hash twice in one tier (index and writes in flight), every host block
    exactly once among indexed, free and being written, pinned entries out of
    the eviction order and pinned once per move reading them, each load's
    device block held by its request, the remote directory within capacity.

    >>> from kvfunc.core import FullAttention, KVState, TieredState
    >>> dev = KVState.create({"f": FullAttention(num_blocks=4, block_size=4)}, 64,
    ...                      enable_prefix_caching=True)
    >>> check_tiered_invariants(TieredState.create(dev, host_blocks=4, remote=True))
    """
    check_tiered(state)
    check_invariants(state.device)
    moves = state.moves
    assert all(i < state.next_move_id for i in moves), "a move id from the future"
    assert all(map(is_priority, state.priorities.values())), "a priority out of range"
    assert all(is_priority(m.priority) for m in moves.values()), "a move's priority out of range"
    host_pins: Counter[bytes] = Counter()
    remote_pins: Counter[bytes] = Counter()
    writes: dict[bytes, int] = {}
    remote_writes: dict[bytes, int] = {}
    device_pending: dict[int, int] = {}
    loads: Counter[Any] = Counter()
    for i, m in moves.items():
        assert m.direction in DIRECTIONS, m
        if m.direction == DEVICE_TO_HOST:
            writes[m.digest] = m.dst
        elif m.direction == HOST_TO_REMOTE:
            remote_writes[m.digest] = i
            host_pins[m.digest] += m.pinned
        else:
            (host_pins if m.direction == HOST_TO_DEVICE else remote_pins)[m.digest] += 1
            device_pending[m.dst] = i
            loads[m.request_id] += 1
            assert m.request_id is not None, m
            held = get_block_ids(state.device, m.request_id)[m.key]
            assert m.dst in held, f"load {i} writes block {m.dst}, not held by its request"
    assert dict(state.device_pending) == device_pending, "device_pending disagrees with moves"
    assert dict(state.loads) == dict(loads), "load counts disagree with moves"
    host, remote = state.host, state.remote
    if host is not None:
        assert dict(host.pending) == writes, "host writes disagree with moves"
        _check_index(host.index, host_pins, set(writes))
        blocks = [e.block for e in host.index.entries.values()]
        blocks += list(host.free[:host.num_free]) + list(writes.values())
        assert sorted(blocks) == list(range(host.num_blocks)), "host blocks do not add up"
    else:
        assert not writes and not host_pins, "moves through a host tier the state lacks"
    if remote is not None:
        assert set(remote.pending) == set(remote_writes), "remote writes disagree with moves"
        _check_index(remote.index, remote_pins, set(remote_writes))
        assert remote.capacity is None or remote.num_blocks <= remote.capacity, "over capacity"
    else:
        assert not remote_writes and not remote_pins, "moves to a remote tier the state lacks"


def _check_index(index: TierIndex, pins: Counter[bytes], writing: set[bytes]) -> None:
    """One tier's index: pins as the moves say, the order holds exactly the unpinned entries."""
    assert not writing & set(index.entries), "a hash both indexed and being written"
    in_order = 0
    for digest, e in index.entries.items():
        assert e.pins == pins.get(digest, 0), f"pins of {digest!r}: {e.pins} != {pins[digest]}"
        assert is_priority(e.priority), f"the priority of {digest!r} is out of range"
        if not e.pins:
            assert index.order[e.priority][e.tick] == digest, f"{digest!r} not in the order"
            in_order += 1
    assert sum(len(level) for level in index.order.values()) == in_order, "stale order entries"
    for p, level in index.order.items():
        assert level and index.heads[p] == min(level.keys()), f"head of priority {p}"
    assert set(index.heads) == set(index.order), "heads of empty priorities"


def replay_tiered(state: TieredState, deltas: Iterable[TierDelta]) -> TieredState:
    """The state after ``deltas``, starting from ``state`` (deltas are a complete log).

    Raises:
        InvalidTypeError: an item that is not a :class:`TierDelta`.
        ReplayMismatchError: a delta that does not fit the state it is applied to.

    >>> from kvfunc.core import FullAttention, KVState, TieredState, allocate_tiered
    >>> dev = KVState.create({"f": FullAttention(num_blocks=4, block_size=4)}, 64,
    ...                      enable_prefix_caching=True)
    >>> t0 = TieredState.create(dev, host_blocks=4)
    >>> r = allocate_tiered(t0, [("a", 0, 5)], priorities={"a": 2})
    >>> replay_tiered(t0, [r.delta]) == r.state
    True
    """
    check_tiered(state)
    for n, d in enumerate(deltas):
        if type(d) is not TierDelta:
            raise InvalidTypeError(f"deltas[{n}] is not a TierDelta: {excerpt(d)}")
        if d.version != TIER_DELTA_VERSION:
            raise ReplayMismatchError(f"deltas[{n}] has version {excerpt(d.version)}")
        work = TierWork(state)
        work.device = replay(state.device, [d.device])
        try:
            rows = list(d.rows())
            k = 0
            while k < len(rows) and rows[k][0] == "P":
                _apply(work, "P", rows[k][1], set())
                k += 1
            work.note_device(d.device)
            cached = _cached_by(work, d) if "device->host" in d.moved_directions else set()
            for code, row in rows[k:]:
                _apply(work, code, row, cached)
        except ReplayMismatchError:
            raise
        except (KeyError, IndexError, ValueError, TypeError, AssertionError, KVFuncError) as exc:
            raise ReplayMismatchError(f"deltas[{n}] does not fit the state: "
                                      f"{type(exc).__name__}: {excerpt(str(exc))}") from exc
        state = work.freeze()
    return state


def _cached_by(work: TierWork, delta: TierDelta) -> set[tuple[bytes, int]]:
    """``(tier key, device block)`` of the blocks the delta's device part cached or evicted:
    the only blocks its stores to the host may read."""
    out = set()
    for op in delta.device.operations():
        if type(op) is Stored or type(op) is Evicted:
            out.add((work.tier_key(op.key, op.block_hash), op.block_id))
    return out


def _apply(work: TierWork, code: str, row: tuple[Any, ...],
           cached: set[tuple[bytes, int]]) -> None:
    """One tier row of a log, through the transitions' primitive (checked where it matters).

    ``cached``: what :func:`_cached_by` gives the row's delta."""
    if code == "P":
        if not is_request_id(row[0]) or not is_priority(row[1]):
            raise ReplayMismatchError(f"a priority row of a wrong type or range: {excerpt(row)}")
        work.prioritize(*row)
    elif code == "G":
        work.forget(*row)
    elif code == "M":
        move_id, direction, digest, src, dst, rid, priority, key = row
        if move_id != work.next_move_id or direction not in DIRECTIONS:
            raise ReplayMismatchError(f"move {excerpt(move_id)} ({excerpt(direction)}) is not the "
                                      "next move")
        if (type(digest) is not bytes or not digest or type(src) is not int
                or type(dst) is not int or not is_priority(priority)
                or (rid is not None and not is_request_id(rid))
                or type(key) is not str or key not in work.src.keys
                or not work.src.split_key(digest)[1]
                or work.src.tier_key(key, work.src.split_key(digest)[1]) != digest):
            raise ReplayMismatchError(f"move {excerpt(move_id)} has a cell of a wrong type: "
                                      f"{excerpt(row)}")
        if direction == DEVICE_TO_HOST and (
                (digest, src) not in cached or (work.has_host and digest in work.h_index.entries)):
            msg = (f"move {excerpt(move_id)} stores a block its delta neither cached nor "
                   f"evicted, or one the host holds: {excerpt(row)}")
            raise ReplayMismatchError(msg)
        if direction in (HOST_TO_DEVICE, REMOTE_TO_DEVICE) and (
                work.device_pending.get(dst) is not None or rid is None
                or dst not in get_block_ids(work.device, rid)[key]):
            msg = f"device block {excerpt(dst)} is loaded twice, or not for its request"
            raise ReplayMismatchError(msg)
        work.start(direction, digest, src, dst, rid, priority)
    elif code == "K":
        move_id, outcome = row
        if move_id not in work.moves or outcome not in ("done", "failed"):
            msg = f"move {excerpt(move_id)} is not pending ({excerpt(outcome)})"
            raise ReplayMismatchError(msg)
        work.settle(move_id, outcome == "done")
    elif code == "V":
        block, digest = row
        entry = work.h_index.get(digest) if work.has_host else None
        if entry is None or entry.block != block or entry.pins:
            msg = f"host block {excerpt(block)} does not hold {excerpt(digest)}"
            raise ReplayMismatchError(msg)
        work.evict_host(digest)
    else:
        (digest,) = row
        entry = work.r_index.get(digest) if work.has_remote else None
        if entry is None or entry.pins:
            raise ReplayMismatchError(f"the remote directory cannot drop {excerpt(digest)}")
        work.drop_remote(digest)
