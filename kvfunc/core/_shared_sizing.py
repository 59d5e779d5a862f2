"""Sizing of one block pool shared by every group (vLLM's hybrid layout), pure.

Theory of operation
-------------------
With ``layout="shared"`` every group draws block ids from one pool, so a
block id must mean the same amount of memory whichever group holds it: the
pool has one *page* size.  The page is laid out by **layer slots**, as
vLLM lays hybrid models out: the ``j``-th layer of every group shares slot
``j``, one buffer of ``num_blocks`` pages of the slot's size, and block
``b`` of any group's ``j``-th layer is page ``b`` of slot ``j``::

    gpt-oss (sliding layers 0, 2, ...; full layers 1, 3, ...), K and V per layer:

    slot 0   | blk 0 [ K | V ] | blk 1 [ K | V ] | ... |   swa: layer 0    full: layer 1
    slot 1   | blk 0 [ K | V ] | blk 1 [ K | V ] | ... |   swa: layer 2    full: layer 3
    ...
    page = sum of the slots' pages = bytes one block id costs

    slot page  = max over groups of the bytes one block of the group's j-th layer takes
    group page = the bytes one block of the group takes (its entries, all its layers)

A group's entries in a layer sit one after the other inside the slot's
page (each at a multiple of its element size).  Because ids are unique
across the pool's groups, two groups never hold the same page at once, so
their tensors may overlay each other.  When every group has as many layers
of the same size (gpt-oss: 18 and 18), every group page equals the pool's
page and nothing is wasted: that is vLLM's uniform-page rule.  Otherwise a
group whose page is smaller leaves ``page - group page`` bytes of each
block it holds unused (:attr:`SharedPageLayout.padding`); vLLM avoids that by
splitting a type's layers into several groups of equal size or by raising
a group's block size, which a model description does with ``manager_key``
and ``block_size``.

Only device (``hbm``) entries are laid out in pages; a ``swapped_memory``
entry keeps a tensor of its own and costs no device memory, as in
:func:`~kvfunc.calculate_block_num`.

The block count: the budget ``total x mem_fraction_static - used - extra``
(no fixed-block reservation: sliding windows and Mamba states draw from the
pool too) divided by the page; offline, every group's need for the batch.
Either way the pool must hold the fixed groups' batch and, online, one
prefill of ``max_prefill_tokens`` in every paged group, at once.  For a
model with one paged group the count is the seed's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import attrs

from kvfunc.core._cache_info import CacheAllocator, CacheEntry, MambaCacheEntry, ModelCacheInfo
from kvfunc.core._dtypes import dtype_itemsize
from kvfunc.core._errors import (
    InsufficientMemoryError,
    InvalidArgumentError,
    InvalidCacheInfo,
    InvalidTypeError,
)
from kvfunc.core._sizing import (
    calculate_fixed_block_memory_bytes,
    check_memory,
    check_options,
    min_across,
)
from kvfunc.core._sizing_config import SizingConfig
from kvfunc.core._validate import FIXED_BLOCK_ATTN_TYPES, positive_field, validate_cache_info

__all__ = ["GroupPage", "PageEntry", "SharedPageLayout", "SharedPoolSizing",
           "calculate_shared_block_num", "entry_block_bytes", "shared_page_layout"]


@attrs.frozen
class PageEntry:
    """Where one device cache entry's blocks live in a shared pool's pages.

    Attributes:
        manager_key: the entry's group.
        layer_idx: its layer.
        cache_name: its name.
        slot: the layer slot (its layer is the ``slot``-th layer of its group).
        offset: bytes from the start of a block's page in the slot.
        block_bytes: bytes one block of the entry takes.
    """

    manager_key: str
    layer_idx: int
    cache_name: str
    slot: int
    offset: int
    block_bytes: int


@attrs.frozen
class GroupPage:
    """One group of a shared pool: its block size, layers and page.

    Attributes:
        manager_key: the group.
        attn_type: its attention type.
        block_size: tokens per block (1 for a Mamba state).
        num_layers: layers with a device entry of the group (the slots it uses).
        block_bytes: bytes one block of the group takes: its device entries, all layers.
    """

    manager_key: str
    attn_type: str
    block_size: int
    num_layers: int
    block_bytes: int


@attrs.frozen
class SharedPageLayout:
    """The page of a shared pool: slots, groups and where every device entry lies.

    >>> e = CacheEntry("k", "FullAttention", 64, 2, "bf16", True, block_size=16)
    >>> from kvfunc.core._cache_info import LayerCacheInfo
    >>> layout = shared_page_layout(ModelCacheInfo(1, [LayerCacheInfo(0, [e])]))
    >>> layout.slot_bytes, layout.page_bytes, layout.padding("FullAttention")
    ((4096,), 4096, 0)
    """

    slot_bytes: tuple[int, ...]
    groups: tuple[GroupPage, ...]
    entries: tuple[PageEntry, ...]

    @property
    def page_bytes(self) -> int:
        """Bytes one block id costs: the sum of the slots' pages."""
        return sum(self.slot_bytes)

    @property
    def manager_keys(self) -> tuple[str, ...]:
        """The groups' keys in order of first appearance."""
        return tuple(g.manager_key for g in self.groups)

    def group(self, manager_key: str) -> GroupPage:
        """The group of ``manager_key`` (:class:`~kvfunc.InvalidArgumentError` if unknown)."""
        for g in self.groups:
            if g.manager_key == manager_key:
                return g
        msg = f"no group {manager_key!r} in the layout; groups: {list(self.manager_keys)}"
        raise InvalidArgumentError(msg)

    def padding(self, manager_key: str) -> int:
        """Bytes of each block the group holds that it does not use."""
        return self.page_bytes - self.group(manager_key).block_bytes


def entry_block_bytes(cache: CacheEntry, layer_idx: int) -> int:
    """Bytes one block of ``cache`` takes in its tensor (a stored block, compression applied).

    >>> entry_block_bytes(CacheEntry("k", "FullAttention", [2, 8], 4, "fp16", True,
    ...                              block_size=16, compress_ratio=4), 0)
    512
    """
    itemsize = dtype_itemsize(cache.dtype)
    if isinstance(cache, MambaCacheEntry):
        return cache.cache_dim_numel() * itemsize
    positive_field(cache, layer_idx, "compress_ratio")
    heads = positive_field(cache, layer_idx, "num_head")
    return cache.storage_block_size * heads * cache.cache_dim_numel() * itemsize


def _device_entries(info: ModelCacheInfo) -> Iterator[tuple[int, int, CacheEntry]]:
    """``(layer position, layer_idx, entry)`` of every entry with ``needs_block``, checked."""
    kinds: dict[str, tuple[str, int | None]] = {}
    for pos, layer in enumerate(info.layer_infos):
        for cache in layer.caches:
            if cache.needs_block:
                yield pos, layer.layer_idx, _checked_kind(kinds, layer.layer_idx, cache)


def _checked_kind(kinds: dict[str, tuple[str, int | None]], layer_idx: int,
                  cache: CacheEntry) -> CacheEntry:
    """``cache``, once its group is known to keep one attention type and block size."""
    key, kind = cache.group_key, (cache.attn_type, cache.block_size)
    seen = kinds.setdefault(key, kind)
    if seen != kind:
        msg = (f"caches of group {key!r} must share one attn_type and block_size, but "
               f"got {seen[0]}/{seen[1]} and {kind[0]}/{kind[1]} (layer {layer_idx}, "
               f"cache {cache.cache_name})")
        raise InvalidCacheInfo(msg)
    return cache


def shared_page_layout(cache_info: ModelCacheInfo) -> SharedPageLayout:
    """The page of a pool shared by every group of ``cache_info`` (see the module docstring).

    Raises:
        InvalidTypeError: ``cache_info`` is not a ``ModelCacheInfo``.
        InvalidCacheInfo: what :func:`~kvfunc.validate_cache_info` refuses, or a
            group whose caches differ in attention type or block size.

    >>> from kvfunc.core._cache_info import LayerCacheInfo
    >>> full = CacheEntry("k", "FullAttention", 64, 2, "bf16", True, block_size=16)
    >>> swa = CacheEntry("k", "SlidingWindow", 64, 1, "bf16", True, block_size=16,
    ...                  sliding_window=128)
    >>> info = ModelCacheInfo(3, [LayerCacheInfo(0, [swa]), LayerCacheInfo(1, [full]),
    ...                           LayerCacheInfo(2, [swa])])
    >>> layout = shared_page_layout(info)
    >>> layout.slot_bytes, [(g.manager_key, g.block_bytes) for g in layout.groups]
    ((4096, 2048), [('SlidingWindow', 4096), ('FullAttention', 4096)])
    """
    if not isinstance(cache_info, ModelCacheInfo):
        msg = f"cache_info must be a ModelCacheInfo, but got {type(cache_info).__name__}"
        raise InvalidTypeError(msg)
    validate_cache_info(cache_info)
    placed: list[tuple[str, int, CacheEntry, int, int]] = []  # key, layer, entry, slot, bytes
    layers: dict[str, list[int]] = {}
    kinds: dict[str, tuple[str, int]] = {}
    for pos, layer_idx, cache in _device_entries(cache_info):
        key = cache.group_key
        seen = layers.setdefault(key, [])
        kinds.setdefault(key, (cache.attn_type, cache.block_size or 1))
        if CacheAllocator(cache.allocator) is not CacheAllocator.HBM:
            continue
        if not seen or seen[-1] != pos:
            seen.append(pos)
        placed.append((key, layer_idx, cache, len(seen) - 1, entry_block_bytes(cache, layer_idx)))
    used: dict[tuple[str, int], int] = {}  # bytes of a group's slot page used so far
    units: dict[int, int] = {}  # the lcm of the element sizes in a slot
    entries = []
    for key, layer_idx, cache, slot, nbytes in placed:
        itemsize = dtype_itemsize(cache.dtype)
        offset = -(-used.get((key, slot), 0) // itemsize) * itemsize
        used[(key, slot)] = offset + nbytes
        units[slot] = math.lcm(units.get(slot, 1), itemsize)
        entries.append(PageEntry(key, layer_idx, cache.cache_name, slot, offset, nbytes))
    slot_bytes = [0] * len(units)
    for (_, slot), nbytes in used.items():
        slot_bytes[slot] = max(slot_bytes[slot], nbytes)
    slot_bytes = [-(-n // units[j]) * units[j] for j, n in enumerate(slot_bytes)]
    groups = tuple(GroupPage(key, kinds[key][0], kinds[key][1], len(idx),
                             sum(e.block_bytes for e in entries if e.manager_key == key))
                   for key, idx in layers.items())
    return SharedPageLayout(tuple(slot_bytes), groups, tuple(entries))


@attrs.frozen
class SharedPoolSizing:
    """How many blocks a shared pool gets for a budget, and its page.

    Attributes:
        num_blocks: the pool's blocks, the null block included.
        layout: the page: slots, groups and where every device entry lies.
    """

    num_blocks: int
    layout: SharedPageLayout

    @property
    def page_bytes(self) -> int:
        """Device bytes one block id costs."""
        return self.layout.page_bytes

    @property
    def total_bytes(self) -> int:
        """Device bytes of the whole pool, the null block included."""
        return self.num_blocks * self.layout.page_bytes

    @property
    def block_num_by_type(self) -> dict[str, int]:
        """``{manager_key: num_blocks}``: every group states the pool's size.

        What ``KVState.from_cache_info(info, ..., layout="shared")`` takes.
        """
        return dict.fromkeys(self.layout.manager_keys, self.num_blocks)

    def tokens(self, manager_key: str) -> int:
        """Tokens the group's usable blocks would hold if it held all of them."""
        return (self.num_blocks - 1) * self.layout.group(manager_key).block_size


def _fixed_needs(config: SizingConfig, info: ModelCacheInfo) -> dict[str, int]:
    """Blocks each fixed-block group needs for the batch, without a null block."""
    counts, _ = calculate_fixed_block_memory_bytes(config, info)
    return {key: n - 1 for key, n in counts.items()}


def _paged(layout: SharedPageLayout) -> list[GroupPage]:
    return [g for g in layout.groups if g.attn_type not in FIXED_BLOCK_ATTN_TYPES]


def _offline_num_blocks(config: SizingConfig, layout: SharedPageLayout, fixed: dict[str, int],
                        length: int, free: int, extra: int) -> int:
    batch, dp_group = config.batch_size_per_dp_rank, config.offline_prefill_dp_group_size
    need = sum(fixed.values())
    for g in _paged(layout):
        split = dp_group if dp_group > 1 and g.attn_type == "FullAttention" else 1
        need += -(-length // g.block_size) * (batch // split)
    num_blocks = need + 1
    required = num_blocks * layout.page_bytes + extra
    if required > free:
        msg = (f"Insufficient memory for offline mode cache allocation. required={required}, "
               f"free={free}, extra_reserved={extra} ({num_blocks} blocks of "
               f"{layout.page_bytes} bytes). "
               "Please reduce the length of requests or the total batch size.")
        raise InsufficientMemoryError(msg)
    return num_blocks


def _online_num_blocks(config: SizingConfig, layout: SharedPageLayout, fixed: dict[str, int],
                       free: int, total: int, extra: int,
                       min_across_ranks: Callable[[int], int] | None) -> int:
    used, fraction, page = total - free, config.mem_fraction_static, layout.page_bytes
    available = total * fraction - used - extra  # float arithmetic, as the seed's
    if available <= 0:
        msg = (f"No available memory for the shared pool. used={used}, extra_reserved={extra}, "
               f"total={total}, mem_fraction_static={fraction}, "
               "Please boost mem_fraction_static in yaml.")
        raise InsufficientMemoryError(msg)
    if page <= 0:
        msg = ("No HBM-backed cache entry remains for dynamic block sizing. "
               "Please use offline mode or keep at least one cache entry in HBM.")
        raise InsufficientMemoryError(msg)
    # Every rank of a TP group must hand out the same ids: each takes the smallest pool.
    num_blocks = min_across(min_across_ranks, int(available // page))
    # As the seed: the null block stores nothing, and a prefill needs one slot past it.
    prefill = sum(-(-(config.max_prefill_tokens + 1) // g.block_size) for g in _paged(layout))
    required = 1 + sum(fixed.values()) + prefill
    if num_blocks < required:
        msg = ("Current memory cannot satisfy max input length requirement. "
               f"shared pool blocks={num_blocks} of {page} bytes, required blocks={required} "
               f"(null block, fixed-block groups {sum(fixed.values())}, a prefill of "
               f"{config.max_prefill_tokens} tokens in every paged group {prefill})")
        raise InsufficientMemoryError(msg)
    return num_blocks


def calculate_shared_block_num(
    config: SizingConfig,
    cache_info: ModelCacheInfo,
    *,
    free_memory_bytes: int,
    total_memory_bytes: int,
    offline_max_len: int | None = None,
    extra_reserved_memory_bytes: int = 0,
    min_across_ranks: Callable[[int], int] | None = None,
) -> SharedPoolSizing:
    """Blocks of one pool shared by every group of ``cache_info`` (``layout="shared"``).

    The page follows :func:`shared_page_layout`.  Online, the budget ``total
    * mem_fraction_static - used - extra`` over the page gives the blocks, the
    null block included; offline (``offline_max_len`` > 0), the pool holds
    every group's need for the batch (``ceil(offline_max_len / bs) * (batch
    // dp_split)`` per paged group, the window or states per fixed group)
    and the null block, checked against free memory.  The pool must hold the
    fixed groups' batch and, online, a prefill of ``max_prefill_tokens`` in
    every paged group at once.
    Arguments as :func:`~kvfunc.calculate_block_num` (``min_across_ranks``
    is given the local block count).

    Returns a :class:`SharedPoolSizing` (the null block alone: no paged cache).

    Raises:
        InvalidTypeError, InvalidArgumentError: wrong types, bad figures or options.
        InvalidCacheInfo: caches :func:`~kvfunc.validate_cache_info` refuses, or a
            group mixing attention types or block sizes.
        InsufficientMemoryError: the memory cannot hold what is required.

    >>> from kvfunc.core._cache_info import LayerCacheInfo
    >>> full = CacheEntry("kv", "FullAttention", 512, 1, "bfloat16", True, block_size=128)
    >>> swa = CacheEntry("kv", "SlidingWindow", 512, 1, "bfloat16", True, block_size=128,
    ...                  sliding_window=256)
    >>> info = ModelCacheInfo(2, [LayerCacheInfo(0, [full]), LayerCacheInfo(1, [swa])])
    >>> config = SizingConfig(batch_size_per_dp_rank=4, mem_fraction_static=0.5,
    ...                       max_prefill_tokens=1000)
    >>> sizing = calculate_shared_block_num(config, info, free_memory_bytes=2**30,
    ...                                     total_memory_bytes=2**30)
    >>> sizing.num_blocks, sizing.page_bytes, sizing.block_num_by_type
    (4096, 131072, {'FullAttention': 4096, 'SlidingWindow': 4096})
    """
    if not isinstance(config, SizingConfig):
        raise InvalidTypeError(f"config must be a SizingConfig, but got {type(config).__name__}")
    fn = "calculate_shared_block_num"
    free, total = check_memory(free_memory_bytes, total_memory_bytes, fn)
    extra = check_options(fn, offline_max_len, extra_reserved_memory_bytes)
    if min_across_ranks is not None and not callable(min_across_ranks):
        msg = f"min_across_ranks must be callable or None, but got {type(min_across_ranks)}"
        raise InvalidTypeError(msg)
    layout = shared_page_layout(cache_info)
    if not layout.groups:
        return SharedPoolSizing(1, layout)
    fixed = _fixed_needs(config, cache_info)
    if offline_max_len:  # 0, like None, means online, as in the seed
        return SharedPoolSizing(
            _offline_num_blocks(config, layout, fixed, offline_max_len, free, extra), layout)
    return SharedPoolSizing(
        _online_num_blocks(config, layout, fixed, free, total, extra, min_across_ranks), layout)
