"""How many blocks each manager gets: the seed's sizing (spec §5.4, §5.5), pure.

Two kinds of groups are sized differently::

    fixed  (SlidingWindow, Mamba)  blocks = batch x per-request blocks + 1 (null)
    paged  (FullAttention, ...)    offline: ceil(max_len / bs) x batch + 1 (null)
                                   online:  what the memory budget holds; the
                                            null block comes out of the budget

The seed reads the device's free and total memory in the middle of this
computation, in exactly one place per path, and not at all when there is no
paged group.  Here the figures are arguments: :func:`calculate_block_num`
takes them as numbers, :func:`calculate_block_num_lazy` takes a function
that it calls at most once, where the seed queries the device.  The TP
all-reduce MIN of the seed is the ``min_across_ranks`` callback.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from kvfunc.core._cache_info import CacheAllocator, CacheEntry, ModelCacheInfo
from kvfunc.core._checks import check_int
from kvfunc.core._dtypes import dtype_itemsize
from kvfunc.core._errors import (
    InsufficientMemoryError,
    InvalidArgumentError,
    InvalidCacheInfo,
    InvalidTypeError,
)
from kvfunc.core._sizing_config import SizingConfig
from kvfunc.core._validate import FIXED_BLOCK_ATTN_TYPES, mamba_entry, positive_field

__all__ = [
    "SizingConfig",
    "calculate_block_num",
    "calculate_block_num_lazy",
    "calculate_fixed_block_memory_bytes",
]

_GIB = 1024**3


def _raw_token_bytes(cache: CacheEntry, layer_idx: int) -> int:
    """Bytes of one token row of ``cache`` over all its heads, before compression."""
    num_head = positive_field(cache, layer_idx, "num_head")
    return cache.cache_dim_numel() * num_head * dtype_itemsize(cache.dtype)


def _is_hbm(cache: CacheEntry) -> bool:
    # A bad allocator raises the enum's own ValueError message, as in the seed.
    return CacheAllocator(cache.allocator) is CacheAllocator.HBM


def _fixed_blocks_and_bytes(
    config: SizingConfig, cache: CacheEntry, layer_idx: int
) -> tuple[int, int]:
    """Block count of ``cache``'s fixed-block group, and the bytes ``cache`` takes."""
    batch = config.batch_size_per_dp_rank
    if cache.attn_type == "Mamba":
        mamba = mamba_entry(cache, layer_idx)
        # One state block per request plus its next_n speculative states.
        block_num = batch * (1 + mamba.next_n) + 1
        return block_num, block_num * mamba.cache_dim_numel() * dtype_itemsize(mamba.dtype)
    block_size, window = positive_field(cache, layer_idx, "block_size"), cache.sliding_window
    if type(window) is not int or window < 0:
        msg = (f"SlidingWindow cache {cache.cache_name} in layer {layer_idx} must define a "
               f"non-negative int sliding_window, but got {window}.")
        raise InvalidCacheInfo(msg)
    # MTP: the main model verifies next_n + 1 positions and the draft runs
    # next_n - 1 more, so a step may touch 2 * next_n tokens past the window.
    per_request = (2 * config.next_n + window + block_size - 1) // block_size
    # + 1 per request: a window straddles a block boundary; + 1: the null block.
    block_num = batch * (per_request + 1) + 1
    # The seed sizes a window at the full block_size: compression is ignored.
    return block_num, block_num * block_size * _raw_token_bytes(cache, layer_idx)


def calculate_fixed_block_memory_bytes(
    config: SizingConfig, cache_info: ModelCacheInfo
) -> tuple[dict[str, int], int]:
    """Blocks per fixed-block group and the bytes all fixed-block caches take (§5.4).

    A sliding window needs ``batch * (ceil((W + 2 * next_n) / bs) + 1) + 1``
    blocks, a Mamba state ``batch * (1 + entry.next_n) + 1``.  Bytes count
    every entry of every layer, HBM entries only, at the full ``block_size``
    (no compression).

    Raises:
        InvalidCacheInfo: two entries of one group need different block counts.

    >>> from kvfunc.core._cache_info import LayerCacheInfo
    >>> swa = CacheEntry("k", "SlidingWindow", 64, 2, "bfloat16", True, block_size=16,
    ...                  sliding_window=100)
    >>> info = ModelCacheInfo(2, [LayerCacheInfo(0, [swa]), LayerCacheInfo(1, [swa])])
    >>> calculate_fixed_block_memory_bytes(SizingConfig(4, 0.9, 512), info)
    ({'SlidingWindow': 33}, 270336)
    """
    block_num_by_key: dict[str, int] = {}
    total_bytes = 0
    for layer_idx, cache in cache_info.iter_caches():
        if not cache.needs_block or cache.attn_type not in FIXED_BLOCK_ATTN_TYPES:
            continue
        key = cache.group_key
        block_num, entry_bytes = _fixed_blocks_and_bytes(config, cache, layer_idx)
        hbm = _is_hbm(cache)  # before the group check, as in the seed
        previous = block_num_by_key.get(key)
        if previous is not None and previous != block_num:
            msg = (f"Fixed-block caches sharing manager_key={key} must require the same "
                   f"block_num, but got {previous} and {block_num}.")
            raise InvalidCacheInfo(msg)
        block_num_by_key[key] = block_num
        if hbm:
            total_bytes += entry_bytes
    return block_num_by_key, total_bytes


@attrs.frozen
class _PagedGroups:
    """What the seed's first pass over all caches learns (no needs_block filter)."""

    block_sizes: dict[str, int]  # first-appearance order
    block_bytes: dict[str, int]  # HBM bytes of one block of the group, all layers
    partitions: dict[str, int]  # offline DP ranks a group's batch is split over
    per_token_bytes: int  # HBM bytes one token takes in every paged cache
    has_fixed: bool


def _collect_paged_groups(config: SizingConfig, cache_info: ModelCacheInfo) -> _PagedGroups:
    block_sizes: dict[str, int] = {}
    block_bytes: dict[str, int] = {}
    partitions: dict[str, int] = {}
    per_token_bytes = 0
    has_fixed = False
    dp_group = config.offline_prefill_dp_group_size
    # The seed's first pass has no needs_block filter: an entry that gets no
    # blocks still counts in per_token_bytes (spec §9.2); we keep that.
    for layer_idx, cache in cache_info.iter_caches():
        if cache.attn_type in FIXED_BLOCK_ATTN_TYPES:
            has_fixed = True
            continue
        key, block_size = cache.group_key, positive_field(cache, layer_idx, "block_size")
        previous = block_sizes.get(key)
        if previous is not None and previous != block_size:
            msg = ("Caches sharing one paged attention manager must share block_size. "
                   f"manager_key={key}, attn_type={cache.attn_type}, "
                   f"block_sizes={sorted({previous, block_size})}")
            raise InvalidCacheInfo(msg)
        ratio = positive_field(cache, layer_idx, "compress_ratio")
        token_bytes = _raw_token_bytes(cache, layer_idx) // ratio
        partitions[key] = dp_group if dp_group > 1 and cache.attn_type == "FullAttention" else 1
        block_sizes[key] = block_size
        if _is_hbm(cache):
            block_bytes[key] = block_bytes.get(key, 0) + block_size * token_bytes
            per_token_bytes += token_bytes
    return _PagedGroups(block_sizes, block_bytes, partitions, per_token_bytes, has_fixed)


def check_memory(free: object, total: object, fn: str = "calculate_block_num"
                 ) -> tuple[int, int]:
    """The free and total memory figures of a sizing function ``fn``, checked."""
    free = check_int(fn, "free_memory_bytes", free, 0)
    total = check_int(fn, "total_memory_bytes", total, 0)
    if free > total:
        msg = f"free_memory_bytes={free} exceeds total_memory_bytes={total}"
        raise InvalidArgumentError(msg)
    return free, total


def min_across(min_across_ranks: Callable[[int], int] | None, local: int) -> int:
    """The smallest of ``local`` over the ranks, checked (``local`` without a callback).

    Ranks of one TP group may see different free memory at start-up; they
    must all size alike, so each takes the smallest capacity.
    """
    if min_across_ranks is None:
        return local
    synced = min_across_ranks(local)
    if type(synced) is not int or not 0 <= synced <= local:
        msg = (f"min_across_ranks({local}) must return an int in [0, {local}], but returned "
               f"{synced!r}")
        raise InvalidArgumentError(msg)
    return synced


def check_options(fn: str, offline_max_len: object, extra: object) -> int:
    """A sizing function's ``offline_max_len`` checked; its extra reserved bytes."""
    if offline_max_len is not None:
        check_int(fn, "offline_max_len", offline_max_len, 0)
    return check_int(fn, "extra_reserved_memory_bytes", extra, 0)


def _read_memory(read_memory: Callable[[], tuple[int, int]]) -> tuple[int, int]:
    figures = read_memory()
    if not isinstance(figures, tuple) or len(figures) != 2:
        msg = f"read_memory must return (free, total), but returned {figures!r}"
        raise InvalidTypeError(msg)
    return check_memory(*figures)


def _offline_block_num(config: SizingConfig, groups: _PagedGroups, offline_max_len: int,
                       fixed_bytes: int, extra: int,
                       read_memory: Callable[[], tuple[int, int]]) -> dict[str, int]:
    batch = config.batch_size_per_dp_rank
    # Exact ceiling; the seed's float division agrees below 2**53 tokens.
    block_num = {key: -(-offline_max_len // bs) * (batch // groups.partitions[key]) + 1
                 for key, bs in groups.block_sizes.items()}
    required = sum(n * groups.block_bytes.get(key, 0) for key, n in block_num.items())
    required += fixed_bytes + extra
    free, _total = _read_memory(read_memory)
    if required > free:
        msg = (f"Insufficient memory for offline mode cache allocation. required={required}, "
               f"free={free}, extra_reserved={extra}. "
               "Please reduce the length of requests or the total batch size.")
        raise InsufficientMemoryError(msg)
    return block_num


def _online_block_num(config: SizingConfig, groups: _PagedGroups, fixed_bytes: int,
                      extra: int, read_memory: Callable[[], tuple[int, int]],
                      min_across_ranks: Callable[[int], int] | None) -> dict[str, int]:
    free, total = _read_memory(read_memory)
    used = total - free
    fraction = config.mem_fraction_static
    # Float arithmetic, as in the seed: the fraction makes the budget a float.
    available = total * fraction - used - fixed_bytes - extra
    if available <= 0:
        msg = ("No available memory for paged attention after fixed-block cache reservation. "
               f"used={used}, fixed_block={fixed_bytes}, extra_reserved={extra}, "
               f"total={total}, mem_fraction_static={fraction}, "
               "Please boost mem_fraction_static in yaml.")
        raise InsufficientMemoryError(msg)
    if groups.per_token_bytes <= 0:
        msg = ("No HBM-backed paged-attention cache entry remains for dynamic block sizing. "
               "Please use offline mode or keep at least one paged cache entry in HBM.")
        raise InsufficientMemoryError(msg)
    max_tokens = min_across(min_across_ranks, int(available // groups.per_token_bytes))
    # No + 1 here: the null block comes out of the budget.
    block_num = {key: max_tokens // bs for key, bs in groups.block_sizes.items()}
    # The null block stores nothing, so it does not count towards capacity.
    supported = min((block_num[key] - 1) * bs for key, bs in groups.block_sizes.items())
    required = config.max_prefill_tokens
    if supported - 1 < required:
        msg = ("Current memory cannot satisfy max input length requirement. "
               f"supported max tokens={supported}, required max tokens={required}, "
               f"fixed_block_memory_gb={fixed_bytes / _GIB:.2f}, "
               f"extra_reserved_memory_gb={extra / _GIB:.2f}")
        raise InsufficientMemoryError(msg)
    return block_num


def calculate_block_num_lazy(
    config: SizingConfig,
    cache_info: ModelCacheInfo,
    *,
    read_memory: Callable[[], tuple[int, int]],
    offline_max_len: int | None = None,
    extra_reserved_memory_bytes: int = 0,
    min_across_ranks: Callable[[int], int] | None = None,
) -> dict[str, int]:
    """:func:`calculate_block_num`, reading ``(free, total)`` only where the seed does.

    ``read_memory`` is called at most once, and not at all when no paged
    group exists or an earlier check fails — exactly when the seed queries
    the device.  The compatibility layer passes a device query here.

    >>> from kvfunc.core._cache_info import LayerCacheInfo
    >>> swa = CacheEntry("k", "SlidingWindow", 64, 1, "fp16", True, block_size=16,
    ...                  sliding_window=64)
    >>> def no_query() -> tuple[int, int]:
    ...     raise AssertionError("not needed")
    >>> info = ModelCacheInfo(1, [LayerCacheInfo(0, [swa])])
    >>> calculate_block_num_lazy(SizingConfig(2, 0.9, 128), info, read_memory=no_query)
    {'SlidingWindow': 11}
    """
    extra = check_options("calculate_block_num", offline_max_len, extra_reserved_memory_bytes)
    groups = _collect_paged_groups(config, cache_info)
    block_num: dict[str, int] = {}
    fixed_bytes = 0
    if groups.has_fixed:
        fixed_block_num, fixed_bytes = calculate_fixed_block_memory_bytes(config, cache_info)
        block_num.update(fixed_block_num)
    if not groups.block_sizes:
        return block_num
    if offline_max_len:  # 0, like None, means online, as in the seed
        paged = _offline_block_num(config, groups, offline_max_len, fixed_bytes, extra,
                                   read_memory)
    else:
        paged = _online_block_num(config, groups, fixed_bytes, extra, read_memory,
                                  min_across_ranks)
    block_num.update(paged)
    return block_num


def calculate_block_num(
    config: SizingConfig,
    cache_info: ModelCacheInfo,
    *,
    free_memory_bytes: int,
    total_memory_bytes: int,
    offline_max_len: int | None = None,
    extra_reserved_memory_bytes: int = 0,
    min_across_ranks: Callable[[int], int] | None = None,
) -> dict[str, int]:
    """Blocks per manager key for ``cache_info``, as the seed sizes them (§5.5).

    Fixed-block groups (SlidingWindow, Mamba) get what the batch needs.
    Paged groups get, offline (``offline_max_len`` > 0),
    ``ceil(offline_max_len / bs) * (batch // dp_split) + 1`` blocks, checked
    against free memory; online, the budget
    ``total * mem_fraction_static - used - fixed - extra`` divided into
    tokens (``min_across_ranks`` may lower it), then into blocks of each
    group's ``block_size``, the null block included.

    Args:
        config: the engine settings sizing reads.
        cache_info: the model's caches.
        free_memory_bytes: free device memory now.
        total_memory_bytes: total device memory.
        offline_max_len: the fixed request length of offline mode; ``None``
            or 0 sizes from the memory budget (online).
        extra_reserved_memory_bytes: memory to leave for other uses.
        min_across_ranks: given the local token capacity, the smallest over
            the TP group (the seed's all-reduce MIN); ``None`` for one rank.

    Returns:
        ``{manager_key: num_blocks}``, fixed keys first, then paged keys in
        order of first appearance.

    Raises:
        InvalidCacheInfo: inconsistent block sizes or block counts in a group.
        InsufficientMemoryError: the memory cannot hold what is required.

    >>> from kvfunc.core._cache_info import LayerCacheInfo
    >>> full = CacheEntry("kv", "FullAttention", 512, 1, "bfloat16", True, block_size=128)
    >>> info = ModelCacheInfo(1, [LayerCacheInfo(0, [full])])
    >>> config = SizingConfig(batch_size_per_dp_rank=4, mem_fraction_static=0.5,
    ...                       max_prefill_tokens=1000)
    >>> calculate_block_num(config, info, free_memory_bytes=2**30, total_memory_bytes=2**30,
    ...                     offline_max_len=1000)
    {'FullAttention': 33}
    >>> calculate_block_num(config, info, free_memory_bytes=2**30, total_memory_bytes=2**30)
    {'FullAttention': 4096}
    """
    free, total = check_memory(free_memory_bytes, total_memory_bytes)
    return calculate_block_num_lazy(
        config, cache_info, read_memory=lambda: (free, total), offline_max_len=offline_max_len,
        extra_reserved_memory_bytes=extra_reserved_memory_bytes,
        min_across_ranks=min_across_ranks)
