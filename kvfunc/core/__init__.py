"""The pure core: states, transitions, deltas, policies and sizing.

Imports only the standard library, attrs and pyrsistent (never torch).  The
modules, by what they hold:

* metadata and sizing: ``_cache_info``, ``_dtypes``, ``_validate``, ``_sizing``,
  ``_shared_sizing`` (a pool shared by every group),
  ``_sizing_config``;
* policies (one per attention type): ``_policies``; the questions the
  allocator asks them, one function each: ``_policy``;
* the state: ``_state`` (the state, its layouts and its working copy),
  ``_group`` (a group's rows and primitives), ``_rows`` (block tables),
  ``_pool`` (the block pool: free queue, reference counts, hash index,
  eviction order), ``_queue`` (the free queues), ``_invariants``;
* the step and its folds, in the order a request travels: ``_transitions``
  -> ``_fold`` -> ``_step`` -> ``_policy`` -> ``_group`` -> ``_pool`` ->
  ``_delta``;
* prefix caching: ``_hashing``, ``_prefix``, ``_prefix_ops``;
* tiers below the device (host memory, a remote store): ``_tiers`` (theory of
  operation, admission), ``_tier_lookup`` (the cross-tier hit), ``_tier_state``,
  ``_tier_index``, ``_tier_work``, ``_tier_moves``, ``_tier_delta``, ``_tier_checks``;
* deltas and replay: ``_ops`` (the operation records), ``_delta``, ``_replay``;
* argument checks and errors: ``_checks``, ``_errors``.

``kvfunc.core._internal`` names what the compat facade and the shell build on.
"""

from kvfunc.core._cache_info import (
    CacheAllocator,
    CacheEntry,
    LayerCacheInfo,
    MambaCacheEntry,
    MemoryBudgetItem,
    ModelCacheInfo,
    OffloadWorkspaceMemoryInfo,
)
from kvfunc.core._checks import MAX_NUM_BLOCKS, MAX_PRIORITY
from kvfunc.core._delta import COPY_INTO_NEW, COPY_SAVED, DELTA_VERSION, BlocksChanged
from kvfunc.core._detach import DetachResult, detach_request, evict_blocks, free_detached
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
from kvfunc.core._fold import SlotRequest
from kvfunc.core._group import GroupState
from kvfunc.core._hashing import HASH_FUNCTIONS, BlockHash, BlockHashes, hash_function
from kvfunc.core._invariants import check_invariants
from kvfunc.core._ops import (
    Appended,
    Cleared,
    Copied,
    Detached,
    Dropped,
    Evicted,
    Freed,
    LookedUp,
    Nulled,
    Operation,
    Registered,
    Released,
    Retained,
    Shared,
    Stored,
)
from kvfunc.core._policies import (
    FullAttention,
    Mamba,
    SlidingWindow,
    policy_class,
    register_policy,
    registered_attn_types,
)
from kvfunc.core._policy import Policy
from kvfunc.core._pool import PoolState
from kvfunc.core._prefix import PrefixHit, lookup_prefix
from kvfunc.core._prefix_ops import (
    PrefixCacheStats,
    fork_request,
    num_cached_blocks,
    reset_prefix_cache,
)
from kvfunc.core._replay import replay
from kvfunc.core._shared_sizing import (
    GroupPage,
    PageEntry,
    SharedPageLayout,
    SharedPoolSizing,
    calculate_shared_block_num,
    shared_page_layout,
)
from kvfunc.core._sizing import (
    SizingConfig,
    calculate_block_num,
    calculate_fixed_block_memory_bytes,
)
from kvfunc.core._state import LAYOUTS, NULL_BLOCK, BlockId, KVState, RequestId
from kvfunc.core._tier_checks import check_tiered_invariants, replay_tiered
from kvfunc.core._tier_delta import TIER_DELTA_VERSION, TierDelta
from kvfunc.core._tier_index import TierEntry, TierIndex
from kvfunc.core._tier_lookup import TieredHit, lookup_tiers
from kvfunc.core._tier_moves import MovesResult, complete_moves, loads_pending
from kvfunc.core._tier_state import (
    DIRECTIONS as MOVE_DIRECTIONS,
)
from kvfunc.core._tier_state import (
    MEDIUMS as TIER_MEDIUMS,
)
from kvfunc.core._tier_state import (
    WRITE_POLICIES,
    HostTier,
    RemoteTier,
    TieredState,
    TierMove,
)
from kvfunc.core._tiers import TieredResult, allocate_tiered, free_tiered
from kvfunc.core._transitions import (
    AllocationResult,
    BatchResult,
    allocate_batch,
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
    "LAYOUTS",
    "MAX_NUM_BLOCKS",
    "MAX_PRIORITY",
    "MOVE_DIRECTIONS",
    "NULL_BLOCK",
    "SUPPORTED_CACHE_LAYOUTS",
    "TIER_DELTA_VERSION",
    "TIER_MEDIUMS",
    "WRITE_POLICIES",
    "AllocationResult",
    "Appended",
    "BatchResult",
    "BlockHash",
    "BlockHashes",
    "BlockId",
    "BlockIndexError",
    "BlocksChanged",
    "CacheAllocator",
    "CacheEntry",
    "Cleared",
    "Copied",
    "DetachResult",
    "Detached",
    "DoubleFreeError",
    "Dropped",
    "Evicted",
    "Freed",
    "FullAttention",
    "GroupPage",
    "GroupState",
    "HostTier",
    "InsufficientMemoryError",
    "InvalidArgumentError",
    "InvalidCacheInfo",
    "InvalidTypeError",
    "KVFuncError",
    "KVState",
    "LLMError",
    "LLMStatusCode",
    "LayerCacheInfo",
    "LookedUp",
    "Mamba",
    "MambaCacheEntry",
    "MemoryBudgetItem",
    "MissingKeyError",
    "MissingTensorError",
    "ModelCacheInfo",
    "MovesResult",
    "NotSupportedError",
    "Nulled",
    "OffloadWorkspaceMemoryInfo",
    "Operation",
    "OutOfBlocksError",
    "PageEntry",
    "Policy",
    "PoolState",
    "PrefixCacheStats",
    "PrefixHit",
    "Registered",
    "Released",
    "RemoteTier",
    "ReplayMismatchError",
    "RequestId",
    "Retained",
    "Shared",
    "SharedPageLayout",
    "SharedPoolSizing",
    "SizingConfig",
    "SlidingWindow",
    "SlotRequest",
    "Stored",
    "TierDelta",
    "TierEntry",
    "TierIndex",
    "TierMove",
    "TieredHit",
    "TieredResult",
    "TieredState",
    "UnknownAttentionTypeError",
    "UnknownRequestError",
    "allocate_batch",
    "allocate_slots",
    "allocate_tiered",
    "calculate_block_num",
    "calculate_fixed_block_memory_bytes",
    "calculate_shared_block_num",
    "check_invariants",
    "check_tiered_invariants",
    "complete_moves",
    "detach_request",
    "dtype_itemsize",
    "evict_blocks",
    "fork_request",
    "format_usage",
    "free_detached",
    "free_request",
    "free_tiered",
    "get_block_ids",
    "hash_function",
    "loads_pending",
    "lookup_prefix",
    "lookup_tiers",
    "num_cached_blocks",
    "num_free_blocks",
    "policy_class",
    "recycle_skipped_blocks",
    "register_policy",
    "registered_attn_types",
    "replay",
    "replay_tiered",
    "reset_prefix_cache",
    "shared_page_layout",
    "validate_cache_info",
]
