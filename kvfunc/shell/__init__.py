"""The torch shell: turns the pure core's states and deltas into tensors.

The shell has no policy.  It resolves devices (:func:`resolve_device`),
allocates cache tensors (:func:`with_cache_tensors`; for a pool shared by
every group, overlaid views: :func:`with_shared_cache_tensors`), builds block tables
and slot mappings from a state (:func:`build_block_tables`,
:func:`build_slot_mappings`) or keeps them up to date from deltas
(:class:`BlockTableBuffer`), performs the block operations a delta asks for
(:func:`apply_delta`, :func:`copy_blocks`, :func:`swap_blocks`,
:func:`zero_blocks`), moves blocks between a device cache and its host tier
(:class:`HostBlockPool`, :class:`BlockMover`) and between the host tier and
Mooncake Store (:class:`MooncakeStore`), and ships a reference paged
attention and a tiny decoder (:class:`TinyDecoder`) that verify all of it
end to end.

Importing it checks that pyrsistent runs with its C extension: without
``pvectorc`` the allocator's hot path is 2-6x slower, so a build without it
is an installation error, not a silent slowdown.
"""

from kvfunc.shell._blocks import TensorSet, apply_delta, copy_blocks, swap_blocks, zero_blocks
from kvfunc.shell._buffer import BlockTableBuffer, TableSpec, specs_from_state
from kvfunc.shell._device import (
    DeviceError,
    DeviceLike,
    import_torch_npu,
    resolve_device,
    torch_dtype,
)
from kvfunc.shell._host_pool import HostBlockPool
from kvfunc.shell._memory import device_memory_info, host_memory_info
from kvfunc.shell._mooncake_config import MooncakeStoreConfig
from kvfunc.shell._mooncake_store import MooncakeStore
from kvfunc.shell._move_handles import LayerHandle, MoveHandle
from kvfunc.shell._reference_attention import (
    attend,
    gather_from_cache,
    paged_attention,
    write_to_cache,
)
from kvfunc.shell._reference_model import TinyDecoder, TinyDecoderConfig
from kvfunc.shell._shared_tensors import (
    create_shared_cache_tensors,
    overlay_view,
    shared_page_buffers,
    with_shared_cache_tensors,
)
from kvfunc.shell._store_errors import (
    MOONCAKE_ERROR_CODES,
    StoreConflictError,
    StoreDataError,
    StoreError,
    StoreFullError,
    StoreMissError,
    StoreRequestError,
    StoreTimeoutError,
    StoreUnavailableError,
    mooncake_error,
)
from kvfunc.shell._store_keys import TransferResult, block_key
from kvfunc.shell._tables import build_block_tables, build_slot_mappings, slot_mapping
from kvfunc.shell._tensors import (
    ALIGNMENT_BYTES,
    CacheTensorSpec,
    cache_tensors_by_key,
    create_cache_tensors,
    empty_aligned,
    empty_host_addressable,
    plan_cache_tensors,
    with_cache_tensors,
)
from kvfunc.shell._tiers import BlockMover


def _require_pvectorc() -> None:
    try:
        import pvectorc  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the installation
        msg = ("pyrsistent is installed without its C extension (pvectorc); reinstall it "
               "from a wheel or with a C compiler available")
        raise ImportError(msg) from exc


_require_pvectorc()

__all__ = [
    "ALIGNMENT_BYTES",
    "MOONCAKE_ERROR_CODES",
    "BlockMover",
    "BlockTableBuffer",
    "CacheTensorSpec",
    "DeviceError",
    "DeviceLike",
    "HostBlockPool",
    "LayerHandle",
    "MooncakeStore",
    "MooncakeStoreConfig",
    "MoveHandle",
    "StoreConflictError",
    "StoreDataError",
    "StoreError",
    "StoreFullError",
    "StoreMissError",
    "StoreRequestError",
    "StoreTimeoutError",
    "StoreUnavailableError",
    "TableSpec",
    "TensorSet",
    "TinyDecoder",
    "TinyDecoderConfig",
    "TransferResult",
    "apply_delta",
    "attend",
    "block_key",
    "build_block_tables",
    "build_slot_mappings",
    "cache_tensors_by_key",
    "copy_blocks",
    "create_cache_tensors",
    "create_shared_cache_tensors",
    "device_memory_info",
    "empty_aligned",
    "empty_host_addressable",
    "gather_from_cache",
    "host_memory_info",
    "import_torch_npu",
    "mooncake_error",
    "overlay_view",
    "paged_attention",
    "plan_cache_tensors",
    "resolve_device",
    "shared_page_buffers",
    "slot_mapping",
    "specs_from_state",
    "swap_blocks",
    "torch_dtype",
    "with_cache_tensors",
    "with_shared_cache_tensors",
    "write_to_cache",
    "zero_blocks",
]
