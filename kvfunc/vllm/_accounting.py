"""The questions vLLM's scheduler asks in blocks and tokens, answered from a kvfunc state.

vLLM's scheduler sizes admissions with its manager's own arithmetic
(``get_num_blocks_to_allocate``: the full-sequence admission gate and the
reservation of in-flight prefills) and estimates cached tokens for its
metrics.  These are queries: they read the state and change nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvfunc.core import KVState
from kvfunc.vllm._layout import Layout

__all__ = ["blocks_to_allocate", "estimate_cached_tokens", "fa_hit_tokens"]


def blocks_to_allocate(state: KVState, layout: Layout, request_id: str, num_tokens: int,
                       hit: Sequence[Sequence[int]] | None, total_computed_tokens: int,
                       apply_admission_cap: bool) -> int:
    """vLLM's ``get_num_blocks_to_allocate`` summed over the groups.

    A request that already holds a table needs ``ceil(num_tokens / bs)``
    entries minus those it holds; a new one needs the blocks its prefix hit
    does not give, and every hit block that waits in the free queue (taking
    it out counts against the free blocks).  ``apply_admission_cap`` caps a
    sliding window's need at vLLM's recycling-aware admission cap.
    """
    bs = layout.block_size
    required = -(-num_tokens // bs)
    total = 0
    for i, group in enumerate(state.groups):
        need = required
        cap = layout.caps[i]
        if apply_admission_cap and cap is not None and cap < need:
            need = cap
        held = len(group.table(request_id))
        if held:
            total += max(need - held, 0)
            continue
        window = layout.windows[i]
        skipped = 0 if window is None else max(0, total_computed_tokens - window + 1) // bs
        table = hit[i] if hit else ()
        total += max(need - max(skipped, len(table)), 0)
        held_by = table[skipped:]
        if any(held_by):
            with state.pools[group.pool].reading() as store:  # the manager's pools are linked
                refs = store.refs
                total += sum(1 for b in held_by if b and not refs[b])
    return total


def estimate_cached_tokens(state: KVState, layout: Layout, request_id: str) -> int:
    """Tokens of the request's blocks that are cached, the smallest over the groups."""
    bs = layout.block_size
    cached: int | None = None
    for group in state.groups:
        pool = state.pools[group.pool]
        table = group.table(request_id)
        tokens = 0
        if pool.caching and table:
            with pool.reading() as store:
                hash_of = store.hash_of
                for p in range(len(table) - 1, -1, -1):
                    b = table[p]
                    if b and hash_of[b] is not None:
                        tokens = (p + 1) * bs
                        break
        cached = tokens if cached is None else min(cached, tokens)
    return cached or 0


def fa_hit_tokens(state: KVState, layout: Layout, digests: Sequence[bytes], limit: int) -> int:
    """The longest prefix (up to ``limit`` tokens) that every full-attention group caches.

    vLLM's hybrid lookup reports a shared prefix that full attention caches
    but a sliding window does not (``shared_prefix_boundary``); its
    full-attention groups of one spec look up together, so a block counts
    only when all of them cache it.  A pool's index keys a digest followed by
    the group's tag byte when several groups share the pool.
    """
    keys = [k for k, w in zip(layout.keys, layout.windows, strict=True) if w is None]
    if not keys:
        return 0
    n = limit // layout.block_size
    for key in keys:
        pool = state.pools[state.group(key).pool]
        tag = pool.tag_of(key)
        with pool.reading() as store:
            index = store.by_key
            for i, h in enumerate(digests[:n]):
                if index.get(h if tag is None else h + tag) is None:
                    n = i
                    break
    return n * layout.block_size
