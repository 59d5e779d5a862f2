"""Prefill in one process, decode in another: the decoder continues exactly as one process would.

The prefill process runs the tiny decoder (full, sliding-window and latent
layers) over the prompts in kvfunc-managed paged caches carved from its
DataDist pool.  This process, the decoder, admits each request the way an
online P/D decoder does (``allocate_slots`` with the prompt as computed,
``1 + next_n`` new tokens, lookahead and reserved tokens), pairs the two
sides' ``get_contiguous_buf_infos()`` entries by position and receives the
KV: pulled, or pushed layer by layer while the prefill computes.  Then it
decodes greedily, and every token and logit must match a dense single
process run of the same model.  The decoder's caches start as NaN, so a
block that was not transferred, or a misplaced one, shows up.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from pd_common import CONFIG, Side, jsonable
from peering import PeerProcess, options
from torch_threads import one_torch_thread  # noqa: F401  (autouse)

import kvfunc.datadist as dd
from kvfunc.core import NULL_BLOCK, LLMStatusCode
from kvfunc.shell import TinyDecoder

PREFILL = Path(__file__).with_name("pd_prefill.py")
_rng = random.Random(4)
PROMPTS = {rid: [_rng.randrange(CONFIG.vocab_size) for _ in range(n)]
           for rid, n in {"a": 5, "b": 16, "c": 31, "d": 13}.items()}
# The decoder admits with the prompt computed, 1 + NEXT_N new tokens and LOOKAHEAD more.
# (A larger NEXT_N + LOOKAHEAD would make the first allocation's sliding-window head,
# computed from the allocation's end, drop a block the first decode query still reads.)
NEXT_N, LOOKAHEAD, RESERVED, DECODE_STEPS = 0, 1, 8, 10


def dense_run() -> dict[str, list[tuple[int, torch.Tensor]]]:
    """Greedy tokens and their logits, per request, from one process with dense attention."""
    model = TinyDecoder(CONFIG)
    out: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for rid, prompt in PROMPTS.items():
        tokens = list(prompt)
        out[rid] = []
        for _ in range(1 + DECODE_STEPS):
            logits = model.forward_dense(tokens)[-1]
            out[rid].append((int(logits.argmax()), logits))
            tokens.append(out[rid][-1][0])
    return out


@pytest.mark.parametrize("mode", ["pull", "push_layerwise"])
def test_decoder_continues_exactly_like_a_single_process(mode: str) -> None:
    """Pulled or pushed KV: every decoded token equals the dense run, logits to 1e-5."""
    reference = dense_run()
    # The decoder serves one push at a time while both processes compute the model:
    # on a loaded two-core machine the fault tests' 3 s transfer timeout is too tight.
    wait = {"llm.SyncKvCacheWaitTime": 30_000}
    prefill = PeerProcess("PROMPT", 0, options(**{"llm.listenIpInfo": "127.0.0.1:0"}, **wait),
                          script=PREFILL)
    cluster = dd.LLMDataDist(dd.LLMRole.DECODER, 1, options(**wait))
    try:
        assert [LLMStatusCode.LLM_SUCCESS] == cluster.link_clusters(
            [dd.ClusterInfo(0, *prefill.address)])[1]
        side = Side(cluster.cache_manager)
        for cache in side.paged.caches:
            for t in cache.tensors:
                t.fill_(float("nan"))
        idle = side.mgr.format_usage()
        for rid, prompt in PROMPTS.items():
            assert side.mgr.allocate_slots(rid, len(prompt), 1 + NEXT_N, LOOKAHEAD,
                                           reserved_tokens=RESERVED)
        mine = {rid: jsonable(side.mgr.get_block_ids(rid)) for rid in PROMPTS}
        if mode == "pull":
            reply = prefill.ok("prefill", prompts=PROMPTS)
            for rid in PROMPTS:
                dd.pull_request_blocks(cluster.cache_manager, side.paged, side.layout,
                                       prefill.hello["layout"], 0, reply["block_ids"][rid],
                                       mine[rid])
        else:
            reply = prefill.ok("push", prompts=PROMPTS, layout=side.layout,
                               cache_ids=side.paged.cache_ids, block_ids=mine)
        heads = {rid: (reply["block_ids"][rid]["SlidingWindow"].count(NULL_BLOCK),
                       mine[rid]["SlidingWindow"].count(NULL_BLOCK)) for rid in PROMPTS}
        assert any(p != d for p, d in heads.values()), heads  # different null heads
        generated = {rid: [reply["first"][rid]] for rid in PROMPTS}
        for step in range(DECODE_STEPS):
            rows = []
            for rid, prompt in PROMPTS.items():
                cached = len(prompt) + step
                if step:
                    assert side.mgr.allocate_slots(rid, cached, 1)
                rows.append((rid, cached, [generated[rid][-1]]))
            for (rid, _, _), logits in zip(rows, side.step(rows), strict=True):
                torch.testing.assert_close(logits[0], reference[rid][step + 1][1],
                                           rtol=0, atol=1e-5)
                generated[rid].append(int(logits[0].argmax()))
        assert {rid: [t for t, _ in ref] for rid, ref in reference.items()} == generated
        for rid in PROMPTS:
            side.mgr.free(rid)
        assert idle == side.mgr.format_usage()
        assert 0 == sum(r.pins for r in cluster.cache_manager.state.caches.values())
    finally:
        cluster.finalize()
        prefill.close()
