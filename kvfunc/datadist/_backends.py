"""Data transports behind one small interface; the ``torch.distributed`` ones.

A transfer moves, for each tensor ``i`` of a cache, the rows ``rows`` (blocks
or batch entries) of the sender's tensor into the rows ``rows'`` (paired by
position) of the receiver's.  Both sides build their half from an
:class:`Endpoint` (one per link):

* the sender's :class:`Outgoing` has a JSON ``descriptor`` (what the
  receiver needs to know) and ``send(indices)`` starts moving tensors;
* the receiver's :class:`Incoming` is built from that descriptor and
  ``receive(indices, timeout_s)`` returns once those tensors' rows are in
  place; ``abandon(on_settled)`` gives a transfer up and runs ``on_settled``
  once nothing of it can write the destination rows any more.

Three transports implement it: ``tcp`` (:mod:`._tcp`, the default on host
memory: the link's own connection, straight into the rows), Mooncake
(:mod:`._mooncake`), and :class:`TorchEndpoint` here (``gloo``, ``nccl``,
``hccl``: a two-rank process group per link, rendezvous through a
``TCPStore`` the listener starts).

:class:`TorchEndpoint` lands data in a staging buffer
(:class:`StagedIncoming`) and copies it into its rows only after it arrived
whole, so a transfer that times out never writes a destination block late;
the staging buffers of an abandoned transfer are kept until the link
closes.  A transfer is cut into messages of whole tensors of one layer, up
to ``CHUNK_BYTES`` each (several keep the sender's gather, the wire and the
receiver's placing overlapped; layers stay separate so a layer-wise push
can send each as soon as it is computed).

On gloo two things keep the wire busy from the first byte:

* **Receives posted early.**  A gloo receive needs nothing from the sender,
  so the receiver of a pull posts its receives before it asks
  (``Endpoint.posts_early``); the request lists the messages posted
  (``Incoming.starts``), and a sender that refuses the transfer completes
  each with an empty message (``Endpoint.drains``, :meth:`Endpoint.drain`).
* **A sending thread.**  A thread of the link's own posts the sends, so
  gathering the next message overlaps writing this one.

Gloo trusts its peer: a message whose size differs from the posted receive
aborts the receiving process (gloo's own check, on its I/O thread), and an
undersize one is taken as complete.  ``tcp`` checks every size before it
reads and is the default for that reason (``docs/datadist.md``).
"""

from __future__ import annotations

import abc
import contextlib
import datetime
import itertools
import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import TCPStore

from kvfunc.datadist._errors import (
    FeatureNotEnabledError,
    InvalidParamError,
    LinkFailedError,
    TransferTimeoutError,
)

__all__ = ["BufferPool", "Endpoint", "Incoming", "Outgoing", "StagedIncoming", "TorchEndpoint",
           "chunks_of", "consecutive", "create_process_group", "gather_rows", "rows_as_bytes",
           "start_store_server"]

TAG_SPACE = 1 << 30
# One message carries up to this much of one layer.  On an idle 2-core machine a 64 MiB
# pull over gloo took ~52 ms in one message, ~44 ms in 16 MiB, ~42 ms in 8 MiB and
# ~49 ms in 4 MiB messages (benchmarks/bench_datadist.py): 8 MiB keeps the gather, the
# wire and the scatter overlapped without paying a handshake per tensor.
CHUNK_BYTES = 8 << 20


def consecutive(rows: Sequence[int]) -> bool:
    """Whether ``rows`` is one run ``r, r+1, ...`` (then a slice is a view, not a copy).

    >>> consecutive([4, 5, 6]), consecutive([4, 6]), consecutive([])
    (True, False, False)
    """
    return bool(rows) and rows[-1] - rows[0] == len(rows) - 1 and \
        all(b - a == 1 for a, b in itertools.pairwise(rows))


class BufferPool:
    """Staging buffers kept for reuse: a fresh large buffer costs a page fault per page.

    >>> pool = BufferPool()
    >>> a = pool.take((2, 3), torch.float32, torch.device("cpu")); pool.give(a)
    >>> pool.take((2, 3), torch.float32, torch.device("cpu")) is a
    True
    """

    def __init__(self, max_bytes: int = 1 << 30) -> None:
        self.max_bytes = max_bytes
        self.idle: dict[tuple[Any, ...], list[torch.Tensor]] = {}
        self.idle_bytes = 0
        self.lock = threading.Lock()

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
             ) -> torch.Tensor:
        """An uninitialised buffer, reused when one of that kind is idle."""
        with self.lock:
            found = self.idle.get((shape, dtype, device))
            if found:
                buf = found.pop()
                self.idle_bytes -= buf.numel() * buf.element_size()
                return buf
        return torch.empty(shape, dtype=dtype, device=device)

    def give(self, buf: torch.Tensor) -> None:
        """Return a buffer nothing will read or write any more."""
        nbytes = buf.numel() * buf.element_size()
        with self.lock:
            if self.idle_bytes + nbytes <= self.max_bytes:
                self.idle.setdefault((tuple(buf.shape), buf.dtype, buf.device), []).append(buf)
                self.idle_bytes += nbytes


def rows_as_bytes(tensor: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor as a ``[rows, row_bytes]`` uint8 numpy view (shared memory).

    >>> rows_as_bytes(torch.zeros(3, 2, dtype=torch.float16)).shape
    (3, 4)
    """
    return tensor.view(tensor.shape[0], -1).view(torch.uint8).numpy()


def gather_rows(tensor: torch.Tensor, rows: Sequence[int], index: torch.Tensor | None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """``tensor[rows]`` contiguous: a slice when ``rows`` is one run, else one gather."""
    if index is None:
        return tensor[rows[0]:rows[0] + len(rows)]
    if out is None:
        return tensor.index_select(0, index)
    return torch.index_select(tensor, 0, index, out=out)


class Outgoing(abc.ABC):
    """The sending half of one transfer.

    A transport whose ``send`` copies every row out of the source tensors
    before it posts the transfer's last message sets ``copies_source``; the
    caller may then set ``on_copied``, which ``send`` calls once, right
    before that last message is posted, so the sender can release its source
    before the receiver can possibly have everything.
    """

    descriptor: dict[str, Any]
    copies_source: bool = False
    on_copied: Callable[[], None] | None = None
    starts: Sequence[int] = ()  # each message's first tensor (none if not in messages)

    @abc.abstractmethod
    def send(self, indices: Sequence[int]) -> None:
        """Start sending the rows of tensors ``indices``."""

    @abc.abstractmethod
    def wait(self, timeout_s: float) -> None:
        """Return when everything sent has left; :class:`TransferTimeoutError` otherwise."""

    def close(self) -> None:
        """The transfer ended (the receiver has all of it, or gave up, or the link broke):
        release what the sending held (a staging region).  Nothing, unless overridden."""
        return None


class Incoming(abc.ABC):
    """The receiving half of one transfer.

    ``starts`` lists the first tensor of each message it waits for, as the
    sender's ``Outgoing.starts`` must, where the transport drains refused
    transfers (none otherwise).
    """

    starts: Sequence[int] = ()
    tensors: list[torch.Tensor]

    @abc.abstractmethod
    def receive(self, indices: Sequence[int], timeout_s: float) -> None:
        """Return once tensors ``indices`` are in their rows, or raise
        :class:`TransferTimeoutError` / :class:`LinkFailedError`."""

    def receive_all(self, timeout_s: float) -> None:
        """Return once every tensor is in its rows (see :meth:`receive`)."""
        self.receive(range(len(self.tensors)), timeout_s)

    @abc.abstractmethod
    def abandon(self, on_settled: Callable[[], None]) -> None:
        """Give up; ``on_settled`` runs (now or later) once nothing of this transfer can
        write its destination rows any more, and never if that cannot be known."""

    def cancel(self, timeout_s: float) -> None:
        """The sender refused the transfer: take back what was posted for it.

        Raises:
            TransferTimeoutError: what was posted could not be taken back in
                ``timeout_s`` (the transfer is abandoned).
        """
        self.abandon(lambda: None)


class StagedIncoming(Incoming):
    """A receiving half that lands data in a staging buffer from ``buffers``, then copies it
    into the rows (the buffer goes back to ``buffers`` once every tensor is placed)."""

    def __init__(self, tensors: Sequence[torch.Tensor], rows: Sequence[int],
                 staging_device: torch.device, buffers: BufferPool) -> None:
        self.tensors = list(tensors)
        self.rows = list(rows)
        self.index = None if consecutive(self.rows) else torch.tensor(self.rows)
        first = self.tensors[0]
        shape = (len(self.tensors), len(self.rows), *first.shape[1:])
        self.buffers = buffers
        self.buffer = buffers.take(shape, first.dtype, staging_device)
        self.staging = list(self.buffer)
        self.placed: set[int] = set()

    def receive_all(self, timeout_s: float) -> None:
        """Place tensor ``i`` while later ones still arrive."""
        deadline = time.monotonic() + timeout_s
        for i in range(len(self.tensors)):
            self.receive([i], deadline - time.monotonic())

    def place(self, i: int) -> None:
        """Copy tensor ``i``'s staged rows into its destination rows."""
        tensor, staged = self.tensors[i], self.staging[i]
        if self.index is None:
            tensor[self.rows[0]:self.rows[0] + len(self.rows)].copy_(staged)
        elif tensor.device.type == "cpu" and tensor.is_contiguous() and staged.is_contiguous():
            # numpy's row assignment is a memcpy per row: 4-8x torch's CPU index_copy_
            rows_as_bytes(tensor)[self.index.numpy()] = rows_as_bytes(staged)
        else:
            tensor.index_copy_(0, self.index.to(tensor.device), staged.to(tensor.device))
        self.placed.add(i)
        if len(self.placed) == len(self.tensors):
            self.buffers.give(self.buffer)  # every tensor placed: nothing lands here again


class Endpoint(abc.ABC):
    """One link's transport.

    Where ``posts_early`` is true, ``incoming`` needs no sender descriptor,
    so a receiver may build it before it asks; where ``drains`` is true too,
    a sender that refuses the transfer completes the receiver's posted
    messages with :meth:`drain`.
    """

    posts_early: bool = False
    drains: bool = False

    def drain(self, tag: int, starts: Sequence[int], timeout_s: float) -> None:
        """Complete the receiver's early-posted messages ``starts`` of ``tag`` with nothing
        (only where ``drains``; elsewhere there is nothing to complete).

        Raises:
            TransferTimeoutError: they did not complete in ``timeout_s`` (the
                receiver posted nothing there: the sends are kept until the
                link closes).
            LinkFailedError: the transport is closed.
        """
        raise FeatureNotEnabledError(f"{type(self).__name__} posts nothing it must drain")

    @abc.abstractmethod
    def outgoing(self, tensors: Sequence[torch.Tensor], rows: Sequence[int], tag: int,
                 layers: Sequence[Sequence[int]]) -> Outgoing:
        """The sending half of transfer ``tag``; ``layers`` are the units ``send`` gets."""

    @abc.abstractmethod
    def incoming(self, tensors: Sequence[torch.Tensor], rows: Sequence[int], tag: int,
                 layers: Sequence[Sequence[int]], descriptor: dict[str, Any] | None
                 ) -> Incoming:
        """The receiving half of transfer ``tag``, from the sender's descriptor (``None``
        when built before asking, where ``posts_early``)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Tear the transport down (pending operations fail)."""


def start_store_server(host: str, port: int, timeout_s: float) -> Any:
    """A ``TCPStore`` server on ``host:port`` (port 0 picks one; see ``.port``): the
    rendezvous of the ``torch.distributed`` transports.

    Raises:
        LinkFailedError: the address cannot be bound.
    """
    try:
        return TCPStore(host, port, is_master=True, wait_for_workers=False,
                        timeout=datetime.timedelta(seconds=timeout_s))
    except (dist.DistError, RuntimeError, OSError) as exc:
        raise LinkFailedError(f"cannot listen on {host}:{port}: {exc}") from None


def create_process_group(kind: str, store: Any, rank: int, timeout_s: float) -> Any:
    """A two-rank process group of ``kind`` over ``store`` (rank 0 listens, rank 1 links).

    Raises:
        FeatureNotEnabledError: ``kind`` is not available in this torch build.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    if kind == "gloo":
        return dist.ProcessGroupGloo(store, rank, 2, timeout)
    if kind == "nccl":
        if not dist.is_nccl_available():
            raise FeatureNotEnabledError("the nccl backend is not available in this torch")
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, 2, options)
    if kind == "hccl":
        try:
            from torch_npu._C._distributed_c10d import ProcessGroupHCCL
        except ImportError as exc:
            raise FeatureNotEnabledError(f"the hccl backend needs torch_npu: {exc}") from None
        options = ProcessGroupHCCL.Options()
        options._timeout = timeout
        return ProcessGroupHCCL(store, rank, 2, options)
    raise FeatureNotEnabledError(f"unknown torch.distributed backend {kind!r}")


def _wait(work: Any, remaining_s: float, what: str, device: torch.device) -> None:
    try:
        work.wait(datetime.timedelta(seconds=max(remaining_s, 0.001)))
    except RuntimeError as exc:
        raise TransferTimeoutError(f"{what} did not complete: {str(exc).splitlines()[0]}") \
            from None
    if device.type != "cpu":  # nccl/hccl: wait() orders the stream; the host waits here
        getattr(torch, device.type).synchronize(device)


def chunks_of(layers: Sequence[Sequence[int]], tensor_nbytes: int,
              chunk_nbytes: int = CHUNK_BYTES) -> list[list[int]]:
    """The messages of a transfer: each layer's tensors in runs of at most ``chunk_nbytes``.

    Fewer, larger messages cost fewer handshakes; several per transfer keep
    gathering, the wire and scattering overlapped.

    >>> chunks_of([[0, 1, 2, 3, 4]], 6 << 20, chunk_nbytes=16 << 20)
    [[0, 1], [2, 3], [4]]
    >>> chunks_of([[0, 1], [2, 3]], 1 << 20)
    [[0, 1], [2, 3]]
    """
    per = max(1, chunk_nbytes // max(tensor_nbytes, 1))
    return [list(layer[i:i + per]) for layer in layers for i in range(0, len(layer), per)]


class _TorchOutgoing(Outgoing):
    def __init__(self, endpoint: TorchEndpoint, tensors: Sequence[torch.Tensor],
                 rows: Sequence[int], tag: int, layers: Sequence[Sequence[int]]) -> None:
        self.endpoint, self.tensors, self.rows, self.tag = endpoint, list(tensors), list(rows), tag
        self.index = None if consecutive(self.rows) else torch.tensor(self.rows)
        self.descriptor = {}
        first = self.tensors[0]
        self.shape = (len(self.rows), *first.shape[1:])
        self.chunks = chunks_of(layers, math.prod(self.shape) * first.element_size())
        self.starts = [chunk[0] for chunk in self.chunks]
        # a device gather is asynchronous (the source is read later, on the stream)
        self.copies_source = endpoint.wire_device.type == "cpu"
        self.released: set[int] = set()
        self.pending: list[tuple[Any, torch.Tensor]] = []

    def send(self, indices: Sequence[int]) -> None:
        self.released.update(indices)
        while self.chunks and self.released.issuperset(self.chunks[0]):
            self._send_chunk(self.chunks.pop(0))

    def _send_chunk(self, chunk: list[int]) -> None:
        ep = self.endpoint
        buf = self._gather(chunk)
        if not self.chunks and self.on_copied is not None:
            self.on_copied()  # the source is read no more (gloo: the gather is synchronous)
        self.pending.append((ep.send(buf, (self.tag + chunk[0]) % TAG_SPACE), buf))

    def _gather(self, chunk: list[int]) -> torch.Tensor:
        ep, first = self.endpoint, self.tensors[chunk[0]]
        buf = ep.buffers.take((len(chunk), *self.shape), first.dtype, ep.wire_device)
        for j, i in enumerate(chunk):
            tensor = self.tensors[i]
            if self.index is None:
                buf[j].copy_(gather_rows(tensor, self.rows, None))
            elif tensor.device == ep.wire_device:
                gather_rows(tensor, self.rows, self.index, buf[j])
            else:
                buf[j].copy_(gather_rows(tensor, self.rows, self.index.to(tensor.device)))
        return buf

    def wait(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        try:
            for handle, _ in self.pending:
                self.endpoint.wait_sent(handle, deadline - time.monotonic())
        except TransferTimeoutError:
            self.endpoint.abandoned.append(self.pending)
            raise
        for _, buf in self.pending:
            self.endpoint.buffers.give(buf)
        self.pending = []


class _TorchIncoming(StagedIncoming):
    def __init__(self, endpoint: TorchEndpoint, tensors: Sequence[torch.Tensor],
                 rows: Sequence[int], tag: int, layers: Sequence[Sequence[int]]) -> None:
        super().__init__(tensors, rows, endpoint.wire_device, endpoint.buffers)
        self.endpoint = endpoint
        tensor_nbytes = self.staging[0].numel() * self.buffer.element_size()
        self.works: dict[int, Any] = {}  # tensor index -> the receive that brings it
        self.arrived: set[int] = set()
        chunks = chunks_of(layers, tensor_nbytes)
        for chunk in chunks:  # all checked before any receive is posted
            if not consecutive(chunk):
                raise InvalidParamError(f"layer tensors {chunk} are not consecutive")
        self.starts = [chunk[0] for chunk in chunks]
        for chunk in chunks:
            work = endpoint.group.recv([self.buffer[chunk[0]:chunk[-1] + 1]], endpoint.peer,
                                       (tag + chunk[0]) % TAG_SPACE)
            self.works.update(dict.fromkeys(chunk, work))

    def _arrive(self, works: Iterable[Any], timeout_s: float, what: str) -> None:
        """Wait for each of ``works`` not waited for yet (a gloo wait() is not idempotent)."""
        deadline = time.monotonic() + timeout_s
        for work in dict.fromkeys(works):
            if id(work) not in self.arrived:
                _wait(work, deadline - time.monotonic(), what, self.endpoint.wire_device)
                self.arrived.add(id(work))

    def receive(self, indices: Sequence[int], timeout_s: float) -> None:
        self._arrive((self.works[i] for i in indices), timeout_s, "receiving")
        for i in indices:
            self.place(i)

    def abandon(self, on_settled: Callable[[], None]) -> None:
        self.endpoint.abandoned.append((self.works, self.buffer))  # late data lands there
        on_settled()

    def cancel(self, timeout_s: float) -> None:
        try:
            self._arrive(self.works.values(), timeout_s, "draining")
        except TransferTimeoutError:
            self.abandon(lambda: None)
            raise
        self.buffers.give(self.buffer)  # the drain wrote nothing; nothing will


class TorchEndpoint(Endpoint):
    """A link over a two-rank ``torch.distributed`` process group.

    Gloo moves host tensors, so device rows are staged through host memory,
    and posts receives early and sends from a thread of its own (see the
    module docstring); nccl and hccl move device tensors directly.
    """

    def __init__(self, group: dist.ProcessGroup, kind: str, rank: int,
                 device: torch.device) -> None:
        self.group, self.peer = group, 1 - rank
        gloo = kind == "gloo"
        self.wire_device = torch.device("cpu") if gloo else device
        self.abandoned: list[Any] = []
        self.buffers = BufferPool()
        self.posts_early = self.drains = gloo  # nccl/hccl: an empty drain is unverified
        self.sender = ThreadPoolExecutor(1, thread_name_prefix="kvfunc-send") \
            if self.wire_device.type == "cpu" else None  # device sends never write inline

    def send(self, buf: torch.Tensor, tag: int) -> Any:
        """Post a send of ``buf`` (from the sending thread on gloo); a handle for
        :meth:`wait_sent`.

        Raises:
            LinkFailedError: the transport is closed.
        """
        try:
            if self.sender is None:  # nccl/hccl: queued on a stream, the caller never writes
                return self.group.send([buf], self.peer, tag)
            return self.sender.submit(self.group.send, [buf], self.peer, tag)
        except RuntimeError as exc:  # shut down (the link closed) or aborted
            raise LinkFailedError(f"the transport is closed: {exc!r:.200}") from None

    def wait_sent(self, handle: Any, timeout_s: float) -> None:
        """Return once the send behind ``handle`` has left.

        Raises:
            TransferTimeoutError: not within ``timeout_s``.
            LinkFailedError: the link closed before the send was posted.
        """
        deadline = time.monotonic() + timeout_s
        if isinstance(handle, Future):
            try:
                handle = handle.result(timeout=max(timeout_s, 0.001))
            except FutureTimeout:
                raise TransferTimeoutError("sending was not posted in time") from None
            except (RuntimeError, CancelledError) as exc:  # the link is closing
                raise LinkFailedError(f"the link closed while sending: {exc!r:.200}") \
                    from None
        _wait(handle, deadline - time.monotonic(), "sending", self.wire_device)

    def drain(self, tag: int, starts: Sequence[int], timeout_s: float) -> None:
        empty = torch.empty(0, dtype=torch.uint8, device=self.wire_device)
        deadline = time.monotonic() + timeout_s
        handles: list[Any] = []
        waited = 0
        try:
            for s in starts:
                handles.append(self.send(empty, (tag + s) % TAG_SPACE))
            for handle in handles:  # a gloo send is released only once waited for
                self.wait_sent(handle, deadline - time.monotonic())
                waited += 1
        except (TransferTimeoutError, LinkFailedError):
            self.abandoned.append(handles[waited:])
            raise

    def outgoing(self, tensors: Sequence[torch.Tensor], rows: Sequence[int], tag: int,
                 layers: Sequence[Sequence[int]]) -> Outgoing:
        return _TorchOutgoing(self, tensors, rows, tag, layers)

    def incoming(self, tensors: Sequence[torch.Tensor], rows: Sequence[int], tag: int,
                 layers: Sequence[Sequence[int]], descriptor: dict[str, Any] | None
                 ) -> Incoming:
        return _TorchIncoming(self, tensors, rows, tag, layers)

    def close(self) -> None:
        if self.sender is not None:
            self.sender.shutdown(wait=False, cancel_futures=True)
        abort = getattr(self.group, "abort", None)
        if abort is not None and self.abandoned:
            with contextlib.suppress(RuntimeError):  # wake pending receives now
                abort()
        self.abandoned = []
