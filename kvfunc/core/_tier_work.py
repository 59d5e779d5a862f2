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

from kvfunc.core._checks import excerpt
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
from kvfunc.core._untracked import atomic

__all__ = ["TierWork"]


class TierWork:
    """A tiered state's fields being changed by one transition (see the module docstring).

    The tiers' parts are kept apart (``h_*`` for the host tier, ``r_*`` for the
    remote one) so that a primitive replaces one value, not a tier record;
    :attr:`host` and :attr:`remote` build the records on access.
    """

    def __init__(self, state: TieredState) -> None:
        self.src = state
        self.device = state.device
        host, remote = state.host, state.remote
        self.has_host = host is not None
        if host is not None:
            self.h_index, self.h_free, self.h_num_free = host.index, host.free, host.num_free
            self.h_pending = host.pending
        self.has_remote = remote is not None
        if remote is not None:
            self.r_index, self.r_pending = remote.index, remote.pending
        self.moves = state.moves
        self.next_move_id = state.next_move_id
        self.priorities = state.priorities
        self.block_priorities = state.block_priorities
        self.device_pending = state.device_pending
        self.loads = state.loads
        self.sink = TierDeltaBuilder()
        self.tier_key = state.tier_key

    @property
    def host(self) -> HostTier | None:
        """The host tier as it stands."""
        src = self.src.host
        if src is None:
            return None
        free = self.h_free if self.h_free is src.free else atomic(self.h_free)  # once, here
        return HostTier(src.num_blocks, self.h_index, free, self.h_num_free, self.h_pending)

    @property
    def remote(self) -> RemoteTier | None:
        """The remote tier as it stands."""
        src = self.src.remote
        return None if src is None else RemoteTier(src.capacity, self.r_index, self.r_pending)

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
        key = self.src.split_key(digest)[0]
        self.sink.add("M", move_id, direction, digest, src, dst, request_id, priority, key)
        pinned = True
        if direction == DEVICE_TO_HOST:
            self._need(self.has_host)
            n = self.h_num_free
            if not n or self.h_free[n - 1] != dst or digest in self.h_pending:
                raise ReplayMismatchError(f"host block {excerpt(dst)} is not the next free block")
            self.h_num_free = n - 1
            self.h_pending = self.h_pending.set(digest, dst)
        elif direction == HOST_TO_REMOTE:
            self._need(self.has_remote)
            entry = self.h_index.get(digest) if self.has_host else None
            pinned = entry is not None and entry.block == src
            if pinned:
                self.h_index = self.h_index.pin(digest)
            self.r_pending = self.r_pending.set(digest, move_id)
        else:
            if direction == HOST_TO_DEVICE:
                self._need(self.has_host)
                self.h_index = self.h_index.pin(digest)
            else:
                self._need(self.has_remote)
                self.r_index = self.r_index.pin(digest)
            self.device_pending = self.device_pending.set(dst, move_id)
            self.loads = self.loads.set(request_id, self.loads.get(request_id, 0) + 1)
        self.moves = self.moves.set(move_id, TierMove(direction, digest, src, dst, request_id,
                                                      priority, pinned, key))
        self.next_move_id = move_id + 1
        return move_id

    def settle(self, move_id: int, ok: bool) -> TierMove:
        """A pending move is reported done (``ok``) or failed; returns it."""
        self.sink.add("K", move_id, "done" if ok else "failed")
        move = self.moves[move_id]
        self.moves = self.moves.delete(move_id)
        direction, digest = move.direction, move.digest
        if direction == DEVICE_TO_HOST:
            self.h_pending = self.h_pending.delete(digest)
            if ok:
                self.h_index = self.h_index.add(digest, move.dst, move.priority)
            else:
                self._give(move.dst)
        elif direction == HOST_TO_REMOTE:
            if ok:
                self.r_index = self.r_index.add(digest, -1, move.priority)
            self.r_pending = self.r_pending.delete(digest)
            if move.pinned:
                self.h_index = self.h_index.unpin(digest)
        else:
            if direction == HOST_TO_DEVICE:
                self.h_index = self.h_index.unpin(digest)
            else:
                self.r_index = self.r_index.unpin(digest)
            self.device_pending = self.device_pending.delete(move.dst)
            left = self.loads[move.request_id] - 1
            self.loads = (self.loads.set(move.request_id, left) if left
                          else self.loads.delete(move.request_id))
        return move

    def evict_host(self, digest: bytes) -> int:
        """The host tier forgets ``digest``; its block is free again.  Returns the block."""
        self._need(self.has_host)
        block: int = self.h_index.entries[digest].block
        self.sink.add("V", block, digest)
        self.h_index = self.h_index.remove(digest)
        self._give(block)
        return block

    def drop_remote(self, digest: bytes) -> None:
        """The remote directory forgets ``digest``."""
        self.sink.add("W", digest)
        self._need(self.has_remote)
        self.r_index = self.r_index.remove(digest)

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

    def _give(self, block: int) -> None:
        """Host block ``block`` is free again (on top of the stack)."""
        n, free = self.h_num_free, self.h_free
        self.h_free = free.set(n, block) if n < len(free) else free.append(block)
        self.h_num_free = n + 1

    @staticmethod
    def _need(has: bool) -> None:
        if not has:
            raise ReplayMismatchError("a tier operation names a tier the state does not have")

    # -- decisions (live transitions only) -----------------------------------------------------
    def store_host(self, digest: bytes, src: int, priority: int) -> None:
        """Copy device block ``src`` down to the host tier, unless it is there or cannot be.

        ``digest`` is the block's tier key.
        """
        if not self.has_host or digest in self.h_pending or digest in self.h_index.entries:
            return
        if not self.h_num_free:
            victim = self.h_index.victim()
            if victim is None:
                return  # every host block is pinned or being written
            entry = self.h_index.entries[victim]
            block = self.evict_host(victim)
            if self.src.write_policy == "write-back":
                self.store_remote(victim, block, entry.priority)
        self.start(DEVICE_TO_HOST, digest, src, self.h_free[self.h_num_free - 1], None,
                   priority)

    def store_remote(self, digest: bytes, src: int, priority: int) -> None:
        """Copy host block ``src`` to the remote tier, unless it is there or cannot be."""
        if not self.has_remote or digest in self.r_pending or digest in self.r_index.entries:
            return
        capacity = self.src.remote.capacity  # type: ignore[union-attr]
        if capacity is not None and len(self.r_index) + len(self.r_pending) >= capacity:
            victim = self.r_index.victim()
            if victim is None:
                return
            self.drop_remote(victim)
        self.start(HOST_TO_REMOTE, digest, src, -1, None, priority)
