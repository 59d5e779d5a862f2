"""LLM-DataDist style cache management and prefill -> decode KV transfer.

Two layers, as in the rest of kvfunc:

* **pure** (imported here, no torch): the types (:class:`CacheDesc`,
  :class:`CacheKey`, ...), the errors (each an ``LLMError`` with a status
  code) and the registry (:class:`RegistryState` with ``allocate_cache``,
  ``deallocate_cache``, ``remove_cache_key``, ...: pools carved by a range
  allocator, caches and their reference counts);
* **torch** (loaded on first use of one of its names): :class:`LLMDataDist`
  with its :class:`CacheManager` (the pool as tensors, copy/swap, pull/push
  over ``torch.distributed`` or Mooncake) and the glue to kvfunc's block
  allocator (:func:`allocate_paged_caches`, :func:`pull_request_blocks`, ...).

``import kvfunc.datadist`` does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvfunc.core import LLMError, LLMStatusCode
from kvfunc.datadist._config import DataDistOptions, LLMClusterInfo, LLMConfig
from kvfunc.datadist._errors import (
    AlreadyLinkedError,
    CacheNotExistError,
    ClusterNumExceedError,
    DataDistFailedError,
    FeatureNotEnabledError,
    InvalidParamError,
    LinkFailedError,
    NotLinkedError,
    PeerProtocolError,
    PoolOutOfMemoryError,
    TransferTimeoutError,
    error_for,
)
from kvfunc.datadist._registry import (
    CacheAllocation,
    CacheRecord,
    RegistryState,
    allocate_blocks_cache,
    allocate_cache,
    check_registry,
    deallocate_cache,
    find_cache,
    find_key,
    pin_cache,
    remove_cache_key,
    unpin_cache,
)
from kvfunc.datadist._types import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    ClusterInfo,
    DataType,
    LLMRole,
    Placement,
    PoolConfig,
    TransferConfig,
)

if TYPE_CHECKING:
    from kvfunc.datadist._cache_manager import CacheManager, CacheTask, LayerSynchronizer
    from kvfunc.datadist._datadist import LLMDataDist
    from kvfunc.datadist._paged import (
        PagedCaches,
        allocate_paged_caches,
        check_paired,
        pull_request_blocks,
        push_request_blocks,
    )
    from kvfunc.datadist._pool import Cache, MemoryPool

_LAZY = {
    "Cache": "kvfunc.datadist._pool",
    "MemoryPool": "kvfunc.datadist._pool",
    "CacheManager": "kvfunc.datadist._cache_manager",
    "CacheTask": "kvfunc.datadist._cache_manager",
    "LayerSynchronizer": "kvfunc.datadist._cache_manager",
    "LLMDataDist": "kvfunc.datadist._datadist",
    "PagedCaches": "kvfunc.datadist._paged",
    "allocate_paged_caches": "kvfunc.datadist._paged",
    "check_paired": "kvfunc.datadist._paged",
    "pull_request_blocks": "kvfunc.datadist._paged",
    "push_request_blocks": "kvfunc.datadist._paged",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvfunc.datadist' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "AlreadyLinkedError",
    "BlocksCacheKey",
    "Cache",
    "CacheAllocation",
    "CacheDesc",
    "CacheKey",
    "CacheKeyByIdAndIndex",
    "CacheManager",
    "CacheNotExistError",
    "CacheRecord",
    "CacheTask",
    "ClusterInfo",
    "ClusterNumExceedError",
    "DataDistFailedError",
    "DataDistOptions",
    "DataType",
    "FeatureNotEnabledError",
    "InvalidParamError",
    "LLMClusterInfo",
    "LLMConfig",
    "LLMDataDist",
    "LLMError",
    "LLMRole",
    "LLMStatusCode",
    "LayerSynchronizer",
    "LinkFailedError",
    "MemoryPool",
    "NotLinkedError",
    "PagedCaches",
    "PeerProtocolError",
    "Placement",
    "PoolConfig",
    "PoolOutOfMemoryError",
    "RegistryState",
    "TransferConfig",
    "TransferTimeoutError",
    "allocate_blocks_cache",
    "allocate_cache",
    "allocate_paged_caches",
    "check_paired",
    "check_registry",
    "deallocate_cache",
    "error_for",
    "find_cache",
    "find_key",
    "pin_cache",
    "pull_request_blocks",
    "push_request_blocks",
    "remove_cache_key",
    "unpin_cache",
]
