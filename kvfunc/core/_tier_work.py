"""A working copy of a tiered state: the primitives every tiered transition and replay share.

Each primitive applies one tier operation and records its row, so a
transition's delta lists exactly what it did, and replay, which calls the
same primitives on a delta's rows, makes the same state.  The decisions
(which host block to evict, whether a store is worth starting) live in
:class:`TierWork` methods that call the primitives; replay does not make
them again, it checks that each row fits.
"""

from __future__ import annotations

from typing import Any

from kvfunc.core._delta import BlocksChanged
from kvfunc.core._errors import ReplayMismatchError
from kvfunc.core._ops import Evicted, Stored
from kvfunc.core._tier_delta import TierDeltaBuilder
from kvfunc.core._tier_state import (
    DEVICE_TO_HOST,
    HOST_TO_DEVICE,
    HOST_TO_REMOTE,
    HostTier,
    RemoteTier,
    TieredState,
    TierMove,
)

__all__ = ["TierWork"]


class TierWork:
    """A tiered state's fields being changed by one transition (see the module docstring)."""

    def __init__(self, state: TieredState) -> None:
        self.src = state
        self.device = state.device
        self.host = state.host
        self.remote = state.remote
        self.moves = state.moves
        self.next_move_id = state.next_move_id
        self.priorities = state.priorities
        self.block_priorities = state.block_priorities
        self.device_pending = state.device_pending
        self.loads = state.loads
        self.sink = TierDeltaBuilder()

    def freeze(self) -> TieredState:
        """The new state."""
        return TieredState(self.device, self.src.write_policy, self.host, self.remote,
                           self.moves, self.next_move_id, self.priorities,
                           self.block_priorities, self.device_pending, self.loads)

    # -- primitives: one row each -------------------------------------------------------------
    def prioritize(self, request_id: Any, priority: int) -> None:
        """Request ``request_id`` keeps its cached blocks at ``priority``."""
        self.sink.add("P", request_id, priority)
        self.priorities = self.priorities.set(request_id, priority)

    def forget(self, request_id: Any) -> None:
        """Request ``request_id`` has gone: drop its priority."""
        self.sink.add("G", request_id)
        if request_id in self.priorities:
            self.priorities = self.priorities.delete(request_id)

    def start(self, direction: str, digest: bytes, src: int, dst: int, request_id: Any,
              priority: int) -> int:
        """A move starts: reserve its destination, pin its source; returns its id."""
        move_id = self.next_move_id
        self.sink.add("M", move_id, direction, digest, src, dst, request_id, priority)
        pinned = True
        if direction == DEVICE_TO_HOST:
            self.host = _take(_need(self.host), digest, dst)
        elif direction == HOST_TO_REMOTE:
            remote = _need(self.remote)
            entry = None if self.host is None else self.host.index.get(digest)
            pinned = entry is not None and entry.block == src
            if pinned:
                self._pin_host(digest, 1)
            self.remote = RemoteTier(remote.capacity, remote.index,
                                     remote.pending.set(digest, move_id))
        else:
            if direction == HOST_TO_DEVICE:
                self._pin_host(digest, 1)
            else:
                remote = _need(self.remote)
                self.remote = RemoteTier(remote.capacity, remote.index.pin(digest),
                                         remote.pending)
            self.device_pending = self.device_pending.set(dst, move_id)
            self.loads = self.loads.set(request_id, self.loads.get(request_id, 0) + 1)
        self.moves = self.moves.set(move_id, TierMove(direction, digest, src, dst, request_id,
                                                  priority, pinned))
        self.next_move_id = move_id + 1
        return move_id

    def settle(self, move_id: int, ok: bool) -> TierMove:
        """A pending move is reported done (``ok``) or failed; returns it."""
        self.sink.add("K", move_id, "done" if ok else "failed")
        move = self.moves[move_id]
        self.moves = self.moves.delete(move_id)
        direction, digest = move.direction, move.digest
        if direction == DEVICE_TO_HOST:
            host = _need(self.host)
            pending = host.pending.delete(digest)
            if ok:
                self.host = HostTier(host.num_blocks, host.index.add(digest, move.dst,
                                                                     move.priority),
                                     host.free, host.num_free, pending)
            else:
                self.host = _give(HostTier(host.num_blocks, host.index, host.free,
                                           host.num_free, pending), move.dst)
        elif direction == HOST_TO_REMOTE:
            remote = _need(self.remote)
            index = remote.index.add(digest, -1, move.priority) if ok else remote.index
            self.remote = RemoteTier(remote.capacity, index, remote.pending.delete(digest))
            if move.pinned:
                self._pin_host(digest, -1)
        else:
            if direction == HOST_TO_DEVICE:
                self._pin_host(digest, -1)
            else:
                remote = _need(self.remote)
                self.remote = RemoteTier(remote.capacity, remote.index.unpin(digest),
                                         remote.pending)
            self.device_pending = self.device_pending.delete(move.dst)
            left = self.loads[move.request_id] - 1
            self.loads = (self.loads.set(move.request_id, left) if left
                          else self.loads.delete(move.request_id))
        return move

    def evict_host(self, digest: bytes) -> int:
        """The host tier forgets ``digest``; its block is free again.  Returns the block."""
        host = _need(self.host)
        block: int = host.index.entries[digest].block
        self.sink.add("V", block, digest)
        self.host = _give(HostTier(host.num_blocks, host.index.remove(digest), host.free,
                                   host.num_free, host.pending), block)
        return block

    def drop_remote(self, digest: bytes) -> None:
        """The remote directory forgets ``digest``."""
        self.sink.add("W", digest)
        remote = _need(self.remote)
        self.remote = RemoteTier(remote.capacity, remote.index.remove(digest), remote.pending)

    def note_device(self, delta: BlocksChanged) -> dict[int, int]:
        """Follow the device's caching: priorities of stored blocks, forgotten on eviction.

        Returns the priorities the delta's evicted blocks had.
        """
        evicted: dict[int, int] = {}
        bp, prio = self.block_priorities, self.priorities
        if not delta.stored_block_ids and not delta.evicted_block_ids:
            return evicted
        for op in delta.operations():
            if type(op) is Stored:
                p = prio.get(op.request_id, 0)
                if p:
                    bp = bp.set(op.block_id, p)
                elif op.block_id in bp:
                    bp = bp.delete(op.block_id)
            elif type(op) is Evicted:
                evicted[op.block_id] = bp.get(op.block_id, 0)
                if op.block_id in bp:
                    bp = bp.delete(op.block_id)
        self.block_priorities = bp
        return evicted

    def _pin_host(self, digest: bytes, by: int) -> None:
        host = _need(self.host)
        index = host.index.pin(digest) if by > 0 else host.index.unpin(digest)
        self.host = HostTier(host.num_blocks, index, host.free, host.num_free, host.pending)

    # -- decisions (live transitions only) -----------------------------------------------------
    def store_host(self, digest: bytes, src: int, priority: int) -> None:
        """Copy device block ``src`` down to the host tier, unless it is there or cannot be."""
        host = self.host
        if host is None or digest in host.pending or host.index.get(digest) is not None:
            return
        if not host.num_free:
            victim = host.index.victim()
            if victim is None:
                return  # every host block is pinned or being written
            entry = host.index.entries[victim]
            block = self.evict_host(victim)
            if self.src.write_policy == "write-back":
                self.store_remote(victim, block, entry.priority)
        host = self.host
        assert host is not None
        self.start(DEVICE_TO_HOST, digest, src, host.free[host.num_free - 1], None, priority)

    def store_remote(self, digest: bytes, src: int, priority: int) -> None:
        """Copy host block ``src`` to the remote tier, unless it is there or cannot be."""
        remote = self.remote
        if remote is None or digest in remote.pending or remote.index.get(digest) is not None:
            return
        if remote.capacity is not None and remote.num_blocks >= remote.capacity:
            victim = remote.index.victim()
            if victim is None:
                return
            self.drop_remote(victim)
        self.start(HOST_TO_REMOTE, digest, src, -1, None, priority)


def _need(tier: Any) -> Any:
    if tier is None:
        raise ReplayMismatchError("a tier operation names a tier the state does not have")
    return tier


def _take(host: HostTier, digest: bytes, block: int) -> HostTier:
    """The host tier with free block ``block`` (the top of the stack) being written."""
    if not host.num_free or host.free[host.num_free - 1] != block or digest in host.pending:
        raise ReplayMismatchError(f"host block {block} is not the next free block")
    return HostTier(host.num_blocks, host.index, host.free, host.num_free - 1,
                    host.pending.set(digest, block))


def _give(host: HostTier, block: int) -> HostTier:
    """The host tier with ``block`` free again (on top of the stack)."""
    n = host.num_free
    free = host.free.set(n, block) if n < len(host.free) else host.free.append(block)
    return HostTier(host.num_blocks, host.index, free, n + 1, host.pending)

