"""The ``tcp`` transport: a link's data over its own framed connection, no copy of ours.

A transfer sends one data frame per layer (a pull is one layer of every
tensor).  A frame's body is the rows of its tensors, tensor after tensor,
each tensor's rows in the transfer's order.  Both sides cut their rows into
runs of consecutive rows and hand the runs to the kernel as they lie:

* the sender passes views of its source runs to ``sendmsg`` (gather I/O),
  so nothing is gathered into a message first;
* the receiver posts views of its destination runs before the data can
  come (:meth:`~kvfunc.datadist._wire.Connection.expect`), and the link's
  reader fills them with ``recvmsg_into`` (scatter I/O) after checking the
  frame's length against the agreed one.

So a pull costs the two copies of a raw send/recv of the same bytes (into
the kernel and out of it), whether the blocks are contiguous or scattered.
Giving a transfer up (a timeout) unposts its frames; if one is being read
at that moment, the connection is shut down first, so nothing lands in the
destination rows afterwards (:meth:`~kvfunc.datadist._wire.Receive.abandon`).
The sender copies a frame's last bytes before it sends the rest and calls
``on_copied`` before it sends them, so a pull's source can be released
before the receiver can have everything.

The transport moves host memory: a cache on an accelerator moves over its
device transport (nccl, hccl) instead.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvfunc.datadist._backends import Endpoint, Incoming, Outgoing, rows_as_bytes
from kvfunc.datadist._errors import FeatureNotEnabledError
from kvfunc.datadist._slices import row_runs
from kvfunc.datadist._wire import Buffers, Connection, data_header, frame_bytes

__all__ = ["TcpEndpoint", "row_buffers", "row_runs"]


def row_buffers(tensor: torch.Tensor, runs: Sequence[tuple[int, int]],
                slices: dict[int, list[slice]] | None = None) -> Buffers:
    """Byte views of ``tensor``'s row runs (shared memory, not copies).

    ``slices`` keeps the byte ranges of the runs per row size, for the
    next tensor of the same transfer.

    >>> t = torch.arange(6, dtype=torch.int8).view(3, 2)
    >>> [bytes(b) for b in row_buffers(t, [(2, 1), (0, 1)])]
    [b'\\x04\\x05', b'\\x00\\x01']
    """
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise FeatureNotEnabledError(
            f"the tcp transport moves contiguous host tensors, not one on {tensor.device}; "
            "a device cache moves over nccl or hccl (llm.TransferBackend)")
    flat = memoryview(rows_as_bytes(tensor).reshape(-1))  # type: ignore[arg-type]
    size = flat.nbytes // max(tensor.shape[0], 1)
    cut = None if slices is None else slices.get(size)
    if cut is None:
        cut = [slice(first * size, (first + count) * size) for first, count in runs]
        if slices is not None:
            slices[size] = cut
    return list(map(flat.__getitem__, cut))


def _frames(tensors: Sequence[torch.Tensor], rows: Sequence[int],
            layers: Sequence[Sequence[int]]) -> list[Buffers]:
    """Per layer, the byte views of its tensors' rows: one per run, tensor after tensor."""
    runs = row_runs(rows)
    slices: dict[int, list[slice]] = {}  # the tensors of a cache share one row size
    return [list(itertools.chain.from_iterable(row_buffers(tensors[i], runs, slices)
                                               for i in layer)) for layer in layers]


class _Outgoing(Outgoing):
    def __init__(self, conn: Connection, tensors: Sequence[torch.Tensor], rows: Sequence[int],
                 tag: int, layers: Sequence[Sequence[int]]) -> None:
        self.conn, self.tag = conn, tag
        self.descriptor = {}
        self.copies_source = True
        self.layers = [list(layer) for layer in layers]
        self.frames = _frames(tensors, rows, self.layers)
        self.released: set[int] = set()
        self.next = 0

    def send(self, indices: Sequence[int]) -> None:
        """Send each frame whose tensors are all released, in order (in this thread)."""
        self.released.update(indices)
        while self.next < len(self.layers) and self.released.issuperset(self.layers[self.next]):
            j, self.next = self.next, self.next + 1
            frame = self.frames[j]
            last = self.next == len(self.layers) and self.on_copied is not None
            self.conn.send(data_header(self.tag, j, frame_bytes(frame)), frame,
                           self.conn.timeout_s, before_tail=self.on_copied if last else None)

    def wait(self, timeout_s: float) -> None:
        """Nothing to wait for: :meth:`send` returns once the kernel has the bytes."""


class _Incoming(Incoming):
    def __init__(self, conn: Connection, tensors: Sequence[torch.Tensor], rows: Sequence[int],
                 tag: int, layers: Sequence[Sequence[int]]) -> None:
        self.tensors = list(tensors)
        self.frame_of = {i: j for j, layer in enumerate(layers) for i in layer}
        self.posted = conn.expect(tag, _frames(tensors, rows, layers))

    def receive(self, indices: Sequence[int], timeout_s: float) -> None:
        self.posted.wait(max(self.frame_of[i] for i in indices), timeout_s)

    def abandon(self, on_settled: Callable[[], None]) -> None:
        if self.posted.abandon():
            on_settled()


class TcpEndpoint(Endpoint):
    """A link whose data travels over the link's own connection (see the module docstring).

    Receives are posted before a pull asks; a refused pull just unposts
    them (the refusing side sends no data, so there is nothing to drain).
    """

    posts_early = True

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def outgoing(self, tensors: Sequence[torch.Tensor], rows: Sequence[int], tag: int,
                 layers: Sequence[Sequence[int]]) -> Outgoing:
        return _Outgoing(self.conn, tensors, rows, tag, layers)

    def incoming(self, tensors: Sequence[torch.Tensor], rows: Sequence[int], tag: int,
                 layers: Sequence[Sequence[int]], descriptor: dict[str, Any] | None
                 ) -> Incoming:
        return _Incoming(self.conn, tensors, rows, tag, layers)

    def close(self) -> None:
        """Nothing of its own: the link closes the connection."""
