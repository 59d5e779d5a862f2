"""kvfunc as vLLM 0.33's KV cache manager: the drop-in class.

Theory of operation
-------------------
:class:`KVCacheManager` has the constructor of vLLM's
``vllm.v1.core.kv_cache_manager.KVCacheManager`` and every method and
attribute vLLM's ``Scheduler`` uses.  It keeps one kvfunc
:class:`~kvfunc.KVState` (``_base``); each scheduler call that changes the
cache is one pure transition::

    allocate_slots            kf.allocate_slots   (refused: kf.recycle_skipped_blocks,
                                                   as vLLM frees what slid out first;
                                                   only caching: owed, see _base)
    free                      kf.free_request
    pop_blocks_for_free       kf.detach_request   (block_pool.free_blocks later:
                                                   kf.free_detached)
    cache_blocks              kf.allocate_batch   (no new block: caching only)
    remove_skipped_blocks     kf.recycle_skipped_blocks
    evict_blocks              kf.evict_blocks
    reset_prefix_cache        kf.reset_prefix_cache (refused while blocks are in use)

Lookups and queries (``get_computed_blocks``, ``get_blocks``, ``usage``,
``estimate_cached_tokens``) read the state; stats and events follow vLLM's
meaning.  ``snapshot()`` and ``restore()`` give the state as a kvfunc value.
"""

from __future__ import annotations

from typing import Any

from kvfunc.vllm import _accounting
from kvfunc.vllm._allocate import Allocation
from kvfunc.vllm._events import annotate
from kvfunc.vllm._release import Release

__all__ = ["KVCacheManager"]


class KVCacheManager(Allocation, Release):
    """vLLM 0.33's ``KVCacheManager`` backed by one kvfunc state (see the module docstring).

    Build it with vLLM's arguments (``vllm.v1.kv_cache_interface.KVCacheConfig``
    and the rest); a configuration kvfunc does not model raises
    :class:`~kvfunc.vllm.NotModelledError` naming the feature.
    """

    # -- tables --------------------------------------------------------------------------
    def get_blocks(self, request_id: str) -> Any:
        """The request's blocks per group, as ``KVCacheBlocks``."""
        blocks = self._handles.blocks
        return self.create_kv_cache_blocks(tuple(
            blocks(g.table(request_id)) for g in self._tables.groups))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block ids per group (null entries are 0; caching owed changes none)."""
        return tuple(list(g.table(request_id)) for g in self._tables.groups)

    def get_block_ids_for_computed_tokens(self, request_id: str, num_computed_tokens: int
                                          ) -> tuple[list[int], ...]:
        """The request's block ids that cover its first ``num_computed_tokens`` tokens."""
        n = -(-num_computed_tokens // self._layout.block_size)
        return tuple(ids[:n] for ids in self.get_block_ids(request_id))

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        """0 per group (cascade attention is gone from vLLM; kept for old schedulers)."""
        return [0] * self.num_kv_cache_groups

    def estimate_cached_tokens(self, request: Any) -> int:
        """Tokens of the request's blocks that are cached (the smallest over the groups)."""
        return _accounting.estimate_cached_tokens(self._state_for(request, False),
                                                  self._layout, request.request_id)

    # -- stats, events, zeroing ------------------------------------------------------------
    def record_prefix_cache_stats(self, request: Any, num_hits: int) -> None:
        """Count one admission's lookup (vLLM's meaning: tokens asked, tokens hit)."""
        if not self.log_stats or not self.prefix_cache_lookup_enabled(request):
            return
        assert self.prefix_cache_stats is not None
        self.prefix_cache_stats.record(num_tokens=request.num_tokens, num_hits=num_hits,
                                       preempted=request.num_preemptions > 0)

    def make_prefix_cache_stats(self) -> Any:
        """The prefix-cache stats since the last call (None without ``log_stats``)."""
        if not self.log_stats:
            return None
        from vllm.v1.metrics.stats import PrefixCacheStats

        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def take_raw_events(self) -> list[Any]:
        """The KV events since the last call, as vLLM's block pool queues them."""
        events, self._events = self._events, []
        return events

    def take_events(self) -> list[Any]:
        """The KV events since the last call, stamped with their group's spec."""
        events = self.take_raw_events()
        return annotate(events, self.kv_cache_event_metadata) if events else events

    def take_new_block_ids(self) -> list[int]:
        """Block ids handed out since the last call, for zeroing (when vLLM zeroes)."""
        ids, self._new_block_ids = self._new_block_ids, []
        return ids

    def record_blocks_for_zeroing(self, request_id: str, start_token: int) -> None:
        """Zero the request's blocks from ``start_token`` on again (after a failed load)."""
        if not self._zeroing:
            return
        first = start_token // self._layout.block_size
        for ids in self.get_block_ids(request_id):
            self._new_block_ids.extend(b for b in ids[first:] if b)

    def take_kv_cache_block_copies(self) -> tuple[list[Any], list[Any]]:
        """No copies: kvfunc's manager makes no partial-hit copies."""
        return [], []

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        """None: boundary states belong to Mamba "align" groups, which are not modelled."""
        return {}

    def finalize_partial_tail_offloads(self, request: Any) -> list[tuple[int, int, int]]:
        """None: partial tails belong to Mamba "align" groups, which are not modelled."""
        return []

    def new_step_starts(self) -> None:
        """Nothing to do when a step starts (only Mamba groups act on it)."""
