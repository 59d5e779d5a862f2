"""Validation of a ``ModelCacheInfo`` before sizing and manager creation.

:func:`validate_cache_info` runs the seed's checks (spec §5.2) in the seed's
order, with the seed's messages, and raises the first failure as
:class:`InvalidCacheInfo` (a ``ValueError``).  Where the seed would crash on
a missing value (``None <= 0`` raises ``TypeError``), the same check fails
with the same message instead, showing the value.

The supported attention types are those with a registered policy, so a new
attention type only has to register its policy to be accepted here.
"""

from __future__ import annotations

from typing import TypeGuard

from kvfunc.core._cache_info import (
    CacheAllocator,
    CacheEntry,
    MambaCacheEntry,
    ModelCacheInfo,
    as_listed,
)
from kvfunc.core._errors import InvalidCacheInfo
from kvfunc.core._policies import registered_attn_types

__all__ = ["FIXED_BLOCK_ATTN_TYPES", "SUPPORTED_CACHE_LAYOUTS", "validate_cache_info"]

#: Attention types whose block count follows from the batch size, not from
#: memory (a window, or one recurrent state per request).
FIXED_BLOCK_ATTN_TYPES: frozenset[str] = frozenset({"SlidingWindow", "Mamba"})

#: ``BnBsND`` = (blocks, block rows, heads, *dim); ``BnNBsD`` = (blocks, heads, block rows, *dim).
SUPPORTED_CACHE_LAYOUTS: frozenset[str] = frozenset({"BnBsND", "BnNBsD"})

_ALLOCATOR_VALUES = [item.value for item in CacheAllocator]


def _is_positive_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and value > 0


def positive_field(cache: CacheEntry, layer_idx: int, name: str) -> int:
    """``cache.<name>`` if it is a positive int, else the seed's message as an error.

    >>> positive_field(CacheEntry("k", "FullAttention", 64, 0, "fp16", True), 2, "num_head")
    Traceback (most recent call last):
    ...
    kvfunc.core._errors.InvalidCacheInfo: cache k in layer 2 must have positive num_head, but got 0
    """
    value = getattr(cache, name)
    if not _is_positive_int(value):
        msg = (f"cache {cache.cache_name} in layer {layer_idx} must have positive {name}, "
               f"but got {value}")
        raise InvalidCacheInfo(msg)
    return value


def mamba_entry(cache: CacheEntry, layer_idx: int) -> MambaCacheEntry:
    """``cache`` itself if it is a :class:`MambaCacheEntry`, else the seed's message as an error.

    >>> mamba_entry(CacheEntry("s", "Mamba", None, None, "fp32", True), 0)
    Traceback (most recent call last):
    ...
    kvfunc.core._errors.InvalidCacheInfo: cache s in layer 0 declares attn_type='Mamba' and ...
    """
    if not isinstance(cache, MambaCacheEntry):
        msg = (f"cache {cache.cache_name} in layer {layer_idx} declares attn_type='Mamba' and "
               f"must be a MambaCacheEntry, but got {type(cache).__name__}")
        raise InvalidCacheInfo(msg)
    return cache


def _check_entry(cache: CacheEntry, layer_idx: int) -> None:
    """Raise the first check ``cache`` fails, in the seed's order."""
    where = f"cache {cache.cache_name} in layer {layer_idx}"
    positive_field(cache, layer_idx, "block_size")
    supported = registered_attn_types()
    if cache.attn_type not in supported:
        msg = (f"Unsupported attn_type '{cache.attn_type}' found in layer {layer_idx}, "
               f"cache {cache.cache_name}. Supported attn types are: {supported}")
        raise InvalidCacheInfo(msg)
    if cache.cache_layout not in SUPPORTED_CACHE_LAYOUTS:
        msg = (f"{where} has unsupported cache_layout '{cache.cache_layout}'. "
               f"Supported layouts are: {sorted(SUPPORTED_CACHE_LAYOUTS)}")
        raise InvalidCacheInfo(msg)
    if cache.attn_type == "Mamba":
        mamba_entry(cache, layer_idx)
    else:
        # Every other type describes num_head x dim per token (the seed checks
        # FullAttention and SlidingWindow, the only others it registers).
        positive_field(cache, layer_idx, "num_head")
        dims = cache.dim if isinstance(cache.dim, tuple) else (cache.dim,)
        if not all(_is_positive_int(d) for d in dims):
            msg = f"{where} must have positive dim, but got {as_listed(cache.dim)}"
            raise InvalidCacheInfo(msg)
    try:
        CacheAllocator(cache.allocator)
    except ValueError:
        msg = (f"{where} has unsupported allocator {cache.allocator}. "
               f"Supported allocators are: {_ALLOCATOR_VALUES}")
        raise InvalidCacheInfo(msg) from None


def validate_cache_info(cache_info: ModelCacheInfo) -> None:
    """Check ``cache_info`` as the seed does (spec §5.2); the first failure raises.

    Only entries with ``needs_block`` are checked; ``sliding_window`` and
    ``compress_ratio`` are checked later, when managers are built.

    Args:
        cache_info: the model's cache description.

    Raises:
        InvalidCacheInfo: the first failing check, in layer and cache order.

    >>> from kvfunc.core._cache_info import LayerCacheInfo
    >>> e = CacheEntry("k", "FullAttention", 64, 1, "bfloat16", True, block_size=16)
    >>> validate_cache_info(ModelCacheInfo(1, [LayerCacheInfo(0, [e])]))
    >>> validate_cache_info(ModelCacheInfo(2, [LayerCacheInfo(0, [e])]))
    Traceback (most recent call last):
    ...
    kvfunc.core._errors.InvalidCacheInfo: ModelCacheInfo.num_layers mismatch: num_layers=2, ...
    """
    num_layers, layers = cache_info.num_layers, cache_info.layer_infos
    if num_layers != len(layers):
        msg = (f"ModelCacheInfo.num_layers mismatch: num_layers={num_layers}, "
               f"len(layer_infos)={len(layers)}")
        raise InvalidCacheInfo(msg)
    for layer in layers:
        if not layer.caches:
            msg = f"Layer {layer.layer_idx} must define at least one cache entry"
            raise InvalidCacheInfo(msg)
        for cache in layer.caches:
            if not cache.needs_block:
                continue
            _check_entry(cache, layer.layer_idx)
