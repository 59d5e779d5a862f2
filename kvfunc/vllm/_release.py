"""Transitions that give blocks back or forget cached ones, and late caching.

Each method is one kvfunc transition (see ``_base``): ``free`` releases a
request's blocks last block first (vLLM's order: a prefix's tail is evicted
before its head); ``pop_blocks_for_free`` detaches them, still held, until
the scheduler's deferred ``block_pool.free_blocks`` lets them go;
``evict_blocks`` forgets what blocks cache; ``reset_prefix_cache`` forgets
everything, and refuses while any block is in use, as vLLM does.

``cache_blocks`` caches a request's blocks that filled since it was
scheduled (vLLM calls it once the tokens are confirmed): an allocation that
writes, copies and frees nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import kvfunc as kf
from kvfunc.core._internal import run_free
from kvfunc.vllm._base import ManagerBase, logger

__all__ = ["Release"]


class Release(ManagerBase):
    """The transitions that release, evict, reset and cache late."""

    def free(self, request: Any) -> None:
        """Give every block of the request back (last block first)."""
        rid, state = request.request_id, self._state_for(request, False)  # what it owes first
        self._hashes.drop(rid)
        self._commit(*run_free(state, rid, self._records), "free", request)

    def pop_blocks_for_free(self, request: Any) -> list[Any]:
        """Drop the request's tables; its blocks stay held until ``block_pool.free_blocks``."""
        rid, state = request.request_id, self._state_for(request, False)  # what it owes first
        self._hashes.drop(rid)
        result = kf.detach_request(state, rid)
        self._commit(result.state, result.delta, "pop_blocks_for_free", request)
        blocks = self._handles.blocks
        return [b for key in self._layout.keys for b in blocks(result.block_ids.get(key, ()))]

    def free_detached_blocks(self, ordered_blocks: Iterable[Any]) -> None:
        """Let detached blocks go in the order given (``block_pool.free_blocks``).

        vLLM frees them in one pass over its one pool, so kvfunc lets them go
        in one ``free_detached`` of the pool (its rows name the first group).
        """
        ids = [block.block_id for block in ordered_blocks if not block.is_null]
        if ids:
            state, delta = kf.free_detached(self._state if self._owes_blocks else self._value,
                                            {self._layout.keys[0]: ids})
            self._commit(state, delta, "free_detached", None, (tuple(ids),))

    def evict_blocks(self, block_ids: set[int]) -> None:
        """Forget what the given blocks cache; held blocks stay with their requests."""
        ids = [b for b in block_ids if b]
        if self.metrics_collector is not None:
            for b in ids:
                self.metrics_collector.on_block_evicted(self._handles.blocks((b,))[0])
        if ids:
            state, delta = kf.evict_blocks(self._state, ids)
            self._commit(state, delta, "evict_blocks", None, (tuple(ids),))

    def reset_pool_cache(self) -> bool:
        """Forget every cached block, or False while any block is in use (the pool's part)."""
        used = self._layout.num_blocks - 1 - self.num_free_blocks
        if used:
            logger.warning("Failed to reset prefix cache because some blocks (%d) are not "
                           "freed yet", used)
            return False
        self._commit(*kf.reset_prefix_cache(self._state), "reset_prefix_cache", None)
        if self.metrics_collector is not None:
            self.metrics_collector.reset()
        logger.info("Successfully reset prefix cache")
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (RLHF weight updates, benchmarks); False while in use."""
        if not self.reset_pool_cache():
            return False
        if self.log_stats:
            assert self.prefix_cache_stats is not None
            self.prefix_cache_stats.reset = True
        return True

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        """Free the blocks that slid out of the request's windows."""
        state = self._value
        if self._owes_blocks or request_id in self._owed:  # what is owed is done first
            state = self._state
        if state.group(self._layout.keys[0]).row(request_id) is None:
            return
        computed = max(0, processed_computed_tokens)
        state, delta = kf.recycle_skipped_blocks(state, request_id, computed)
        self._commit(state, delta, "recycle_skipped_blocks", _Named(request_id), (computed,))

    def cache_blocks(self, request: Any, num_computed_tokens: int) -> None:
        """Cache the request's blocks that are full within its first ``num_computed_tokens``.

        An allocation that writes nothing: ``num_new_tokens`` reaches the
        count (blocks that are full by then are cached) and a lookahead of
        minus that count leaves no slot to allocate, no block to copy and, with
        no computed token, nothing for a window to let go (vLLM's
        ``cache_blocks`` frees nothing).
        """
        if not self.enable_caching:
            return
        rid, state = request.request_id, self._state_for(request)
        if state.group(self._layout.keys[0]).row(rid) is None:
            return
        n = min(max(0, num_computed_tokens), self.max_model_len)
        result = kf.allocate_slots(state, rid, 0, n, -n,
                                   block_hashes=self._hashes.of(request))
        if result.ok:
            self._commit(result.state, result.delta, "cache_blocks", request, (n,))


class _Named:
    """A stand-in request that only names itself (for a transition's record)."""

    __slots__ = ("request_id",)

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
