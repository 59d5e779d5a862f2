"""Host memory for a device cache's blocks: the host tier's tensors.

A :class:`HostBlockPool` mirrors one set of cache tensors (one group's, as
:func:`kvfunc.shell.cache_tensors_by_key` gives them): one host tensor per
cache tensor, with the same dtype and the same per-block shape, and its own
number of blocks.  It holds bytes only; which host block holds what is the
pure core's business.

Two layouts of the same tensors (SGLang's HiCache calls them ``layer_first``
and ``page_first``)::

    layout="layer"   one allocation per cache tensor, blocks consecutive in it
                     [t0: b0 b1 b2 ...] [t1: b0 b1 b2 ...] ...
    layout="block"   one allocation; block b's parts for every tensor side by side
                     [b0: t0 t1 ...] [b1: t0 t1 ...] ...

Either way ``pool.tensors[i][b]`` is block ``b`` of tensor ``i``.  The block
layout makes each block one contiguous region (one object in a remote store,
one copy per run of blocks); the layer layout keeps each tensor contiguous,
which suits layer-by-layer copies on a device.

A block's bytes, whatever the layout, are the parts of its tensors in order
(:attr:`HostBlockPool.part_offsets`), no padding: the same bytes a remote
store keeps for it.  :attr:`HostBlockPool.fingerprint` names that format
(dtypes and block shapes in order), so two pools agree on it exactly when
their fingerprints are equal.

Memory is pinned (page-locked) when the cache is on a CUDA device, so that
copies to and from it run asynchronously; on the CPU (and other devices)
pinning is skipped and :attr:`HostBlockPool.pinned` is False, and a buffer of
2 MiB or more is advised for transparent huge pages
(:func:`~kvfunc.shell._tensors.cpu_bytes`), as the shell's CPU caches are.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import attrs
import torch

from kvfunc.core import BlockIndexError, InvalidArgumentError, InvalidTypeError
from kvfunc.shell._blocks import TensorSet, _named
from kvfunc.shell._device import DeviceError
from kvfunc.shell._tensors import HUGE_PAGE_BYTES, block_pages, cpu_bytes

__all__ = ["HostBlockPool", "Region"]

LAYOUTS = ("layer", "block")
_FORMAT_VERSION = 1

Region = tuple[int, int]
"""``(address, nbytes)`` of a piece of host memory."""


def block_bytes_of(t: torch.Tensor) -> int:
    """Bytes of one block of ``t`` (``t[b]``).

    >>> block_bytes_of(torch.empty(3, 4, 2, dtype=torch.float16))
    16
    """
    n = 1
    for d in t.shape[1:]:
        n *= d
    return n * t.element_size()


def blocks_contiguous(t: torch.Tensor) -> bool:
    """Whether every block ``t[b]`` is one contiguous run of memory.

    >>> blocks_contiguous(torch.empty(4, 3, 2)), blocks_contiguous(torch.empty(4, 3, 2)[:, :, :1])
    (True, False)
    """
    expected = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:]), strict=True):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def check_device_tensors(named: list[tuple[str, torch.Tensor]]) -> torch.device:
    if not named:
        raise InvalidArgumentError("device_tensors must hold at least one tensor")
    device = named[0][1].device
    for name, t in named:
        if t.device != device:
            msg = f"{name} is on {t.device} but {named[0][0]} is on {device}"
            raise InvalidArgumentError(msg)
        if not blocks_contiguous(t) or (t.shape[0] > 1 and t.stride(0) * t.element_size()
                                        < block_bytes_of(t)):
            msg = (f"blocks of {name} are not contiguous and apart (shape {list(t.shape)}, "
                   f"strides {list(t.stride())})")
            raise InvalidArgumentError(msg)
        if block_bytes_of(t) == 0:
            raise InvalidArgumentError(f"blocks of {name} are empty (shape {list(t.shape)})")
    return device


def _fingerprint(named: list[tuple[str, torch.Tensor]]) -> str:
    desc = repr([_FORMAT_VERSION] + [(str(t.dtype), tuple(t.shape[1:])) for _, t in named])
    return hashlib.sha256(desc.encode()).hexdigest()[:16]


@attrs.frozen(slots=True, eq=False)
class HostBlockPool:
    """Host blocks laid out like a device cache's blocks (see the module docstring).

    Build one with :meth:`like`.  ``tensors[i]`` mirrors the i-th device
    tensor, ``names[i]`` is its name (the mapping's key, or ``"tensors[i]"``
    for a sequence), ``buffers`` are the contiguous byte allocations behind
    them (one for the block layout, one per tensor for the layer layout):
    what a remote store registers.  In the block layout block ``b`` starts
    ``b * block_stride`` bytes into the buffer (``block_bytes`` rounded up to
    the largest element size); ``block_stride`` is 0 in the layer layout.
    """

    names: tuple[str, ...]
    tensors: tuple[torch.Tensor, ...] = attrs.field(repr=False)
    buffers: tuple[torch.Tensor, ...] = attrs.field(repr=False)
    num_blocks: int
    layout: str
    pinned: bool
    part_offsets: tuple[int, ...]
    part_bytes: tuple[int, ...]
    block_stride: int
    keyed: bool
    fingerprint: str

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over all tensors (one object of a remote store)."""
        return sum(self.part_bytes)

    @classmethod
    def like(cls, device_tensors: TensorSet, num_blocks: int, *, layout: str = "layer"
             ) -> HostBlockPool:
        """Allocate ``num_blocks`` host blocks shaped like ``device_tensors``' blocks.

        Args:
            device_tensors: a mapping ``{name: tensor}`` or a sequence of
                tensors, block ``b`` of each being ``tensor[b]``; all on one
                device, each block contiguous.
            num_blocks: host blocks to allocate (their contents start
                undefined).
            layout: ``"layer"`` or ``"block"`` (module docstring).

        Raises:
            InvalidTypeError: not tensors, ``num_blocks`` not an int.
            InvalidArgumentError: no tensors, several devices, blocks that are
                empty or not contiguous, a negative ``num_blocks``, an unknown
                layout, or (block layout) a part whose offset is not a multiple
                of its element size.
            DeviceError: the host memory cannot be allocated or pinned.

        >>> dev = {"k": torch.zeros(8, 4, 2), "v": torch.zeros(8, 4, 2)}
        >>> pool = HostBlockPool.like(dev, 3, layout="block")
        >>> pool.tensors[1].shape, pool.block_bytes, pool.part_offsets, pool.pinned
        (torch.Size([3, 4, 2]), 64, (0, 32), False)
        """
        named = _named(device_tensors, "device_tensors")
        device = check_device_tensors(named)
        if type(num_blocks) is not int:
            raise InvalidTypeError(f"num_blocks must be an int, but got {num_blocks!r}")
        if num_blocks < 0:
            raise InvalidArgumentError(f"num_blocks must be >= 0, but got {num_blocks}")
        if layout not in LAYOUTS:
            raise InvalidArgumentError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")
        parts = tuple(block_bytes_of(t) for _, t in named)
        offsets = tuple(sum(parts[:i]) for i in range(len(parts)))
        pinned = device.type == "cuda"
        stride = 0
        if layout == "block":
            buffer, stride, tensors = block_pages(
                [(name, t.dtype, tuple(t.shape[1:])) for name, t in named], num_blocks,
                lambda nbytes: _host_bytes(nbytes, pinned))
            buffers: tuple[torch.Tensor, ...] = (buffer,)
        else:
            buffers = tuple(_host_bytes(num_blocks * n, pinned) for n in parts)
            tensors = tuple(b.view(t.dtype).view(num_blocks, *t.shape[1:])
                            for (_, t), b in zip(named, buffers, strict=True))
        return cls(tuple(n for n, _ in named), tensors, buffers, num_blocks, layout, pinned,
                   offsets, parts, stride, isinstance(device_tensors, Mapping),
                   _fingerprint(named))

    def tensor_set(self) -> dict[str, torch.Tensor] | list[torch.Tensor]:
        """The host tensors in the shape the pool was made from: a mapping or a list.

        >>> HostBlockPool.like([torch.zeros(2, 3)], 4).tensor_set()[0].shape
        torch.Size([4, 3])
        """
        if self.keyed:
            return dict(zip(self.names, self.tensors, strict=True))
        return list(self.tensors)

    def regions(self, block_id: int) -> list[Region]:
        """The host memory of block ``block_id``: one region (block layout) or one per tensor.

        The regions, in order, hold the block's bytes as a remote store keeps
        them (:attr:`part_offsets`).

        Raises:
            InvalidTypeError: ``block_id`` is not an int.
            BlockIndexError: ``block_id`` outside ``[0, num_blocks)``.

        >>> pool = HostBlockPool.like([torch.zeros(2, 3), torch.zeros(2, 1)], 4, layout="block")
        >>> [n for _, n in pool.regions(2)], pool.regions(1)[0][0] - pool.regions(0)[0][0]
        ([16], 16)
        """
        if type(block_id) is not int:
            raise InvalidTypeError(f"block_id must be an int, but got {block_id!r}")
        if not 0 <= block_id < self.num_blocks:
            raise BlockIndexError(f"host block {block_id} out of range [0, {self.num_blocks})")
        if self.layout == "block":
            return [(self.buffers[0].data_ptr() + block_id * self.block_stride, self.block_bytes)]
        return [(b.data_ptr() + block_id * n, n)
                for b, n in zip(self.buffers, self.part_bytes, strict=True)]


def _host_bytes(nbytes: int, pinned: bool) -> torch.Tensor:
    if not pinned and nbytes >= HUGE_PAGE_BYTES:
        return cpu_bytes(nbytes)
    try:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    except RuntimeError as exc:
        kind = "pinned " if pinned else ""
        raise DeviceError(f"cannot allocate {nbytes} bytes of {kind}host memory: {exc}") from exc


def check_host_pool(host: object) -> HostBlockPool:
    """``host`` if it is a :class:`HostBlockPool`, else a typed error.

    >>> check_host_pool(3)
    Traceback (most recent call last):
    ...
    kvfunc.core._errors.InvalidTypeError: expected a HostBlockPool, got int
    """
    if not isinstance(host, HostBlockPool):
        raise InvalidTypeError(f"expected a HostBlockPool, got {type(host).__name__}")
    return host


def positions_of(host: HostBlockPool, names: Sequence[str | int], what: str) -> list[int]:
    """Positions of tensors given by name or position.

    >>> pool = HostBlockPool.like({"k": torch.zeros(2, 1), "v": torch.zeros(2, 1)}, 1)
    >>> positions_of(pool, ["v", 0], "layer 0")
    [1, 0]
    """
    out = []
    for n in names:
        if type(n) is int and 0 <= n < len(host.tensors):
            out.append(n)
        elif isinstance(n, str) and n in host.names:
            out.append(host.names.index(n))
        else:
            msg = f"{what} names tensor {n!r}, which is not one of {list(host.names)}"
            raise InvalidArgumentError(msg)
    return out
