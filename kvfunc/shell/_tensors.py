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
"""

from __future__ import annotations

import contextlib
import mmap
from collections.abc import Mapping

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
    "HUGE_PAGE_BYTES",
    "CacheTensorSpec",
    "cache_tensors_by_key",
    "cpu_bytes",
    "create_cache_tensors",
    "empty_aligned",
    "empty_host_addressable",
    "plan_cache_tensors",
    "with_cache_tensors",
]

ALIGNMENT_BYTES = 2 * 1024 * 1024
HUGE_PAGE_BYTES = 2 * 1024 * 1024
_LAYOUTS = ["BnBsND", "BnNBsD"]


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
    itemsize = torch.empty((), dtype=dtype).element_size()
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


def create_cache_tensors(specs: list[CacheTensorSpec], device: DeviceLike
                         ) -> list[torch.Tensor]:
    """Allocate one tensor per spec, in order (HBM aligned, swapped host-addressable).

    >>> from kvfunc.core import CacheEntry, LayerCacheInfo, ModelCacheInfo
    >>> e = CacheEntry("k", "FullAttention", 8, 2, "fp32", True, block_size=4)
    >>> specs = plan_cache_tensors(ModelCacheInfo(1, [LayerCacheInfo(0, [e])]),
    ...                            {"FullAttention": 3})
    >>> [t.shape for t in create_cache_tensors(specs, "cpu")]
    [torch.Size([3, 4, 2, 8])]
    """
    dev = resolve_device(device)
    return [empty_host_addressable(s.shape, s.dtype, dev)
            if s.allocator is CacheAllocator.SWAPPED_MEMORY
            else empty_aligned(s.shape, s.dtype, dev) for s in specs]


def with_cache_tensors(cache_info: ModelCacheInfo, block_num_by_type: Mapping[str, int],
                       device: DeviceLike = "auto") -> ModelCacheInfo:
    """A new ``ModelCacheInfo`` whose paged entries carry freshly allocated tensors.

    The pure twin of ``kvfunc.compat.allocate_cache_tensors``: the input
    records are left as they were, no ``tensor_setter`` is required or
    called, and an entry object used by several layers gets one tensor per
    use.  Tensors are uninitialised.

    Raises:
        InvalidCacheInfo, MissingKeyError, InvalidArgumentError: as
            :func:`plan_cache_tensors`, before anything is allocated.

    >>> from kvfunc.core import CacheEntry, LayerCacheInfo, ModelCacheInfo
    >>> e = CacheEntry("k", "FullAttention", 8, 2, "fp16", True, block_size=4)
    >>> info = ModelCacheInfo(1, [LayerCacheInfo(0, [e])])
    >>> new = with_cache_tensors(info, {"FullAttention": 5}, "cpu")
    >>> new.layer_infos[0].caches[0].tensor.shape, e.tensor, new == info
    (torch.Size([5, 4, 2, 8]), None, True)
    """
    specs = plan_cache_tensors(cache_info, block_num_by_type)
    tensors = iter(create_cache_tensors(specs, device))
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
