"""The Mooncake engine's side of the transport: the engine, its staging arena, its reads.

Used by :mod:`._mooncake`, which turns them into a transfer's two halves.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from kvfunc.datadist._errors import FeatureNotEnabledError, LinkFailedError, TransferTimeoutError
from kvfunc.datadist._ranges import RangeState, allocate_range, release_range
from kvfunc.datadist._slices import Slice
from kvfunc.shell import empty_aligned

__all__ = ["POLL_S", "STAGING_BYTES", "MooncakeEngine", "Read", "Staging"]

_BATCH = 256  # slices per engine batch: its TCP lanes queue a bounded number
POLL_S = 1e-4  # how often a single-slice read is looked at
STAGING_BYTES = 256 << 20  # each engine's staging arena (taken on first use)
_STAGING_PAGE = 1 << 16


class Staging:
    """An engine's staging arena: ``size`` registered bytes, made on first use and carved
    by the pure range allocator; a region that does not fit is refused (None)."""

    def __init__(self, engine: Any, size: int = STAGING_BYTES) -> None:
        self.engine, self.size = engine, size
        self.arena: torch.Tensor | None = None
        self.ranges = RangeState.create(size, _STAGING_PAGE)
        self.lock = threading.Lock()
        self.staged_bytes = 0  # bytes copied into or out of staging regions so far

    def take(self, nbytes: int) -> tuple[int, torch.Tensor] | None:
        """A region of ``nbytes`` (its offset and a uint8 view), or None if full."""
        with self.lock:
            if self.engine is None:
                raise LinkFailedError("the Mooncake engine is closed")
            if self.arena is None:
                self.arena = empty_aligned((self.size,), torch.uint8, torch.device("cpu"),
                                           _STAGING_PAGE)
                if self.engine.register_memory(self.arena.data_ptr(), self.size) != 0:
                    raise LinkFailedError(f"Mooncake could not register {self.size} bytes")
            got = allocate_range(self.ranges, nbytes)
            if got is None:
                return None
            self.ranges, offset = got
            self.staged_bytes += nbytes
            return offset, self.arena[offset:offset + nbytes]

    def give(self, region: tuple[int, torch.Tensor]) -> None:
        """Return a region :meth:`take` gave."""
        with self.lock:
            self.ranges = release_range(self.ranges, region[0], region[1].numel())

    def close(self) -> None:
        """Unregister the arena and let the engine go."""
        with self.lock:
            if self.arena is not None and self.engine is not None:
                self.engine.unregister_memory(self.arena.data_ptr())
            self.arena, self.engine = None, None


class MooncakeEngine:
    """A Mooncake ``TransferEngine`` on ``host`` with ``buffers`` registered."""

    def __init__(self, host: str, buffers: Sequence[torch.Tensor]) -> None:
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:
            raise FeatureNotEnabledError(
                f"the mooncake transport needs mooncake-transfer-engine-non-cuda (the "
                f"kvfunc[mooncake] extra) and libibverbs1: {exc}") from None
        self.lock = threading.Lock()
        self.engine = TransferEngine()
        if self.engine.initialize(host, "P2PHANDSHAKE", "tcp", "") != 0:
            raise LinkFailedError(f"the Mooncake engine could not start on {host}")
        self.session = f"{host}:{self.engine.get_rpc_port()}"
        self.buffers = [b for b in buffers if b.numel()]
        for buf in self.buffers:
            self.register(buf)
        self.staging = Staging(self.engine)

    def register(self, tensor: torch.Tensor) -> None:
        """Make ``tensor``'s bytes readable and writable by the engine."""
        nbytes = tensor.numel() * tensor.element_size()
        if self.engine.register_memory(tensor.data_ptr(), nbytes) != 0:
            raise LinkFailedError(f"Mooncake could not register {nbytes} bytes")

    def close(self) -> None:
        """Unregister the pools and the staging arena, and destroy the engine now.

        Destroying an engine that has talked to a peer takes Mooncake 0.5-1 s, during
        which it holds Python's GIL: every Python thread of the process stops.  Left to
        the garbage collector, that pause would fall on whatever runs next, in the
        middle of a timed transfer; here it falls in :meth:`close`.  A read still in
        flight keeps its own reference until it settles, so the engine dies when the
        last such read returns.
        """
        with self.lock:  # one closer unregisters; a second finds nothing left
            engine, self.engine = self.engine, None
            buffers, self.buffers = self.buffers, []
        if engine is None:
            return
        for buf in buffers:
            engine.unregister_memory(buf.data_ptr())
        self.staging.close()


class Read:
    """Slices the engine is reading: one slice is polled, several are read by a thread in
    batches.  :meth:`settled` says whether it returned; ``status`` 0 is success."""

    def __init__(self, engine: Any, session: str, slices: list[Slice]) -> None:
        if engine is None:
            raise LinkFailedError("the Mooncake engine is closed")
        self.engine, self.status = engine, None
        self.batch: int | None = None
        self.done: threading.Event | None = None
        if len(slices) == 1:
            (local, remote, length), = slices
            batch = engine.batch_transfer_async_read(session, [local], [remote], [length])
            if 0 < batch < (1 << 63):
                self.batch = batch
            else:
                self.status, self.engine = -1, None
            return
        self.done = threading.Event()
        threading.Thread(target=self._read_all, args=(session, slices), daemon=True,
                         name="kvfunc-mooncake-read").start()

    def _read_all(self, session: str, slices: list[Slice]) -> None:
        status = -1
        if sys.platform == "linux":  # a thread's id names it to setpriority on Linux only
            with contextlib.suppress(OSError):  # the engine's synchronous read busy-waits: at
                # the lowest priority that wait takes no CPU from the transfer or anything else
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        try:
            for k in range(0, len(slices), _BATCH):
                local, remote, lengths = zip(*slices[k:k + _BATCH], strict=True)
                status = self.engine.batch_transfer_sync_read(session, list(local),
                                                              list(remote), list(lengths))
                if status:
                    break
        finally:
            self.status, self.engine = status, None  # the engine may die with this read
            assert self.done is not None
            self.done.set()

    def settled(self) -> bool:
        """Whether the read returned (it writes nothing any more)."""
        engine = self.engine  # one thread looks at a time (the waiter, then abandon's)
        if self.status is None and self.batch is not None and engine is not None:
            status = engine.transfer_check_status(self.batch)  # 1 done, -1 failed
            if status in (1, -1):  # the engine freed the batch: never look at it again
                self.status, self.batch = (0 if status == 1 else -1), None
                self.engine = None  # a closed engine may die now, not with this object
        return self.status is not None

    def wait(self, deadline: float, what: str) -> None:
        """Return once the read succeeded; raise :class:`TransferTimeoutError` if it
        failed or is still running at ``deadline``."""
        while not self.settled():
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransferTimeoutError(f"{what} did not finish in time")
            if self.done is not None:
                self.done.wait(min(left, 0.25))
            else:
                time.sleep(POLL_S)
        if self.status:
            raise TransferTimeoutError(f"{what} failed (status {self.status})")
