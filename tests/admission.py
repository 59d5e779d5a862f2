"""How the core tests admit a request as an engine does: its prefix hit, then its slots."""

from __future__ import annotations

import kvfunc as kf


def admitted(state: kf.KVState, request_id: int, tokens: list[int],
             block_size: int) -> kf.AllocationResult:
    """``allocate_slots`` of a new request's ``tokens`` with the hit ``lookup_prefix`` finds
    for all but the last one (vLLM recomputes at least one token), and their hashes."""
    h = kf.BlockHashes.of(tokens, block_size)
    hit = kf.lookup_prefix(state, h, max_tokens=len(tokens) - 1)
    return kf.allocate_slots(state, request_id, hit.num_tokens, len(tokens) - hit.num_tokens,
                             block_hashes=h, prefix_hit=hit)
