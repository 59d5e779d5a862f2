"""The Mooncake transport (the optional ``mooncake`` extra): pull, push and layer-wise push."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

pytest.importorskip("mooncake.engine", reason="needs the kvfunc[mooncake] extra and libibverbs1")

from peer import pattern
from peering import PeerProcess, options
from torch_threads import one_torch_thread  # noqa: F401  (autouse)

import kvfunc.datadist as dd
from kvfunc.core import LLMStatusCode

BLOCKS = dd.CacheDesc(4, (16, 2, 8), dd.DataType.DT_BF16)
MOONCAKE = {"llm.TransferBackend": "mooncake"}


@pytest.fixture(scope="module")
def prompt() -> Iterator[PeerProcess]:
    """A prompt cluster over Mooncake, listening on loopback."""
    peer = PeerProcess("PROMPT", 0, options(**MOONCAKE, **{"llm.listenIpInfo": "127.0.0.1:0"}))
    try:
        yield peer
    finally:
        peer.close()


@pytest.fixture
def decoder(prompt: PeerProcess) -> Iterator[dd.LLMDataDist]:
    """A decoder over Mooncake in this process, linked to the prompt cluster."""
    d = dd.LLMDataDist(dd.LLMRole.DECODER, 1, options(**MOONCAKE))
    try:
        assert [LLMStatusCode.LLM_SUCCESS] == d.link_clusters(
            [dd.ClusterInfo(0, *prompt.address)])[1]
        yield d
    finally:
        d.finalize()


def zeros(cm: dd.CacheManager) -> dd.Cache:
    """A zero-filled blocks cache of this cluster."""
    cache = cm.allocate_blocks_cache(BLOCKS)
    for t in cache.tensors:
        t.zero_()
    return cache


def test_pull_blocks_reads_the_prompt_blocks(prompt: PeerProcess,
                                             decoder: dd.LLMDataDist) -> None:
    """Blocks [2, 3, 9] (two runs) land in [5, 6, 0]; out-of-range sources are refused."""
    prompt.ok("alloc", desc=BLOCKS.to_json(), blocks=True, model_id=0, fill=11)
    dst = zeros(decoder.cache_manager)
    decoder.cache_manager.pull_blocks(dd.BlocksCacheKey(0, 0), dst, [2, 3, 9], [5, 6, 0])
    assert all(torch.equal(w[[2, 3, 9]], t[[5, 6, 0]])
               for w, t in zip(pattern(BLOCKS, 11), dst.tensors, strict=True))
    with pytest.raises(dd.InvalidParamError):
        decoder.cache_manager.pull_blocks(dd.BlocksCacheKey(0, 0), dst, [16], [1])
    assert 0 == int(dst.tensors[0][1].count_nonzero())


def test_push_and_layerwise_push_land_in_the_decoder(prompt: PeerProcess,
                                                     decoder: dd.LLMDataDist) -> None:
    """push_blocks and transfer_cache_async (two layers) write the decoder's blocks."""
    dst = zeros(decoder.cache_manager)
    src = prompt.ok("alloc", desc=BLOCKS.to_json(), blocks=True, fill=12)["cache_id"]
    prompt.ok("push_blocks", cluster=1, dst_cache_id=dst.cache_id, src_cache_id=src,
              src_blocks=[0, 1], dst_blocks=[8, 9])
    prompt.ok("transfer", cluster=1, dst_cache_id=dst.cache_id, src_cache_id=src,
              src_blocks=[4, 5, 6], dst_blocks=[1, 2, 3], tpl=2)
    prompt.ok("layer", index=0)
    prompt.ok("layer", index=1)
    prompt.ok("sync", src_cache_id=src)
    want = pattern(BLOCKS, 12)
    assert all(torch.equal(w[[0, 1, 4, 5, 6]], t[[8, 9, 1, 2, 3]])
               for w, t in zip(want, dst.tensors, strict=True))
    assert 0 == sum(r.pins for r in decoder.cache_manager.state.caches.values())
