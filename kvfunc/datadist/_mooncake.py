"""The Mooncake transfer engine as a transport (optional: ``kvfunc[mooncake]``).

One engine per cluster, started with peer-to-peer handshakes (no metadata
server) over TCP, with the cluster's pools registered once.  A transfer is
a one-sided **read by the receiver**: the sender's descriptor names the
addresses of its tensors and its rows, and the receiver reads them
straight into its own destination rows (its pool is registered), one
``(local, remote, length)`` triple per run of rows contiguous on both
sides, every tensor of a layer in one batch: no staging, no copy of ours.

The engine's read cannot be cancelled.  A receiver that gives up (its
deadline) keeps the destination cache pinned until the read returns, so
the cache's memory never goes to another cache while data may land in it;
the blocks themselves belong to the engine's allocator, which must not
reuse a timed-out transfer's blocks before the link is torn down
(``docs/datadist.md``).  The engine trusts its peers: a registered pool
can be read and written by any peer the engine talks to.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvfunc.datadist._backends import Endpoint, Incoming, Outgoing
from kvfunc.datadist._errors import (
    FeatureNotEnabledError,
    InvalidParamError,
    LinkFailedError,
    TransferTimeoutError,
)
from kvfunc.datadist._protocol import get_int, get_ints

__all__ = ["MooncakeEndpoint", "MooncakeEngine"]

_ADDRESS_LIMIT = 1 << 62
_BATCH = 256  # triples per engine batch: its TCP lanes queue a bounded number of slices


class MooncakeEngine:
    """A Mooncake ``TransferEngine`` on ``host`` with ``buffers`` registered."""

    def __init__(self, host: str, buffers: Sequence[torch.Tensor]) -> None:
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:
            raise FeatureNotEnabledError(
                f"the mooncake transport needs mooncake-transfer-engine-non-cuda (the "
                f"kvfunc[mooncake] extra) and libibverbs1: {exc}") from None
        self.engine = TransferEngine()
        if self.engine.initialize(host, "P2PHANDSHAKE", "tcp", "") != 0:
            raise LinkFailedError(f"the Mooncake engine could not start on {host}")
        self.session = f"{host}:{self.engine.get_rpc_port()}"
        self.buffers = [b for b in buffers if b.numel()]
        for buf in self.buffers:
            self.register(buf)

    def register(self, tensor: torch.Tensor) -> None:
        """Make ``tensor``'s bytes readable and writable by the engine."""
        nbytes = tensor.numel() * tensor.element_size()
        if self.engine.register_memory(tensor.data_ptr(), nbytes) != 0:
            raise LinkFailedError(f"Mooncake could not register {nbytes} bytes")

    def unregister(self, tensor: torch.Tensor) -> None:
        """Undo :meth:`register`."""
        self.engine.unregister_memory(tensor.data_ptr())

    def close(self) -> None:
        """Unregister the pools."""
        for buf in self.buffers:
            self.unregister(buf)
        self.buffers = []


class _Outgoing(Outgoing):
    def __init__(self, tensors: Sequence[torch.Tensor], rows: Sequence[int]) -> None:
        first = tensors[0]
        self.descriptor = {"addrs": [t.data_ptr() for t in tensors], "rows": list(rows),
                           "row_bytes": first[0].numel() * first.element_size()}

    def send(self, indices: Sequence[int]) -> None:
        """Nothing to do: the receiver reads the rows where they are."""

    def wait(self, timeout_s: float) -> None:
        """Nothing to do: the receiver's acknowledgement says when it has read."""


class _Incoming(Incoming):
    """Reads the sender's rows straight into the destination rows (the pool is registered
    with the engine): one ``(local, remote, length)`` triple per run of rows contiguous on
    both sides, all tensors in one batch."""

    def __init__(self, engine: MooncakeEngine, session: str, tensors: Sequence[torch.Tensor],
                 rows: Sequence[int], descriptor: dict[str, Any]) -> None:
        self.engine, self.session = engine, session
        self.tensors, self.rows = list(tensors), list(rows)
        first = self.tensors[0]
        row_bytes = first[0].numel() * first.element_size()
        if get_int(descriptor, "row_bytes") != row_bytes:
            raise InvalidParamError(f"the sender's rows are {descriptor['row_bytes']} bytes, "
                                    f"here {row_bytes}")
        self.addrs = get_ints(descriptor, "addrs", _ADDRESS_LIMIT, len(self.tensors))
        self.src_rows = get_ints(descriptor, "rows", _ADDRESS_LIMIT // max(row_bytes, 1),
                                 len(self.rows))
        if len(self.addrs) != len(self.tensors) or len(self.src_rows) != len(self.rows):
            raise InvalidParamError("the sender's descriptor does not match this transfer")
        self.row_bytes = row_bytes
        self.lock = threading.Lock()
        self.pending = 0  # reads in flight (they write the destination rows)
        self.settled: list[Callable[[], None]] = []

    def _runs(self, i: int) -> tuple[list[int], list[int], list[int]]:
        local, remote, lengths = [], [], []
        dst, rb = self.tensors[i].data_ptr(), self.row_bytes
        j = 0
        while j < len(self.rows):
            k = j + 1
            while k < len(self.rows) and self.rows[k] == self.rows[k - 1] + 1 and \
                    self.src_rows[k] == self.src_rows[k - 1] + 1:
                k += 1
            local.append(dst + self.rows[j] * rb)
            remote.append(self.addrs[i] + self.src_rows[j] * rb)
            lengths.append((k - j) * rb)
            j = k
        return local, remote, lengths

    def receive(self, indices: Sequence[int], timeout_s: float) -> None:
        local: list[int] = []
        remote: list[int] = []
        lengths: list[int] = []
        for i in indices:
            a, b, c = self._runs(i)
            local += a
            remote += b
            lengths += c
        result: list[int] = []
        done = threading.Event()

        def read() -> None:
            try:
                for k in range(0, len(local), _BATCH):  # the engine queues a bounded number
                    status = self.engine.engine.batch_transfer_sync_read(
                        self.session, local[k:k + _BATCH], remote[k:k + _BATCH],
                        lengths[k:k + _BATCH])
                    if status:
                        result.append(status)
                        return
                result.append(0)
            finally:
                done.set()
                self._finish()

        with self.lock:
            self.pending += 1
        threading.Thread(target=read, daemon=True, name="kvfunc-mooncake-read").start()
        if not done.wait(timeout_s):
            raise TransferTimeoutError(f"reading from {self.session} took over {timeout_s} s")
        if result != [0]:
            raise TransferTimeoutError(f"reading from {self.session} failed (status {result})")

    def _finish(self) -> None:
        with self.lock:
            self.pending -= 1
            actions = self.settled if not self.pending else []
            self.settled = [] if not self.pending else self.settled
        for action in actions:
            action()

    def abandon(self, on_settled: Callable[[], None]) -> None:
        """A read in flight cannot be cancelled: ``on_settled`` runs when it returns."""
        with self.lock:
            if self.pending:
                self.settled.append(on_settled)
                return
        on_settled()


class MooncakeEndpoint(Endpoint):
    """A link whose transfers are Mooncake reads from the peer's session."""

    def __init__(self, engine: MooncakeEngine, peer_session: str) -> None:
        self.engine, self.peer_session = engine, peer_session

    def outgoing(self, tensors: Sequence[torch.Tensor], rows: Sequence[int], tag: int,
                 layers: Sequence[Sequence[int]]) -> Outgoing:
        return _Outgoing(tensors, rows)

    def incoming(self, tensors: Sequence[torch.Tensor], rows: Sequence[int], tag: int,
                 layers: Sequence[Sequence[int]], descriptor: dict[str, Any] | None
                 ) -> Incoming:
        if descriptor is None:
            raise InvalidParamError("a Mooncake read needs the sender's descriptor")
        return _Incoming(self.engine, self.peer_session, tensors, rows, descriptor)

    def close(self) -> None:
        """Nothing to tear down per link: the engine belongs to the cluster."""
