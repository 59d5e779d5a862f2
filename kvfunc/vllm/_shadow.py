"""Shadow mode: vLLM's own manager serves, kvfunc's is mirrored beside it and compared.

Every call vLLM's scheduler makes on its manager that looks up, changes or
reports the cache is made on both managers (``_shadow_base``), with the
mirror's own blocks in place of the primary's, and compared::

    get_computed_blocks        hit tokens and block ids, shared-prefix boundary
    allocate_slots             refused or not, the new block ids, the request's table
    every change               free blocks and usage afterwards
    pop_blocks_for_free        the detached block ids
    estimate_cached_tokens     the estimate
    reset_prefix_cache         the answer
    make_prefix_cache_stats    vLLM's stats record
    take_events                vLLM's KV event records
    take_new_block_ids         the block ids to zero

The first difference is kept as :attr:`ShadowKVCacheManager.divergence`
(with the calls that led to it and kvfunc's replayable delta log) and
stops the mirror; with ``KVFUNC_VLLM_SHADOW_LOG`` naming a directory the log
is written there too.
"""

from __future__ import annotations

from typing import Any

from kvfunc.vllm._manager import KVCacheManager
from kvfunc.vllm._shadow_base import ShadowBase

__all__ = ["ShadowKVCacheManager"]

_STATS = ("requests", "queries", "hits", "preempted_requests", "preempted_queries",
          "preempted_hits", "reset")


def _stats(stats: Any) -> Any:
    return None if stats is None else tuple(getattr(stats, f, None) for f in _STATS)


class ShadowKVCacheManager(ShadowBase):
    """vLLM's ``KVCacheManager`` serving, kvfunc's mirrored and compared (module docstring)."""

    def get_computed_blocks(self, request: Any, max_cache_hit_length: int | None = None
                            ) -> tuple[Any, int, int]:
        """vLLM's prefix hit; kvfunc's is compared with it."""
        out = self._primary.get_computed_blocks(request, max_cache_hit_length)
        call = f"get_computed_blocks({request.request_id!r}, {max_cache_hit_length})"
        mine = self._mirrored(call, lambda m: m.get_computed_blocks(
            request, max_cache_hit_length))
        if mine is not None:
            self._check(call, "prefix hit (tokens, block ids, shared-prefix boundary)",
                        (mine[1], mine[0].get_block_ids(), mine[2]),
                        (out[1], out[0].get_block_ids(), out[2]))
        return out  # type: ignore[no-any-return]

    def get_computed_blocks_for_connector(self, request: Any,
                                          max_cache_hit_length: int | None = None) -> Any:
        """vLLM's connector lookup; kvfunc's hit is compared with it."""
        out = self._primary.get_computed_blocks_for_connector(request, max_cache_hit_length)
        call = f"get_computed_blocks_for_connector({request.request_id!r})"
        mine = self._mirrored(call, lambda m: m.get_computed_blocks_for_connector(
            request, max_cache_hit_length))
        if mine is not None:
            self._check(call, "prefix hit (tokens, block ids)",
                        (mine[1], mine[0].get_block_ids()), (out[1], out[0].get_block_ids()))
        return out

    def allocate_slots(self, request: Any, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: Any = None, num_lookahead_tokens: int = 0,
                       num_external_computed_tokens: int = 0, delay_cache_blocks: bool = False,
                       num_encoder_tokens: int = 0, full_sequence_must_fit: bool = False,
                       reserved_blocks: int = 0, has_scheduled_reqs: bool = True,
                       skip_zeroing_group_ids: tuple[int, ...] = ()) -> Any:
        """vLLM's allocation; kvfunc's refusal, new blocks and table are compared with it."""
        options: dict[str, Any] = {"num_lookahead_tokens": num_lookahead_tokens,
                   "num_external_computed_tokens": num_external_computed_tokens,
                   "delay_cache_blocks": delay_cache_blocks,
                   "num_encoder_tokens": num_encoder_tokens,
                   "full_sequence_must_fit": full_sequence_must_fit,
                   "reserved_blocks": reserved_blocks, "has_scheduled_reqs": has_scheduled_reqs,
                   "skip_zeroing_group_ids": skip_zeroing_group_ids}
        out = self._primary.allocate_slots(request, num_new_tokens, num_new_computed_tokens,
                                           new_computed_blocks, **options)
        rid = request.request_id
        shown = "".join(f", {k}={v!r}" for k, v in options.items() if v)
        call = (f"allocate_slots({rid!r}, {num_new_tokens}, {num_new_computed_tokens}, "
                f"{None if new_computed_blocks is None else new_computed_blocks.get_block_ids()}"
                f"{shown}) with {request.num_computed_tokens} computed of "
                f"{request.num_tokens} tokens")
        mirrored = self._to_mirror(new_computed_blocks)

        def run(m: KVCacheManager) -> tuple[Any]:
            return (m.allocate_slots(request, num_new_tokens, num_new_computed_tokens, mirrored,
                                     **options),)

        mine = self._mirrored(call, run)
        if mine is not None and self._check(call, "refused", mine[0] is None, out is None):
            if out is not None:
                self._check(call, "new block ids", mine[0].get_block_ids(), out.get_block_ids())
                mirror = self._mirror
                if mirror is not None:
                    self._check(call, "the request's block table", mirror.get_block_ids(rid),
                                self._primary.get_block_ids(rid))
            self._check_counts(call)
        return out

    def free(self, request: Any) -> None:
        """Free on both."""
        self._primary.free(request)
        call = f"free({request.request_id!r})"
        self._mirrored(call, lambda m: m.free(request))
        self._check_counts(call)

    def pop_blocks_for_free(self, request: Any) -> list[Any]:
        """Detach on both; the blocks go back later through ``block_pool.free_blocks``."""
        out: list[Any] = self._primary.pop_blocks_for_free(request)
        call = f"pop_blocks_for_free({request.request_id!r})"
        mine = self._mirrored(call, lambda m: m.pop_blocks_for_free(request))
        if mine is not None:
            self._check(call, "detached block ids", [b.block_id for b in mine],
                        [b.block_id for b in out])
        self._check_counts(call)
        return out

    def cache_blocks(self, request: Any, num_computed_tokens: int) -> None:
        """Cache on both."""
        self._primary.cache_blocks(request, num_computed_tokens)
        call = f"cache_blocks({request.request_id!r}, {num_computed_tokens})"
        self._mirrored(call, lambda m: m.cache_blocks(request, num_computed_tokens))
        self._check_counts(call)

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        """Let the window's dead blocks go on both."""
        self._primary.remove_skipped_blocks(request_id, processed_computed_tokens,
                                            num_prompt_tokens)
        call = f"remove_skipped_blocks({request_id!r}, {processed_computed_tokens})"
        self._mirrored(call, lambda m: m.remove_skipped_blocks(
            request_id, processed_computed_tokens, num_prompt_tokens))
        self._check_counts(call)

    def reset_prefix_cache(self) -> bool:
        """Reset on both; the answers are compared."""
        out = bool(self._primary.reset_prefix_cache())
        mine = self._mirrored("reset_prefix_cache()", lambda m: (m.reset_prefix_cache(),))
        if mine is not None:
            self._check("reset_prefix_cache()", "reset answer", mine[0], out)
        self._check_counts("reset_prefix_cache()")
        return out

    def estimate_cached_tokens(self, request: Any) -> int:
        """vLLM's estimate; kvfunc's is compared with it."""
        out: int = self._primary.estimate_cached_tokens(request)
        call = f"estimate_cached_tokens({request.request_id!r})"
        mine = self._mirrored(call, lambda m: (m.estimate_cached_tokens(request),))
        if mine is not None:
            self._check(call, "cached-token estimate", mine[0], out)
        return out

    def record_prefix_cache_stats(self, request: Any, num_hits: int) -> None:
        """Record on both (compared when taken)."""
        self._primary.record_prefix_cache_stats(request, num_hits)
        self._mirrored(f"record_prefix_cache_stats({request.request_id!r}, {num_hits})",
                       lambda m: m.record_prefix_cache_stats(request, num_hits))

    def make_prefix_cache_stats(self) -> Any:
        """vLLM's stats; kvfunc's are compared with them."""
        out = self._primary.make_prefix_cache_stats()
        mine = self._mirrored("make_prefix_cache_stats()", lambda m: (m.make_prefix_cache_stats(),))
        if mine is not None:
            self._check("make_prefix_cache_stats()", "prefix-cache stats", _stats(mine[0]),
                        _stats(out))
        return out

    def take_events(self) -> list[Any]:
        """vLLM's KV events; kvfunc's are compared with them."""
        out: list[Any] = self._primary.take_events()
        mine = self._mirrored("take_events()", lambda m: (m.take_events(),))
        if mine is not None:
            self._check("take_events()", "KV events", mine[0], out)
        return out

    def take_new_block_ids(self) -> list[int]:
        """vLLM's block ids to zero; kvfunc's are compared with them."""
        out: list[int] = self._primary.take_new_block_ids()
        mine = self._mirrored("take_new_block_ids()", lambda m: (m.take_new_block_ids(),))
        if mine is not None:
            self._check("take_new_block_ids()", "block ids to zero", mine[0], out)
        return out

    def record_blocks_for_zeroing(self, request_id: str, start_token: int) -> None:
        """Record on both (compared when taken)."""
        self._primary.record_blocks_for_zeroing(request_id, start_token)
        self._mirrored(f"record_blocks_for_zeroing({request_id!r}, {start_token})",
                       lambda m: m.record_blocks_for_zeroing(request_id, start_token))

    def new_step_starts(self) -> None:
        """Tell both."""
        self._primary.new_step_starts()
        self._mirrored("new_step_starts()", lambda m: m.new_step_starts())
