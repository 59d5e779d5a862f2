"""The seed module's API, method for method, as a thin stateful facade.

Same names, signatures and observable results as the seed's
``executor/core/kv_cache`` package, with the deviations listed in
``docs/compat.md`` (chiefly: nothing is ever half-applied).  Every object
here is a view over one current :class:`kvfunc.KVState`.
"""

from kvfunc.compat._kv_cache_manager import KVCacheManager
from kvfunc.compat._managers import (
    ATTN_TYPE_MANAGER_MAP,
    FullAttentionManager,
    MambaManager,
    SingleTypeKVCacheManager,
    SlidingWindowManager,
    create_single_type_managers,
)
from kvfunc.compat._sizing import (
    FIXED_BLOCK_ATTN_TYPES,
    SUPPORTED_CACHE_LAYOUTS,
    calculate_block_num,
    calculate_fixed_block_memory_bytes,
    dtype_itemsize,
    validate_cache_info,
)
from kvfunc.compat._store import BlockPool
from kvfunc.compat._tables import prepare_block_tables, prepare_slot_mapping
from kvfunc.compat._tensors import allocate_cache_tensors

__all__ = [
    "ATTN_TYPE_MANAGER_MAP",
    "FIXED_BLOCK_ATTN_TYPES",
    "SUPPORTED_CACHE_LAYOUTS",
    "BlockPool",
    "FullAttentionManager",
    "KVCacheManager",
    "MambaManager",
    "SingleTypeKVCacheManager",
    "SlidingWindowManager",
    "allocate_cache_tensors",
    "calculate_block_num",
    "calculate_fixed_block_memory_bytes",
    "create_single_type_managers",
    "dtype_itemsize",
    "prepare_block_tables",
    "prepare_slot_mapping",
    "validate_cache_info",
]
