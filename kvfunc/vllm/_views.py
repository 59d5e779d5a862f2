"""The parts of vLLM's manager internals its scheduler reads, as views of the manager.

vLLM's scheduler reaches past its manager in a few places: the block pool
(free counts, deferred frees) and the coordinator (each group's block size
and spec, the block arithmetic of admissions).  These views answer exactly
those calls from the manager's one kvfunc state.  Anything else a caller
reads from them is an internal of vLLM's own manager that kvfunc does not
keep: :class:`ManagerInternalsError` names it (an ``AttributeError``, so
``hasattr`` still answers False).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from kvfunc.vllm._layout import NotModelledError

__all__ = ["BlockPoolView", "CoordinatorView", "GroupView", "ManagerInternalsError",
           "ViewedManager"]


class ManagerInternalsError(NotModelledError, AttributeError):
    """Something read an internal of vLLM's own manager that kvfunc's manager does not keep.

    >>> issubclass(ManagerInternalsError, AttributeError)
    True
    """


class ViewedManager(Protocol):
    """What the views ask of the manager."""

    @property
    def num_free_blocks(self) -> int: ...

    @property
    def usage(self) -> float: ...

    def free_detached_blocks(self, ordered_blocks: Iterable[Any]) -> None: ...

    def evict_blocks(self, block_ids: set[int]) -> None: ...

    def reset_pool_cache(self) -> bool: ...

    def take_raw_events(self) -> list[Any]: ...

    def num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                               new_computed_blocks: Sequence[Sequence[Any]] | None,
                               total_computed_tokens: int, apply_admission_cap: bool) -> int: ...


def _internals(owner: str, name: str) -> ManagerInternalsError:
    return ManagerInternalsError(
        f"kvfunc's vLLM KV cache manager has no {owner}.{name}: that is an internal of "
        "vLLM's own manager (its state lives in one kvfunc value, see "
        "KVCacheManager.snapshot()); run this code with vLLM's own manager (unset KVFUNC_VLLM)")


class BlockPoolView:
    """``kv_cache_manager.block_pool``: free counts, deferred frees, eviction, reset."""

    def __init__(self, manager: ViewedManager, num_blocks: int, block_size: int,
                 enable_caching: bool, null_block: Any) -> None:
        self._manager = manager
        self.num_gpu_blocks = num_blocks
        self.hash_block_size = block_size
        self.enable_caching = enable_caching
        self.null_block = null_block

    def __getattr__(self, name: str) -> Any:
        raise _internals("block_pool", name)

    def get_num_free_blocks(self) -> int:
        """Free blocks (cached ones waiting in the free queue included)."""
        return self._manager.num_free_blocks

    def get_usage(self) -> float:
        """The share of blocks in use, the null block left out."""
        return self._manager.usage

    def free_blocks(self, ordered_blocks: Iterable[Any]) -> None:
        """Let blocks go that ``pop_blocks_for_free`` detached, in the order given."""
        self._manager.free_detached_blocks(ordered_blocks)

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Forget what the given blocks cache (held or free)."""
        self._manager.evict_blocks(set(block_ids))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; False while any block is in use."""
        return self._manager.reset_pool_cache()

    def take_events(self) -> list[Any]:
        """The KV events since the last call (without the manager's spec annotations)."""
        return self._manager.take_raw_events()


class GroupView:
    """``coordinator.single_type_managers[i]``: one group's block size and spec."""

    def __init__(self, group_id: int, spec: Any, block_size: int, enable_caching: bool) -> None:
        self.kv_cache_group_id = group_id
        self.kv_cache_spec = spec
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.use_eagle = False

    def __getattr__(self, name: str) -> Any:
        raise _internals(f"coordinator.single_type_managers[{self.kv_cache_group_id}]", name)


class CoordinatorView:
    """``kv_cache_manager.coordinator``: the groups and vLLM's admission arithmetic."""

    def __init__(self, manager: ViewedManager, groups: Sequence[GroupView],
                 block_pool: BlockPoolView, kv_cache_config: Any, block_size: int) -> None:
        self._manager = manager
        self.single_type_managers = tuple(groups)
        self.block_pool = block_pool
        self.kv_cache_config = kv_cache_config
        self.scheduler_block_size = block_size
        self.hash_block_size = block_size
        self.enable_partial_hash_hits = False
        self.eagle_group_ids: set[int] = set()
        self.drop_eagle_group_ids: set[int] = set()
        self.num_reprefillable_tokens = 0

    def __getattr__(self, name: str) -> Any:
        raise _internals("coordinator", name)

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[Sequence[Any]],
                                   num_encoder_tokens: int, total_computed_tokens: int,
                                   num_local_computed_tokens: int, num_tokens_main_model: int,
                                   apply_admission_cap: bool = False,
                                   prefill_end: int = 0) -> int:
        """vLLM's block need of a request for ``num_tokens`` tokens (a query)."""
        return self._manager.num_blocks_to_allocate(
            request_id, num_tokens, new_computed_blocks, total_computed_tokens,
            apply_admission_cap)
