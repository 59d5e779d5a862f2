"""Moving blocks between a device cache and its host pool: batched and non-blocking.

Theory of operation
-------------------
A :class:`BlockMover` joins one set of device cache tensors to the
:class:`~kvfunc.shell.HostBlockPool` made like them.  :meth:`BlockMover.store`
copies device blocks to host blocks, :meth:`BlockMover.load` host blocks to
device blocks, every tensor, and both return at once with a
:class:`MoveHandle`: ``wait()`` / ``done()`` for the whole move and one
:class:`LayerHandle` per layer, so an engine can start a layer's compute as
soon as that layer's blocks have landed.

Every argument is checked in the caller's thread before anything is queued
(ids 1-D integers in range, equal lengths, no destination twice): a bad call
raises a typed error and moves nothing.  The copies then run layer by layer
in the order of ``layers``:

* on the CPU, on one worker thread per mover, moves in the order they were
  made (a load queued after a store of the same host block reads what the
  store wrote).  Pairs are grouped into few large copies
  (:func:`~kvfunc.shell._move_plan.plan_move`): slices for runs of
  consecutive ids, one indexed read into a slice or one indexed write from a
  slice when one side is consecutive.  Blocks of ``ROW_COPY_MIN_BYTES`` or
  more are copied one by one (a byte copy each) when both sides are
  scattered, when the indexed copies would average fewer than
  ``ROWS_PER_INDEXED_COPY`` blocks, or for a gather of blocks of
  ``LARGE_ROW_BYTES`` or more; smaller blocks scattered on both sides go
  through a temporary instead, one gather and one scatter, since the
  per-copy cost would dominate.  When both sides keep
  a block's parts side by side, in the same order (a cache made with
  ``layout="block"``, :func:`~kvfunc.shell.create_cache_tensors`, and a
  pool of the block layout), a block of every tensor is one page
  (:func:`pages_of`) and the move copies pages, all tensors at once: a
  sixteenth of the copies for sixteen tensors, each sixteen times larger.
  Every layer is then done when the whole move is, unless the caller named
  the layers: then the move still goes layer by layer, one page of each
  layer's tensors where they lie side by side (K and V of a layer, say);
* on CUDA, on a side stream that first waits for the current stream (a store
  reads what the compute wrote), as one asynchronous copy per run of
  consecutive ids (per block where the host's block layout strides the
  rows), with an event recorded after each layer; host memory is pinned so
  the copies do not block.

What the blocks mean, and when a block may be moved or reused, is the pure
core's business: the mover neither reads a state nor keeps one.  A block
being moved must not be written by anyone else until its handle is done.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from functools import partial
from typing import Any

import numpy as np
import torch

from kvfunc.core import InvalidArgumentError
from kvfunc.shell._blocks import BlockIds, TensorSet, _Ids, _pair, _swap_pairs
from kvfunc.shell._host_pool import (
    HostBlockPool,
    check_device_tensors,
    check_host_pool,
    positions_of,
)
from kvfunc.shell._move_handles import MoveHandle, MoveWorker
from kvfunc.shell._move_plan import MovePlan, plan_move, row_runs

__all__ = ["BlockMover"]

DIRECTIONS = ("store", "load")
#: below this many bytes a row, scattered rows go through a temporary (one gather, one scatter)
ROW_COPY_MIN_BYTES = 4096
#: an indexed copy (gather or scatter) beats copying its rows one by one from this many rows
#: a copy on average, but a gather of rows of LARGE_ROW_BYTES or more never does
#: (``benchmarks/README.md``, "bench_tiers")
ROWS_PER_INDEXED_COPY = 8
LARGE_ROW_BYTES = 65536
#: ... nor does a gather of rows of this many bytes into rows that are not side by side (a
#: layer's page of K and V in a block-layout pool)
STRIDED_ROW_BYTES = 32768


class _Bytes:
    """One tensor's blocks as a ``(num_blocks, block_bytes)`` uint8 matrix (shares storage)."""

    __slots__ = ("flat", "np", "row_bytes", "row_stride", "rows", "tensor")

    def __init__(self, t: torch.Tensor) -> None:
        es = t.element_size()
        self.tensor = t
        self.row_bytes = t[0].numel() * es if t.shape[0] else 0
        self.row_stride = t.stride(0) * es
        storage, offset = t.untyped_storage(), t.storage_offset() * es
        self.rows = torch.empty(0, dtype=torch.uint8, device=t.device).set_(
            storage, offset, (t.shape[0], self.row_bytes), (self.row_stride, 1))
        span = (t.shape[0] - 1) * self.row_stride + self.row_bytes if t.shape[0] else 0
        self.flat: memoryview | None = None
        self.np: np.ndarray | None = None
        if t.device.type == "cpu":
            self.np = self.rows.numpy()
            flat = torch.empty(0, dtype=torch.uint8).set_(storage, offset, (span,), (1,))
            self.flat = memoryview(flat.numpy())  # type: ignore[arg-type]

    @property
    def strided(self) -> bool:
        return self.row_stride != self.row_bytes


def pages_of(side: list[_Bytes]) -> _Bytes | None:
    """A CPU side's blocks as whole pages, if its tensors' blocks lie side by side.

    That is: every tensor is a view of one storage with one first stride and
    as many blocks, and block ``b`` of tensor ``i + 1`` starts where block
    ``b`` of tensor ``i`` ends (a block-major cache, a host pool of the block
    layout).  The page is then the bytes of block ``b`` of every tensor,
    nothing else, so copying pages copies exactly the tensors' blocks.
    """
    first = side[0]
    t0, n = first.tensor, first.tensor.shape[0]
    if len(side) < 2 or t0.device.type != "cpu" or not n:
        return None
    storage = t0.untyped_storage()
    start = at = t0.storage_offset() * t0.element_size()
    for b in side:
        t = b.tensor
        if (t.untyped_storage().data_ptr() != storage.data_ptr() or t.shape[0] != n
                or (n > 1 and b.row_stride != first.row_stride)  # one block: any stride
                or t.storage_offset() * t.element_size() != at):
            return None
        at += b.row_bytes
    stride = first.row_stride if n > 1 else at - start
    # pages apart, and inside the first tensor's storage (another storage object can share
    # its data pointer and reach further)
    if at - start > stride or start + (n - 1) * stride + at - start > storage.nbytes():
        return None
    rows = torch.empty(0, dtype=torch.uint8).set_(storage, start, (n, at - start), (stride, 1))
    return _Bytes(rows)


def _cpu_copies(device: list[_Bytes], host: list[_Bytes], layers: list[list[int]],
                streamed: bool) -> tuple[list[_Bytes], list[_Bytes], list[list[int]]] | None:
    """Pages to copy on each side and the copies of each layer, or None: a copy per tensor.

    Unless ``streamed`` (layers the caller named), whole pages when both sides
    have them, every layer done with the one copy; else, layer by layer, a
    page of each layer whose tensors lie side by side on both sides (only CPU
    tensors have pages: :func:`pages_of`).
    """
    if not streamed:
        dpage, hpage = pages_of(device), pages_of(host)
        if dpage is not None and hpage is not None:
            return [dpage], [hpage], [[0]] + [[] for _ in layers[1:]]
    devs: list[_Bytes] = []
    hosts: list[_Bytes] = []
    groups: list[list[int]] = []
    for group in layers:
        dpage, hpage = pages_of([device[i] for i in group]), pages_of([host[i] for i in group])
        pairs = [(dpage, hpage)] if dpage is not None and hpage is not None else [
            (device[i], host[i]) for i in group]
        groups.append(list(range(len(devs), len(devs) + len(pairs))))
        devs.extend(d for d, _ in pairs)
        hosts.extend(h for _, h in pairs)
    return (devs, hosts, groups) if len(devs) < len(device) else None


def copy_rows_cpu(plan: MovePlan, src: _Bytes, dst: _Bytes) -> None:
    """Perform ``plan`` from ``src`` to ``dst``, both CPU byte matrices of equal row size."""
    sn, dn = src.np, dst.np
    assert sn is not None and dn is not None
    rb = src.row_bytes
    if plan.kind == "runs":
        for s, d, n, _ in plan.segments:
            dn[d:d + n] = sn[s:s + n]
    elif rb >= ROW_COPY_MIN_BYTES and (
            plan.kind == "scattered" or (plan.kind == "gather" and (
                rb >= LARGE_ROW_BYTES or (dst.strided and rb >= STRIDED_ROW_BYTES)))
            or len(plan.src_ids) < ROWS_PER_INDEXED_COPY * len(plan.segments)):
        _copy_each_row(plan, src, dst)  # scattered, or indexed copies that would not pay
    elif plan.kind == "gather":
        for _, d, n, ids in plan.segments:
            assert ids is not None
            torch.index_select(src.rows, 0, torch.from_numpy(ids), out=dst.rows[d:d + n])
    elif plan.kind == "scatter":
        for s, _, n, ids in plan.segments:
            dn[ids] = sn[s:s + n]
    else:
        dn[plan.dst_ids] = sn[plan.src_ids]


def _copy_each_row(plan: MovePlan, src: _Bytes, dst: _Bytes) -> None:
    sf, df, rb = src.flat, dst.flat, src.row_bytes
    assert sf is not None and df is not None
    ss, ds = src.row_stride, dst.row_stride
    for s, d in zip(plan.src_ids.tolist(), plan.dst_ids.tolist(), strict=True):
        df[d * ds:d * ds + rb] = sf[s * ss:s * ss + rb]


def copy_rows_cuda(plan: MovePlan, src: _Bytes, dst: _Bytes) -> None:
    """Queue ``plan``'s copies on the current stream, one per contiguous range."""
    split = src.strided or dst.strided
    for s, d, n in row_runs(plan.src_ids, plan.dst_ids, split):
        dst.rows[d:d + n].copy_(src.rows[s:s + n], non_blocking=True)


def _layers(host: HostBlockPool, layers: Sequence[Sequence[str | int]] | None) -> list[list[int]]:
    if layers is None:
        return [[i] for i in range(len(host.tensors))]
    if isinstance(layers, str | bytes) or not isinstance(layers, Sequence):
        raise InvalidArgumentError(f"layers must be a sequence of tensor groups, got {layers!r}")
    out = []
    for i, group in enumerate(layers):
        if isinstance(group, str | bytes) or not isinstance(group, Sequence) or not group:
            msg = f"layers[{i}] must be a non-empty sequence of tensor names, got {group!r}"
            raise InvalidArgumentError(msg)
        out.append(positions_of(host, group, f"layers[{i}]"))
    flat = sorted(p for group in out for p in group)
    if flat != list(range(len(host.tensors))):
        msg = (f"layers must name every tensor exactly once; got positions {flat} for "
               f"{len(host.tensors)} tensors")
        raise InvalidArgumentError(msg)
    return out


def _run_cpu(handle: MoveHandle, plan: MovePlan, srcs: list[_Bytes], dsts: list[_Bytes],
             layers: list[list[int]]) -> None:
    """One CPU move, layer by layer (a job of the mover's worker)."""
    try:
        for group in layers:
            if len(plan.src_ids):
                for i in group:
                    copy_rows_cpu(plan, srcs[i], dsts[i])
            handle.finish_layer()
    except BaseException as exc:  # reported to every waiter by the handle
        handle.fail(exc)
        if not isinstance(exc, Exception):  # an interrupt in a waiter running the job
            raise


class BlockMover:
    """Copies blocks between device cache tensors and their host pool (module docstring).

    Build one with :meth:`create`; ``close()`` stops its worker thread.

    >>> from kvfunc.shell import HostBlockPool
    >>> dev = {"k": torch.arange(8.0).view(4, 2), "v": torch.arange(8.0).view(4, 2) + 10}
    >>> host = HostBlockPool.like(dev, 6, layout="block")
    >>> mover = BlockMover.create(dev, host)
    >>> mover.store([3, 1], [0, 5]).wait()
    True
    >>> host.tensors[0][[0, 5]].tolist(), host.tensors[1][0].tolist()
    ([[6.0, 7.0], [2.0, 3.0]], [16.0, 17.0])
    >>> mover.load([5], [2]).wait(); dev["k"][2].tolist()
    True
    [2.0, 3.0]
    >>> mover.close()
    """

    def __init__(self, device: list[_Bytes], host: list[_Bytes], layers: list[list[int]],
                 cuda: bool, streamed: bool) -> None:
        self._device, self._host, self._layers, self._cuda = device, host, layers, cuda
        # each side's tensors, named for errors, and the fewest blocks any of them has
        dev, hst = (([(f"tensor {i}", b.tensor) for i, b in enumerate(side)],
                     min((b.tensor.shape[0] for b in side), default=0)) for side in (device, host))
        #: direction -> (source side, destination side, and what each side's ids are checked on)
        self._routes = {"store": (device, host, dev, hst), "load": (host, device, hst, dev)}
        #: on the CPU, direction -> (what is copied on each side, which copies make each layer)
        devs, hosts, groups = _cpu_copies(device, host, layers, streamed) or (device, host,
                                                                             layers)
        self._cpu = {"store": (devs, hosts, groups), "load": (hosts, devs, groups)}
        self._worker: MoveWorker | None = None
        self._stream: Any = None
        self._lock = threading.Lock()
        self._closed = False

    @property
    def _paged(self) -> bool:
        """Whether a CPU move copies pages rather than each tensor."""
        return self._cpu["store"][0] is not self._device

    @classmethod
    def create(cls, device_tensors: TensorSet, host: HostBlockPool, *,
               layers: Sequence[Sequence[str | int]] | None = None) -> BlockMover:
        """A mover between ``device_tensors`` and ``host`` (made with ``HostBlockPool.like``).

        Args:
            device_tensors: the cache tensors, matched to the pool's by key
                (a mapping) or by position (a sequence).
            host: the host pool.
            layers: tensor names (or positions) per layer, in the order the
                copies run; each tensor exactly once.  Default: one layer
                per tensor (on the CPU, with whole pages on both sides, one
                copy for them all: module docstring).

        Raises:
            InvalidTypeError: not tensors, or ``host`` not a HostBlockPool.
            InvalidArgumentError: keys, counts, block shapes or layers that do
                not match, tensors on several devices, blocks that are not
                contiguous or overlap.
        """
        host = check_host_pool(host)
        # in the pool's order, the order in which ``layers`` names tensors by position
        pairs = _swap_pairs(host.tensor_set(), device_tensors)
        device = check_device_tensors([(name, d) for _, _, name, d in pairs])
        groups = _layers(host, layers)
        return cls([_Bytes(d) for _, _, _, d in pairs], [_Bytes(h) for _, h, _, _ in pairs],
                   groups, device.type == "cuda", layers is not None)

    def store(self, device_block_ids: BlockIds, host_block_ids: BlockIds) -> MoveHandle:
        """Copy device blocks ``device_block_ids[i]`` to host blocks ``host_block_ids[i]``.

        Raises:
            InvalidTypeError, InvalidArgumentError, BlockIndexError: as
                :meth:`move`.
        """
        return self.move("store", device_block_ids, host_block_ids)

    def load(self, host_block_ids: BlockIds, device_block_ids: BlockIds) -> MoveHandle:
        """Copy host blocks ``host_block_ids[i]`` to device blocks ``device_block_ids[i]``.

        Raises:
            InvalidTypeError, InvalidArgumentError, BlockIndexError: as
                :meth:`move`.
        """
        return self.move("load", host_block_ids, device_block_ids)

    def move(self, direction: str, src_block_ids: BlockIds, dst_block_ids: BlockIds
             ) -> MoveHandle:
        """Copy ``src[i] -> dst[i]`` for every tensor: ``"store"`` device to host, ``"load"`` back.

        Returns at once; the handle says when each layer is done.

        Raises:
            InvalidTypeError: ids that are not 1-D integers.
            InvalidArgumentError: an unknown direction, lengths that differ, a
                destination twice, a closed mover.
            BlockIndexError: an id outside its side's blocks.
        """
        if direction not in DIRECTIONS:
            msg = f"unknown direction {direction!r}; expected one of {DIRECTIONS}"
            raise InvalidArgumentError(msg)
        srcs, dsts, src_check, dst_check = self._routes[direction]
        src, dst = _Ids(src_block_ids, "src_block_ids"), _Ids(dst_block_ids, "dst_block_ids")
        _pair(src, dst)
        src.check_range(*src_check)
        dst.check_range(*dst_check)
        plan = plan_move(src.host.numpy(), dst.host.numpy())
        with self._lock:
            if self._closed:
                raise InvalidArgumentError("the mover is closed")
            if self._cuda:
                return self._move_cuda(plan, srcs, dsts)
            if self._worker is None:
                self._worker = MoveWorker()
                # A mover dropped without close() still ends its thread.
                weakref.finalize(self, self._worker.stop, False)
            handle = MoveHandle(len(self._layers), worker=self._worker)
            srcs, dsts, layers = self._cpu[direction]
            self._worker.submit(partial(_run_cpu, handle, plan, srcs, dsts, layers))
            return handle

    def _move_cuda(self, plan: MovePlan, srcs: list[_Bytes], dsts: list[_Bytes]
                   ) -> MoveHandle:
        cuda: Any = torch.cuda  # its stubs leave Stream and Event untyped
        if self._stream is None:
            self._stream = cuda.Stream(device=srcs[0].tensor.device)
        self._stream.wait_stream(cuda.current_stream(srcs[0].tensor.device))
        events = []
        with cuda.stream(self._stream):
            for group in self._layers:
                for i in group:
                    copy_rows_cuda(plan, srcs[i], dsts[i])
                event = cuda.Event()
                event.record(self._stream)
                events.append(event)
        return MoveHandle(len(events), events)

    def close(self) -> None:
        """Finish the queued moves and stop the worker thread (idempotent)."""
        with self._lock:
            self._closed = True
            worker, self._worker = self._worker, None
        if worker is not None:
            worker.stop()
