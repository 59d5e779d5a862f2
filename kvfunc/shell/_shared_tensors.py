"""Cache tensors of one block pool shared by every group: views that overlay each other.

Theory of operation
-------------------
With ``layout="shared"`` a block id is one page of the pool, whichever group
holds it (:func:`kvfunc.shared_page_layout`).  The memory is one buffer per
*layer slot*: slot ``j`` holds ``num_blocks`` pages of ``slot_bytes[j]``
bytes, and the ``j``-th layer of every group lives in it.  Each cache entry
gets a view of its slot: block ``b`` of the entry is the entry's bytes at its
offset inside page ``b``::

    slot j:   | page 0             | page 1             | ...     (slot_bytes[j] each)
    full, layer 2j+1:  [ K    | V    ]   [ K    | V    ]
    swa,  layer 2j:    [ K    | V    ]   [ K    | V    ]          the same bytes

    entry view: (num_blocks, *block shape), view[b] = its bytes in page b
                (contiguous; consecutive blocks slot_bytes[j] apart)

Two groups never hold the same block id at once, so the overlay is safe:
what one group writes into its blocks is never read through another's.  The
views are ordinary tensors with the per-type shapes (``tensor[b]`` is block
``b``), so block tables, slot mappings, :func:`~kvfunc.shell.apply_delta`
and the host tier work on them unchanged; only their first stride differs
when a slot's page holds more than the entry.  Device buffers start at a
2 MiB boundary.  ``swapped_memory`` entries are not overlaid: each gets a
host tensor of its own, as :func:`~kvfunc.shell.with_cache_tensors` makes.

A tier below the device keeps pages, not entries: block ``b`` is page ``b``
of every slot, whichever group holds it.  :func:`shared_page_buffers` finds
the slot buffers under the views, as ``(num_blocks, page)`` byte tensors, so
a :class:`~kvfunc.shell.HostBlockPool` made like them and a
:class:`~kvfunc.shell.BlockMover` over them move each block once, a page per
slot (over the views, each page would be copied once per group).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import pairwise
from typing import Any

import attrs
import torch

from kvfunc.core import (
    MAX_NUM_BLOCKS,
    CacheAllocator,
    InvalidArgumentError,
    InvalidTypeError,
    ModelCacheInfo,
    PageEntry,
    SharedPageLayout,
    shared_page_layout,
)
from kvfunc.shell._blocks import TensorSet
from kvfunc.shell._device import DeviceLike, resolve_device
from kvfunc.shell._tensors import (
    CacheTensorSpec,
    empty_aligned,
    empty_host_addressable,
    plan_cache_tensors,
)

__all__ = ["create_shared_cache_tensors", "overlay_view", "shared_page_buffers",
           "with_shared_cache_tensors"]


def _check_num_blocks(num_blocks: object) -> int:
    if type(num_blocks) is not int or not 0 <= num_blocks <= MAX_NUM_BLOCKS:
        msg = f"num_blocks must be an int in 0..{MAX_NUM_BLOCKS}, but got {num_blocks!r}"
        raise InvalidArgumentError(msg)
    return num_blocks


def overlay_view(buffer: torch.Tensor, offset: int, block_shape: tuple[int, ...],
                 dtype: torch.dtype) -> torch.Tensor:
    """A ``(num_blocks, *block_shape)`` view of ``dtype`` into a ``(num_blocks, page)`` byte buffer.

    Block ``b`` of the view is the bytes ``offset ..`` of page ``b``.

    Raises:
        InvalidArgumentError: a buffer that is not 2-D ``uint8``, an offset not a
            multiple of the element size, or blocks that pass the page's end.

    >>> buf = torch.zeros(3, 8, dtype=torch.uint8)
    >>> v = overlay_view(buf, 4, (2,), torch.int16)
    >>> v[1] = 257; buf[1].tolist()
    [0, 0, 0, 0, 1, 1, 1, 1]
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = 1
    for d in block_shape:
        numel *= d
    nbytes = numel * itemsize
    if buffer.dim() != 2 or buffer.dtype != torch.uint8:
        msg = f"the buffer must be a 2-D uint8 tensor, but got {buffer.dtype} {list(buffer.shape)}"
        raise InvalidArgumentError(msg)
    page = buffer.shape[1]
    if type(offset) is not int or offset < 0 or offset % itemsize or page % itemsize \
            or offset + nbytes > page:
        msg = (f"a block of {nbytes} bytes of {dtype} at offset {offset!r} does not fit a page "
               f"of {page} bytes at its element size")
        raise InvalidArgumentError(msg)
    rows = buffer[:, offset:offset + nbytes].view(dtype)
    return rows.view(buffer.shape[0], *block_shape)


def create_shared_cache_tensors(specs: list[CacheTensorSpec], layout: SharedPageLayout,
                                num_blocks: int, device: DeviceLike) -> list[torch.Tensor]:
    """One tensor per spec: overlaid views for device entries, own tensors for swapped ones.

    ``specs`` come from :func:`~kvfunc.shell.plan_cache_tensors` of the
    ``cache_info`` that ``layout`` was made from, every group at ``num_blocks``.

    Raises:
        InvalidArgumentError: specs and layout that do not describe the same entries.

    >>> import kvfunc as kf
    >>> from kvfunc.shell import plan_cache_tensors
    >>> full = kf.CacheEntry("k", "FullAttention", 8, 2, "fp32", True, block_size=4)
    >>> swa = kf.CacheEntry("k", "SlidingWindow", 8, 2, "fp32", True, block_size=4,
    ...                     sliding_window=8)
    >>> info = kf.ModelCacheInfo(2, [kf.LayerCacheInfo(0, [full]), kf.LayerCacheInfo(1, [swa])])
    >>> specs = plan_cache_tensors(info, {"FullAttention": 6, "SlidingWindow": 6})
    >>> a, b = create_shared_cache_tensors(specs, kf.shared_page_layout(info), 6, "cpu")
    >>> a.shape, a.data_ptr() == b.data_ptr()
    (torch.Size([6, 4, 2, 8]), True)
    """
    n = _check_num_blocks(num_blocks)
    dev = resolve_device(device)
    device_specs = [s for s in specs if s.allocator is CacheAllocator.HBM]
    if len(device_specs) != len(layout.entries):
        msg = (f"{len(device_specs)} device cache entries, but the page layout places "
               f"{len(layout.entries)}")
        raise InvalidArgumentError(msg)
    places = dict(zip(map(id, device_specs), layout.entries, strict=True))
    for spec in device_specs:
        _check_place(spec, places[id(spec)], n)
    buffers = [empty_aligned((n, page), torch.uint8, dev) for page in layout.slot_bytes]
    out = []
    for spec in specs:
        place = places.get(id(spec))
        if place is None:
            out.append(empty_host_addressable(spec.shape, spec.dtype, dev))
        else:
            out.append(overlay_view(buffers[place.slot], place.offset, spec.shape[1:], spec.dtype))
    return out


def _check_place(spec: CacheTensorSpec, place: PageEntry, num_blocks: int) -> None:
    entry = spec.entry
    nbytes = spec.dtype.itemsize
    for d in spec.shape[1:]:
        nbytes *= d
    mine = (entry.group_key, spec.layer_idx, entry.cache_name, num_blocks, nbytes)
    placed = (place.manager_key, place.layer_idx, place.cache_name, spec.shape[0],
              place.block_bytes)
    if mine != placed:
        msg = (f"cache {entry.cache_name} of layer {spec.layer_idx} does not match its place "
               f"in the page layout: (key, layer, name, blocks, block bytes) {mine} vs "
               f"{placed}")
        raise InvalidArgumentError(msg)


def with_shared_cache_tensors(cache_info: ModelCacheInfo, num_blocks: int,
                              device: DeviceLike = "auto") -> ModelCacheInfo:
    """A new ``ModelCacheInfo`` whose paged entries carry the tensors of one shared pool.

    The twin of :func:`~kvfunc.shell.with_cache_tensors` for a state made with
    ``layout="shared"`` over ``num_blocks`` blocks (see the module docstring):
    the groups' tensors overlay each other in one buffer per layer slot, so
    the pool costs ``num_blocks * page_bytes`` bytes
    (:func:`kvfunc.calculate_shared_block_num` gives both).  The input
    records are left as they were; tensors are uninitialised.

    Raises:
        InvalidArgumentError: a bad ``num_blocks``; as
            :func:`~kvfunc.shell.plan_cache_tensors`, before anything is allocated.
        InvalidCacheInfo: as :func:`kvfunc.shared_page_layout` and
            :func:`~kvfunc.shell.plan_cache_tensors`.

    >>> import kvfunc as kf
    >>> full = kf.CacheEntry("k", "FullAttention", 8, 2, "fp16", True, block_size=4)
    >>> swa = kf.CacheEntry("k", "SlidingWindow", 8, 2, "fp16", True, block_size=4,
    ...                     sliding_window=8)
    >>> info = kf.ModelCacheInfo(2, [kf.LayerCacheInfo(0, [full]), kf.LayerCacheInfo(1, [swa])])
    >>> new = with_shared_cache_tensors(info, 5, "cpu")
    >>> a, b = (layer.caches[0].tensor for layer in new.layer_infos)
    >>> a.shape, a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    (torch.Size([5, 4, 2, 8]), True)
    """
    n = _check_num_blocks(num_blocks)
    layout = shared_page_layout(cache_info)
    specs = plan_cache_tensors(cache_info, dict.fromkeys(layout.manager_keys, n))
    tensors = iter(create_shared_cache_tensors(specs, layout, n, device))
    layers = []
    for layer in cache_info.layer_infos:
        caches = tuple(attrs.evolve(e, tensor=next(tensors)) if e.needs_block else e
                       for e in layer.caches)
        layers.append(attrs.evolve(layer, caches=caches))
    return attrs.evolve(cache_info, layer_infos=layers)


def shared_page_buffers(tensors: TensorSet) -> list[torch.Tensor]:
    """The slot buffers under overlaid views: one ``(num_blocks, page)`` byte tensor per slot.

    ``tensors`` are the device entries' views (of a ``ModelCacheInfo`` made by
    :func:`with_shared_cache_tensors`, or of :func:`create_shared_cache_tensors`,
    swapped entries left out).  Views over one storage make one slot; its
    page is their first stride, and it starts at the lowest byte any of them
    starts at.  Row ``b`` of a buffer holds block ``b`` of every view over it.

    Raises:
        InvalidTypeError: ``tensors`` is not a mapping or sequence of tensors.
        InvalidArgumentError: no tensor, a view of no block, views of one storage
            that disagree on the number of blocks or the page, a block that is
            not contiguous or does not fit its page, pages past the storage's
            end, or buffers that overlap in memory.

    >>> import kvfunc as kf
    >>> full = kf.CacheEntry("k", "FullAttention", 8, 2, "fp32", True, block_size=4)
    >>> swa = kf.CacheEntry("k", "SlidingWindow", 8, 2, "fp32", True, block_size=4,
    ...                     sliding_window=8)
    >>> info = kf.ModelCacheInfo(2, [kf.LayerCacheInfo(0, [full]), kf.LayerCacheInfo(1, [swa])])
    >>> views = [l.caches[0].tensor for l in with_shared_cache_tensors(info, 6, "cpu").layer_infos]
    >>> [tuple(b.shape) for b in shared_page_buffers(views)]
    [(6, 256)]
    >>> _ = views[1][3].fill_(1.0); bool(shared_page_buffers(views)[0][3].any())
    True
    """
    views = list(_tensors_of(tensors))
    if not views or any(t.dim() < 2 or not t.shape[0] for t in views):
        raise InvalidArgumentError("shared_page_buffers needs views of at least one block each")
    slots: dict[tuple[Any, ...], list[torch.Tensor]] = {}
    for t in views:
        key = (t.device, t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        slots.setdefault(key, []).append(t)
    out = []
    for (device, _, nbytes), members in slots.items():
        first = members[0]
        n, page = first.shape[0], _page_of(first)
        start = min(t.storage_offset() * t.element_size() for t in members)
        for t in members:
            block = t.element_size() * t[0].numel()
            at = t.storage_offset() * t.element_size() - start
            if (t.shape[0] != n or _page_of(t) != page or not t[0].is_contiguous()
                    or at + block > page):
                msg = (f"views over one buffer must share their number of blocks and page, "
                       f"each block contiguous inside it: a view of shape {tuple(t.shape)} "
                       f"and strides {t.stride()} does not fit a page of {page} bytes at "
                       f"byte {at}")
                raise InvalidArgumentError(msg)
        if start + n * page > nbytes:
            raise InvalidArgumentError(f"{n} pages of {page} bytes from byte {start} pass the "
                                       f"end of a buffer of {nbytes} bytes")
        buffer = torch.empty(0, dtype=torch.uint8, device=device)
        out.append(buffer.set_(first.untyped_storage(), start, (n, page), (page, 1)))
    spans = sorted((b.device.type, b.data_ptr(), b.data_ptr() + b.shape[0] * b.shape[1])
                   for b in out)
    for (dev_a, _, end), (dev_b, begin, _) in pairwise(spans):
        if dev_a == dev_b and begin < end:  # two storages over the same memory
            raise InvalidArgumentError("views of different buffers overlap in memory: their "
                                       "pages would overwrite each other")
    return out


def _page_of(t: torch.Tensor) -> int:
    return t.stride(0) * t.element_size()


def _tensors_of(tensors: object) -> list[torch.Tensor]:
    items = (list(tensors.values()) if isinstance(tensors, Mapping)
             else list(tensors) if isinstance(tensors, Sequence) and not isinstance(
                 tensors, str | bytes) else None)
    if items is None or not all(isinstance(t, torch.Tensor) for t in items):
        raise InvalidTypeError(f"tensors must be a mapping or sequence of tensors, got "
                               f"{type(tensors).__name__}")
    return items
