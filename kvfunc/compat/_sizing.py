"""The seed's sizing functions with the seed's signatures (spec §5.1–§5.5).

Thin wrappers over the pure :mod:`kvfunc.core._sizing`: they read the
settings off the seed's ``infer_config``, query the device's memory (once,
and only where the seed does) and, given a TP group in an initialised
``torch.distributed``, take the smallest token capacity over the group.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from kvfunc.core import (
    FIXED_BLOCK_ATTN_TYPES,
    SUPPORTED_CACHE_LAYOUTS,
    ModelCacheInfo,
    SizingConfig,
    dtype_itemsize,
    validate_cache_info,
)
from kvfunc.core import calculate_fixed_block_memory_bytes as _calculate_fixed_block_memory_bytes
from kvfunc.core._internal import calculate_block_num_lazy
from kvfunc.shell._memory import device_memory_info

__all__ = [
    "FIXED_BLOCK_ATTN_TYPES",
    "SUPPORTED_CACHE_LAYOUTS",
    "calculate_block_num",
    "calculate_fixed_block_memory_bytes",
    "dtype_itemsize",
    "validate_cache_info",
]

logger = logging.getLogger(__name__)


def _collective_device(group: Any) -> torch.device:
    """Where a one-int all-reduce tensor must live for ``group``'s backend."""
    backend = str(dist.get_backend(group)).lower()
    npu = getattr(torch, "npu", None)
    if backend == "hccl" and npu is not None:
        return torch.device("npu", npu.current_device())
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_reduce_min(value: int, group: Any) -> int:
    """The smallest ``value`` over the ranks of ``group`` (a collective call)."""
    tensor = torch.tensor([value], dtype=torch.int64, device=_collective_device(group))
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=group)
    synced = int(tensor.item())
    if synced != value:
        logger.info("Sync paged-attention token capacity across attn_tp_group: "
                    "local=%s, synced_min=%s", value, synced)
    return synced


def calculate_fixed_block_memory_bytes(
    infer_config: Any, cache_info: ModelCacheInfo
) -> tuple[dict[str, int], int]:
    """Seed signature of :func:`kvfunc.core._sizing.calculate_fixed_block_memory_bytes`.

    Reads only what the seed reads: ``scheduler_config.batch_size_per_dp_rank``
    and ``model_config.next_n`` (0 when absent).

    >>> from types import SimpleNamespace as NS
    >>> from kvfunc.core._cache_info import CacheEntry, LayerCacheInfo
    >>> swa = CacheEntry("k", "SlidingWindow", 64, 1, "fp16", True, block_size=16,
    ...                  sliding_window=64)
    >>> cfg = NS(scheduler_config=NS(batch_size_per_dp_rank=2), model_config=NS(next_n=1))
    >>> calculate_fixed_block_memory_bytes(cfg, ModelCacheInfo(1, [LayerCacheInfo(0, [swa])]))
    ({'SlidingWindow': 13}, 26624)
    """
    config = SizingConfig(
        batch_size_per_dp_rank=infer_config.scheduler_config.batch_size_per_dp_rank,
        # Not read by fixed-block sizing; neutral values keep the record valid.
        mem_fraction_static=1.0,
        max_prefill_tokens=0,
        next_n=getattr(getattr(infer_config, "model_config", None), "next_n", 0),
    )
    return _calculate_fixed_block_memory_bytes(config, cache_info)


def calculate_block_num(
    infer_config: Any,
    cache_info: ModelCacheInfo,
    offline_max_len: int | None = None,
    tp_group: Any = None,
    extra_reserved_memory_bytes: int = 0,
) -> dict[str, int]:
    """Seed signature of :func:`kvfunc.core._sizing.calculate_block_num`.

    The device's free and total memory are read once, through
    :func:`kvfunc.shell._memory.device_memory_info`, and not at all when
    the model has no paged cache.  With ``tp_group`` given and
    ``torch.distributed`` initialised, every rank of the group takes the
    smallest token capacity (an all-reduce MIN, a collective call).

    >>> from types import SimpleNamespace as NS
    >>> from kvfunc.core._cache_info import CacheEntry, LayerCacheInfo
    >>> swa = CacheEntry("k", "SlidingWindow", 64, 1, "fp16", True, block_size=16,
    ...                  sliding_window=64)
    >>> cfg = NS(scheduler_config=NS(batch_size_per_dp_rank=2, mem_fraction_static=0.9,
    ...                              max_prefill_tokens=128))
    >>> calculate_block_num(cfg, ModelCacheInfo(1, [LayerCacheInfo(0, [swa])]))
    {'SlidingWindow': 11}
    """
    config = SizingConfig.from_infer_config(infer_config)
    min_across_ranks: Callable[[int], int] | None = None
    if tp_group is not None and dist.is_available() and dist.is_initialized():
        min_across_ranks = functools.partial(_all_reduce_min, group=tp_group)
    return calculate_block_num_lazy(
        config,
        cache_info,
        read_memory=device_memory_info,
        offline_max_len=offline_max_len,
        extra_reserved_memory_bytes=extra_reserved_memory_bytes,
        min_across_ranks=min_across_ranks,
    )
