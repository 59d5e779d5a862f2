"""The pure core: states, transitions, deltas, policies and sizing.

Imports only the standard library, attrs and pyrsistent (never torch).
"""

from kvfunc.core._batch import BatchResult, SlotRequest, allocate_batch
from kvfunc.core._cache_info import (
    CacheAllocator,
    CacheEntry,
    LayerCacheInfo,
    MambaCacheEntry,
    MemoryBudgetItem,
    ModelCacheInfo,
    OffloadWorkspaceMemoryInfo,
)
from kvfunc.core._cache_state import GroupCache
from kvfunc.core._delta import COPY_INTO_NEW, COPY_SAVED, DELTA_VERSION, BlocksChanged
from kvfunc.core._dtypes import dtype_itemsize
from kvfunc.core._errors import (
    BlockIndexError,
    DoubleFreeError,
    InsufficientMemoryError,
    InvalidArgumentError,
    InvalidCacheInfo,
    InvalidTypeError,
    KVFuncError,
    LLMError,
    LLMStatusCode,
    MissingKeyError,
    MissingTensorError,
    NotSupportedError,
    OutOfBlocksError,
    ReplayMismatchError,
    UnknownAttentionTypeError,
    UnknownRequestError,
)
from kvfunc.core._hashing import HASH_FUNCTIONS, BlockHash, BlockHashes, hash_function
from kvfunc.core._policy import (
    FullAttention,
    Mamba,
    Policy,
    SlidingWindow,
    policy_class,
    register_policy,
    registered_attn_types,
)
from kvfunc.core._prefix import PrefixHit, lookup_prefix
from kvfunc.core._prefix_ops import (
    PrefixCacheStats,
    fork_request,
    num_cached_blocks,
    reset_prefix_cache,
)
from kvfunc.core._replay import replay
from kvfunc.core._sizing import (
    SizingConfig,
    calculate_block_num,
    calculate_fixed_block_memory_bytes,
)
from kvfunc.core._state import (
    NULL_BLOCK,
    BlockId,
    FrozenDict,
    GroupState,
    KVState,
    RequestId,
    check_invariants,
)
from kvfunc.core._transitions import (
    AllocationResult,
    allocate_slots,
    format_usage,
    free_request,
    get_block_ids,
    num_free_blocks,
    recycle_skipped_blocks,
)
from kvfunc.core._validate import (
    FIXED_BLOCK_ATTN_TYPES,
    SUPPORTED_CACHE_LAYOUTS,
    validate_cache_info,
)

__all__ = [
    "COPY_INTO_NEW",
    "COPY_SAVED",
    "DELTA_VERSION",
    "FIXED_BLOCK_ATTN_TYPES",
    "HASH_FUNCTIONS",
    "NULL_BLOCK",
    "SUPPORTED_CACHE_LAYOUTS",
    "AllocationResult",
    "BatchResult",
    "BlockHash",
    "BlockHashes",
    "BlockId",
    "BlockIndexError",
    "BlocksChanged",
    "CacheAllocator",
    "CacheEntry",
    "DoubleFreeError",
    "FrozenDict",
    "FullAttention",
    "GroupCache",
    "GroupState",
    "InsufficientMemoryError",
    "InvalidArgumentError",
    "InvalidCacheInfo",
    "InvalidTypeError",
    "KVFuncError",
    "KVState",
    "LLMError",
    "LLMStatusCode",
    "LayerCacheInfo",
    "Mamba",
    "MambaCacheEntry",
    "MemoryBudgetItem",
    "MissingKeyError",
    "MissingTensorError",
    "ModelCacheInfo",
    "NotSupportedError",
    "OffloadWorkspaceMemoryInfo",
    "OutOfBlocksError",
    "Policy",
    "PrefixCacheStats",
    "PrefixHit",
    "ReplayMismatchError",
    "RequestId",
    "SizingConfig",
    "SlidingWindow",
    "SlotRequest",
    "UnknownAttentionTypeError",
    "UnknownRequestError",
    "allocate_batch",
    "allocate_slots",
    "calculate_block_num",
    "calculate_fixed_block_memory_bytes",
    "check_invariants",
    "dtype_itemsize",
    "fork_request",
    "format_usage",
    "free_request",
    "get_block_ids",
    "hash_function",
    "lookup_prefix",
    "num_cached_blocks",
    "num_free_blocks",
    "policy_class",
    "recycle_skipped_blocks",
    "register_policy",
    "registered_attn_types",
    "replay",
    "reset_prefix_cache",
    "validate_cache_info",
]
