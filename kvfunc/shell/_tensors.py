"""Cache tensors: one per paged cache entry, shaped and placed as the seed's (spec §5.3).

Theory of operation
-------------------
Allocation runs in three passes so that nothing is half-done:

1. **plan** every entry (seed order: layers in list order, caches in
   definition order, entries without ``needs_block`` skipped) and run every
   check — missing block count, allocator, storage block size, layout,
   heads and dims — before a byte is allocated;
2. **allocate** every tensor;
3. **attach**: :func:`with_cache_tensors` returns new records that carry the
   tensors (the pure API); the compat ``allocate_cache_tensors`` attaches
   them to the given records and calls each ``tensor_setter``.

Shapes (``B`` blocks, ``bs = block_size // compress_ratio`` stored rows,
``N`` heads, ``*dims`` the entry's dims, a list flattened into trailing
dims)::

    BnBsND   (B, bs, N, *dims)       one block = bs rows of N heads
    BnNBsD   (B, N, bs, *dims)       one block = N heads of bs rows
    Mamba    (B, *shape)             one block = one recurrent state

Either way block ``b`` is the contiguous slice ``tensor[b]``.  Device
("hbm") tensors start at a 2 MiB boundary (allocated with slack and
sliced), as the seed's do.  ``swapped_memory`` tensors live in host memory
the device can address: ``torch_npu.empty_with_swapped_memory`` on an NPU,
pinned (page-locked, device-mapped) host memory for CUDA, and ordinary host
memory on the CPU.

Two layouts of a group's tensors (``layout=`` of :func:`create_cache_tensors`
and :func:`with_cache_tensors`; the host pool's ``layer`` and ``block``)::

    layout="layer"   one allocation per tensor, blocks consecutive in it
    layout="block"   one allocation per group (manager key): page b holds
                     block b of each of the group's tensors, side by side,
                     in order (:func:`block_pages`)

In the block layout ``tensor[b]`` is still block ``b`` of each tensor (a view
whose first stride is the page), and the page as a whole is one contiguous
region: on the CPU, a move between such a cache and a host pool of the block
layout copies whole pages (:class:`~kvfunc.shell.BlockMover`), far fewer and
larger copies when blocks are small (on CUDA the mover still copies each
tensor's blocks).  The group's buffer, not each tensor, starts at the 2 MiB
boundary.  Such tensors are not contiguous, so the compat layer's
``get_contiguous_buf_infos`` refuses them.
"""

from __future__ import annotations

import contextlib
import mmap
from collections.abc import Callable, Mapping, Sequence

import attrs
import torch

from kvfunc.core import (
    CacheAllocator,
    CacheEntry,
    InvalidArgumentError,
    InvalidCacheInfo,
    MissingKeyError,
    MissingTensorError,
    ModelCacheInfo,
    registered_attn_types,
)
from kvfunc.core._internal import as_listed, mamba_entry, positive_field
from kvfunc.shell._device import (
    DeviceError,
    DeviceLike,
    import_torch_npu,
    resolve_device,
    torch_dtype,
)

__all__ = [
    "ALIGNMENT_BYTES",
    "CACHE_LAYOUTS",
    "HUGE_PAGE_BYTES",
    "CacheTensorSpec",
    "block_pages",
    "cache_tensors_by_key",
    "cpu_bytes",
    "create_cache_tensors",
    "empty_aligned",
    "empty_host_addressable",
    "page_layout",
    "plan_cache_tensors",
    "with_cache_tensors",
]

ALIGNMENT_BYTES = 2 * 1024 * 1024
HUGE_PAGE_BYTES = 2 * 1024 * 1024
_LAYOUTS = ["BnBsND", "BnNBsD"]
CACHE_LAYOUTS = ("layer", "block")


@attrs.frozen(slots=True)
class CacheTensorSpec:
    """What one cache tensor will be: its entry, shape, dtype and allocator."""

    layer_idx: int
    entry: CacheEntry
    shape: tuple[int, ...]
    dtype: torch.dtype
    allocator: CacheAllocator


def _num_blocks(block_num_by_type: Mapping[str, int], entry: CacheEntry) -> int:
    key = entry.group_key
    if key not in block_num_by_type:
        msg = f"Missing block_num for manager_key={key} when allocating {entry.cache_name}"
        raise MissingKeyError(msg)
    num = block_num_by_type[key]
    if type(num) is not int or num < 0:
        msg = f"block_num for manager_key={key} must be a non-negative int, but got {num!r}"
        raise InvalidArgumentError(msg)
    return num


def _allocator(entry: CacheEntry) -> CacheAllocator:
    try:
        return CacheAllocator(entry.allocator)
    except ValueError:
        msg = f"{entry.allocator!r} is not a valid CacheAllocator"
        raise InvalidArgumentError(msg) from None


def _paged_shape(entry: CacheEntry, layer_idx: int, num_blocks: int) -> tuple[int, ...]:
    bs = entry.storage_block_size
    layout = entry.cache_layout
    if layout not in _LAYOUTS:
        msg = (f"Creating cache tensor with cache_layout='{layout}' is not supported. "
               f"Supported layouts are: {_LAYOUTS}")
        raise InvalidCacheInfo(msg)
    heads = positive_field(entry, layer_idx, "num_head")
    dims = entry.dim if isinstance(entry.dim, tuple) else (entry.dim,)
    if not all(type(d) is int and d > 0 for d in dims):
        msg = (f"cache {entry.cache_name} in layer {layer_idx} must have positive dim, "
               f"but got {as_listed(entry.dim)}")
        raise InvalidCacheInfo(msg)
    if layout == "BnNBsD":
        return (num_blocks, heads, bs, *dims)
    return (num_blocks, bs, heads, *dims)


def plan_cache_tensors(cache_info: ModelCacheInfo, block_num_by_type: Mapping[str, int], *,
                       require_setter: bool = False) -> list[CacheTensorSpec]:
    """Check every paged entry and say what its tensor will be; allocates nothing.

    Args:
        cache_info: the model's caches.
        block_num_by_type: ``{manager_key: num_blocks}``.
        require_setter: raise, as the seed does, for an entry without a
            ``tensor_setter``.

    Returns:
        One spec per entry with ``needs_block``, in the seed's order.

    Raises:
        InvalidCacheInfo: no setter (when required), bad storage block size,
            layout, heads, dims or attention type, a swapped Mamba cache.
        MissingKeyError: a manager key without a block count.
        InvalidArgumentError: a bad block count or allocator.

    >>> from kvfunc.core import CacheEntry, LayerCacheInfo, ModelCacheInfo
    >>> e = CacheEntry("k", "FullAttention", [2, 8], 4, "bf16", True, block_size=16,
    ...                compress_ratio=4, cache_layout="BnNBsD")
    >>> spec, = plan_cache_tensors(ModelCacheInfo(1, [LayerCacheInfo(0, [e])]),
    ...                            {"FullAttention": 10})
    >>> spec.shape, spec.dtype
    ((10, 4, 4, 2, 8), torch.bfloat16)
    """
    paged_types = set(registered_attn_types())
    specs: list[CacheTensorSpec] = []
    for layer in cache_info.layer_infos:
        idx = layer.layer_idx
        for entry in layer.caches:
            if not entry.needs_block:
                continue
            name = entry.cache_name
            if require_setter and entry.tensor_setter is None:
                raise InvalidCacheInfo(f"CacheEntry {name} in layer {idx} has no tensor_setter")
            num_blocks = _num_blocks(block_num_by_type, entry)
            allocator = _allocator(entry)
            attn_type = entry.attn_type
            if attn_type == "Mamba":
                state = mamba_entry(entry, idx)
                if allocator is not CacheAllocator.HBM:
                    msg = (f"Creating cache tensor with allocator='{entry.allocator}' is not "
                           "supported for attn_type='Mamba'.")
                    raise InvalidCacheInfo(msg)
                shape: tuple[int, ...] = (num_blocks, *state.shape)
            elif attn_type in paged_types:
                shape = _paged_shape(entry, idx, num_blocks)
            else:
                msg = (f"Creating cache tensor for attn_type='{attn_type}' is not supported. "
                       "Please add support in allocate_cache_tensors function.")
                raise InvalidCacheInfo(msg)
            specs.append(CacheTensorSpec(idx, entry, shape, torch_dtype(entry.dtype), allocator))
    return specs


def empty_aligned(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                  alignment: int = ALIGNMENT_BYTES) -> torch.Tensor:
    """An uninitialised contiguous tensor whose ``data_ptr()`` is a multiple of ``alignment``.

    It is a view into a byte buffer ``alignment`` bytes larger than needed; on the
    CPU, from 2 MiB up and for an alignment that divides 2 MiB, it is
    :func:`cpu_bytes` (2 MiB-aligned, advised for transparent huge pages).

    Raises:
        InvalidArgumentError: ``alignment`` is not a positive multiple of the
            dtype's size.
        DeviceError: CPU memory cannot be mapped, or the device's allocator
            broke the alignment.

    >>> t = empty_aligned((3, 5), torch.float16, torch.device("cpu"))
    >>> t.shape, t.data_ptr() % ALIGNMENT_BYTES, t.is_contiguous()
    (torch.Size([3, 5]), 0, True)
    """
    itemsize = _itemsize(dtype)
    if type(alignment) is not int or alignment <= 0 or alignment % itemsize:
        msg = f"alignment must be a positive multiple of {itemsize} bytes, but got {alignment!r}"
        raise InvalidArgumentError(msg)
    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel * itemsize
    if device.type == "cpu" and nbytes >= HUGE_PAGE_BYTES and HUGE_PAGE_BYTES % alignment == 0:
        return cpu_bytes(nbytes).view(dtype).view(shape)
    raw = torch.empty(nbytes + alignment, dtype=torch.uint8, device=device)
    offset = -raw.data_ptr() % alignment
    tensor = raw[offset:offset + nbytes].view(dtype).view(shape)
    if tensor.data_ptr() % alignment:  # only a broken device allocator gets here
        msg = f"cache_tensor not aligned to {alignment} bytes (ptr={tensor.data_ptr()})"
        raise DeviceError(msg)
    return tensor


def cpu_bytes(nbytes: int) -> torch.Tensor:
    """``nbytes`` of CPU memory (zeros) that start on a 2 MiB boundary, advised for huge pages.

    An anonymous mapping, 2 MiB larger than asked (the slack is never touched, so
    it takes no memory).  Where the platform offers it (Linux) the kernel is asked
    (``MADV_HUGEPAGE``) to back the whole 2 MiB pages of the tensor with
    transparent huge pages: a move of blocks scattered over a large cache then
    misses the TLB far less (``benchmarks/README.md``).  A tail shorter than 2 MiB
    and the slack keep ordinary pages, so a size just over a multiple of 2 MiB
    takes no more memory than it asks for.  A kernel that refuses the advice gives
    ordinary pages throughout.  The tensor keeps the mapping alive.

    Raises:
        InvalidArgumentError: ``nbytes`` is not a positive int.
        DeviceError: the memory cannot be mapped.

    >>> t = cpu_bytes(3 << 20)
    >>> t.shape, t.dtype, t.data_ptr() % HUGE_PAGE_BYTES, int(t.sum())
    (torch.Size([3145728]), torch.uint8, 0, 0)
    """
    if type(nbytes) is not int or nbytes <= 0:
        raise InvalidArgumentError(f"nbytes must be a positive int, got {nbytes!r}")
    private = getattr(mmap, "MAP_PRIVATE", None)  # POSIX; elsewhere a plain anonymous map
    flags = {} if private is None else {"flags": private | mmap.MAP_ANONYMOUS}
    try:
        region = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, **flags)
    except (OSError, OverflowError, ValueError) as exc:
        raise DeviceError(f"cannot map {nbytes} bytes of host memory: {exc}") from exc
    raw = torch.frombuffer(region, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE_BYTES
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    whole = nbytes - nbytes % HUGE_PAGE_BYTES
    if advice is not None and whole:
        with contextlib.suppress(OSError):  # a kernel without transparent huge pages
            region.madvise(advice, offset, whole)
    return raw[offset:offset + nbytes]


def empty_host_addressable(shape: tuple[int, ...], dtype: torch.dtype,
                           device: torch.device) -> torch.Tensor:
    """An uninitialised tensor in host memory that ``device`` can address (swapped memory).

    NPU: ``torch_npu.empty_with_swapped_memory`` (a device tensor backed by
    host memory).  CUDA: pinned host memory (page-locked and mapped into the
    device's address space, so kernels and DMA reach it directly).  CPU:
    ordinary host memory.

    >>> empty_host_addressable((2, 3), torch.float32, torch.device("cpu")).device
    device(type='cpu')
    """
    if device.type == "npu":
        npu = import_torch_npu()
        tensor: torch.Tensor = npu.empty_with_swapped_memory(shape, dtype=dtype, device=device)
        return tensor
    if device.type == "cuda":
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    return torch.empty(shape, dtype=dtype, device=device)


def page_layout(parts: Sequence[tuple[str, torch.dtype, tuple[int, ...]]]
                ) -> tuple[tuple[int, ...], int]:
    """Where each part starts in a block-major page, and the page stride (:func:`block_pages`).

    Raises:
        InvalidArgumentError: no parts, or a part whose offset in the page is
            not a multiple of its element size.

    >>> page_layout([("k", torch.float16, (4, 2)), ("v", torch.float32, (3,))])
    ((0, 16), 28)
    """
    if not parts:
        raise InvalidArgumentError("a block-major page needs at least one tensor")
    offsets, largest, at = [], 1, 0
    for name, dtype, shape in parts:
        size = _itemsize(dtype)
        if at % size:
            msg = (f"in the block layout {name} would start at byte {at} of a block, not a "
                   f"multiple of its element size {size}; use layout='layer' (or order the "
                   "tensors by element size, largest first)")
            raise InvalidArgumentError(msg)
        offsets.append(at)
        largest = max(largest, size)
        at += _numel(shape) * size
    return tuple(offsets), -(-at // largest) * largest


def block_pages(parts: Sequence[tuple[str, torch.dtype, tuple[int, ...]]], num_blocks: int,
                alloc: Callable[[int], torch.Tensor]) -> tuple[torch.Tensor, int,
                                                               tuple[torch.Tensor, ...]]:
    """Tensors laid out block-major in one buffer: ``(buffer, page stride, views)``.

    ``parts`` gives each tensor's name, dtype and block shape, in order.
    Page ``b`` of the buffer holds block ``b`` of every tensor side by side,
    in order, without padding between them; the page stride is their bytes
    rounded up to the largest element size (:func:`page_layout`).
    ``alloc(nbytes)`` returns the ``uint8`` buffer (contiguous, at least
    ``num_blocks * stride`` bytes); it is called once everything is checked.

    Raises:
        InvalidArgumentError: as :func:`page_layout`; a negative ``num_blocks``.

    >>> parts = [("k", torch.float16, (4, 2)), ("v", torch.float16, (4, 2))]
    >>> buf, stride, (k, v) = block_pages(parts, 3, lambda n: torch.zeros(n, dtype=torch.uint8))
    >>> stride, k.shape, k.stride(), v.data_ptr() - k.data_ptr()
    (32, torch.Size([3, 4, 2]), (16, 2, 1), 16)
    """
    offsets, stride = page_layout(parts)
    if type(num_blocks) is not int or num_blocks < 0:
        raise InvalidArgumentError(f"num_blocks must be an int >= 0, but got {num_blocks!r}")
    buffer = alloc(num_blocks * stride)
    rows = buffer[:num_blocks * stride].view(num_blocks, stride)
    views = tuple(rows[:, off:off + _numel(shape) * _itemsize(dtype)].view(dtype)
                  .view(num_blocks, *shape)
                  for (_, dtype, shape), off in zip(parts, offsets, strict=True))
    return buffer, stride, views


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def create_cache_tensors(specs: list[CacheTensorSpec], device: DeviceLike, *,
                         layout: str = "layer") -> list[torch.Tensor]:
    """Allocate one tensor per spec, in order (HBM aligned, swapped host-addressable).

    With ``layout="block"`` the specs of one manager key that are not
    swapped share one allocation, block-major (module docstring).

    Raises:
        InvalidArgumentError: an unknown layout; in the block layout, specs
            of one manager key with different block counts, or a part that
            would be misaligned (:func:`block_pages`).

    >>> from kvfunc.core import CacheEntry, LayerCacheInfo, ModelCacheInfo
    >>> e = CacheEntry("k", "FullAttention", 8, 2, "fp32", True, block_size=4)
    >>> specs = plan_cache_tensors(ModelCacheInfo(1, [LayerCacheInfo(0, [e])]),
    ...                            {"FullAttention": 3})
    >>> [t.shape for t in create_cache_tensors(specs, "cpu")]
    [torch.Size([3, 4, 2, 8])]
    >>> specs = plan_cache_tensors(ModelCacheInfo(1, [LayerCacheInfo(0, [e]),
    ...                                               LayerCacheInfo(1, [e])]),
    ...                            {"FullAttention": 3})
    >>> a, b = create_cache_tensors(specs, "cpu", layout="block")
    >>> a.shape, a.stride(0), b.data_ptr() - a.data_ptr()
    (torch.Size([3, 4, 2, 8]), 128, 256)
    """
    if type(layout) is not str or layout not in CACHE_LAYOUTS:
        msg = f"unknown layout {layout!r}; expected one of {CACHE_LAYOUTS}"
        raise InvalidArgumentError(msg)
    dev = resolve_device(device)
    paged: dict[str, list[int]] = {}
    if layout == "block":
        for i, s in enumerate(specs):
            if s.allocator is not CacheAllocator.SWAPPED_MEMORY:
                paged.setdefault(s.entry.group_key, []).append(i)
    planned = []
    for key, idx in paged.items():  # every key checked before anything is allocated
        counts = {specs[i].shape[0] for i in idx}
        if len(counts) != 1:
            msg = f"the specs of manager_key={key} have different block counts {sorted(counts)}"
            raise InvalidArgumentError(msg)
        parts = [(f"layer {specs[i].layer_idx} {specs[i].entry.cache_name}", specs[i].dtype,
                  specs[i].shape[1:]) for i in idx]
        page_layout(parts)
        planned.append((idx, parts, counts.pop()))
    views: dict[int, torch.Tensor] = {}
    for idx, parts, num_blocks in planned:
        _, _, made = block_pages(parts, num_blocks,
                                 lambda n: empty_aligned((n,), torch.uint8, dev))
        views.update(zip(idx, made, strict=True))
    return [views[i] if i in views
            else empty_host_addressable(s.shape, s.dtype, dev)
            if s.allocator is CacheAllocator.SWAPPED_MEMORY
            else empty_aligned(s.shape, s.dtype, dev) for i, s in enumerate(specs)]


def with_cache_tensors(cache_info: ModelCacheInfo, block_num_by_type: Mapping[str, int],
                       device: DeviceLike = "auto", *, layout: str = "layer"
                       ) -> ModelCacheInfo:
    """A new ``ModelCacheInfo`` whose paged entries carry freshly allocated tensors.

    The pure twin of ``kvfunc.compat.allocate_cache_tensors``: the input
    records are left as they were, no ``tensor_setter`` is required or
    called, and an entry object used by several layers gets one tensor per
    use.  Tensors are uninitialised.  ``layout`` is as in
    :func:`create_cache_tensors`.

    Raises:
        InvalidCacheInfo, MissingKeyError, InvalidArgumentError: as
            :func:`plan_cache_tensors` and :func:`create_cache_tensors`,
            before anything is allocated.

    >>> from kvfunc.core import CacheEntry, LayerCacheInfo, ModelCacheInfo
    >>> e = CacheEntry("k", "FullAttention", 8, 2, "fp16", True, block_size=4)
    >>> info = ModelCacheInfo(1, [LayerCacheInfo(0, [e])])
    >>> new = with_cache_tensors(info, {"FullAttention": 5}, "cpu")
    >>> new.layer_infos[0].caches[0].tensor.shape, e.tensor, new == info
    (torch.Size([5, 4, 2, 8]), None, True)
    """
    specs = plan_cache_tensors(cache_info, block_num_by_type)
    tensors = iter(create_cache_tensors(specs, device, layout=layout))
    layers = []
    for layer in cache_info.layer_infos:
        caches = tuple(attrs.evolve(e, tensor=next(tensors)) if e.needs_block else e
                       for e in layer.caches)
        layers.append(attrs.evolve(layer, caches=caches))
    return attrs.evolve(cache_info, layer_infos=layers)


def cache_tensors_by_key(cache_info: ModelCacheInfo) -> dict[str, dict[str, torch.Tensor]]:
    """``{manager_key: {"layer <i> <cache_name>": tensor}}`` of every paged entry.

    The shape the block operations (:func:`kvfunc.shell.apply_delta`) take.

    Raises:
        MissingTensorError: a paged entry has no tensor yet.

    >>> from kvfunc.core import CacheEntry, LayerCacheInfo, ModelCacheInfo
    >>> e = CacheEntry("k", "FullAttention", 8, 2, "fp16", True, block_size=4)
    >>> info = with_cache_tensors(ModelCacheInfo(1, [LayerCacheInfo(0, [e])]),
    ...                           {"FullAttention": 5}, "cpu")
    >>> {k: list(v) for k, v in cache_tensors_by_key(info).items()}
    {'FullAttention': ['layer 0 k']}
    """
    out: dict[str, dict[str, torch.Tensor]] = {}
    for layer in cache_info.layer_infos:
        for entry in layer.caches:
            if not entry.needs_block:
                continue
            if entry.tensor is None:
                msg = (f"CacheEntry {entry.cache_name} in layer {layer.layer_idx} has no "
                       "tensor \u2014 allocate_cache_tensors must run first.")
                raise MissingTensorError(msg)
            out.setdefault(entry.group_key, {})[
                f"layer {layer.layer_idx} {entry.cache_name}"] = entry.tensor
    return out
