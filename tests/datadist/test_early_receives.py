"""Gloo pulls post their receives before they ask; refusals drain them; sends have a thread.

Both clusters live in this process, so the test can look at each side's
transport: after any number of refused pulls nothing is left pending on
either side (no abandoned receive or send, the staging buffer back in its
pool) and the link still works.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from peering import options
from torch_threads import one_torch_thread  # noqa: F401  (autouse)

import kvfunc.datadist as dd
from kvfunc.core import LLMError, LLMStatusCode

CODE = LLMStatusCode
# 16 KiB rows: a pull of 200 rows is 3.2 MiB per tensor, so two tensors per 8 MiB message
BIG = dd.CacheDesc(4, (256, 64, 128), dd.DataType.DT_FLOAT16)
ROWS = list(range(200))


@pytest.fixture
def pair() -> Iterator[tuple[dd.LLMDataDist, dd.LLMDataDist]]:
    """A prompt cluster (0) and a decoder (1) in this process, linked over gloo."""
    opts = options(**{"llm.MemPoolConfig": '{"memory_size": 33554432, "page_shift": 16}',
                      "llm.TransferBackend": "gloo"})
    prompt = dd.LLMDataDist(dd.LLMRole.PROMPT, 0, opts | {"llm.listenIpInfo": "127.0.0.1:0"})
    decoder = dd.LLMDataDist(dd.LLMRole.DECODER, 1, opts)
    try:
        assert (CODE.LLM_SUCCESS, [CODE.LLM_SUCCESS]) == decoder.link_clusters(
            [dd.ClusterInfo(0, *prompt.listen_address)])
        yield prompt, decoder
    finally:
        decoder.finalize()
        prompt.finalize()


def links(prompt: dd.LLMDataDist, decoder: dd.LLMDataDist) -> tuple[Any, Any]:
    """Each side's link (the prompt side's appears once its handshake registered it)."""
    for _ in range(200):
        if 1 in prompt._links:
            break
        threading.Event().wait(0.01)
    return prompt._links[1], decoder._links[0]


def test_refused_multi_message_pulls_leave_nothing_pending(
        pair: tuple[dd.LLMDataDist, dd.LLMDataDist]) -> None:
    """A pull of a missing key and a pull whose posted messages differ from the sender's
    plan are refused; each side's transport then holds nothing for them."""
    prompt, decoder = pair
    src = prompt.cache_manager.allocate_blocks_cache(BIG, dd.BlocksCacheKey(0, 1))
    for i, t in enumerate(src.tensors):
        t.fill_(i + 1)
    cm = decoder.cache_manager
    dst = cm.allocate_blocks_cache(BIG)
    for t in dst.tensors:
        t.zero_()
    p_link, d_link = links(prompt, decoder)
    endpoint = d_link.transport
    own_incoming = endpoint.incoming
    for _ in range(3):
        with pytest.raises(dd.CacheNotExistError):
            cm.pull_blocks(dd.BlocksCacheKey(0, 9), dst, ROWS, ROWS)
        # a decoder that posts one message per tensor; the sender sends two per message
        endpoint.incoming = lambda tensors, rows, tag, layers, descriptor: own_incoming(
            tensors, rows, tag, [[i] for layer in layers for i in layer], descriptor)
        try:
            with pytest.raises(LLMError) as info:
                cm.pull_blocks(dd.BlocksCacheKey(0, 1), dst, ROWS, ROWS)
        finally:
            del endpoint.incoming
        assert CODE.LLM_PARAM_INVALID == info.value.status_code
        assert "messages [0, 1, 2, 3], this side sends [0, 2]" in str(info.value)
    assert ([], [], None, None) == (endpoint.abandoned, p_link.transport.abandoned,
                                    d_link.broken, p_link.broken)
    idle = {key: len(bufs) for key, bufs in endpoint.buffers.idle.items()}
    assert 1 == idle[((4, 200, 64, 128), torch.float16, torch.device("cpu"))]  # reused
    assert 0 == sum(int(t.count_nonzero()) for t in dst.tensors)
    cm.pull_blocks(dd.BlocksCacheKey(0, 1), dst, ROWS, ROWS[::-1])
    assert all(bool((t[ROWS] == i + 1).all()) for i, t in enumerate(dst.tensors))


def test_a_push_whose_link_closes_raises_a_link_error(
        pair: tuple[dd.LLMDataDist, dd.LLMDataDist]) -> None:
    """The decoder unlinks between two layers of a push: the prompt side's task raises
    LLM_LINK_FAILED (an LLMError), not the send thread's shutdown error."""
    prompt, decoder = pair
    desc = dd.CacheDesc(4, (16, 2, 8), dd.DataType.DT_FLOAT16)
    src = prompt.cache_manager.allocate_blocks_cache(desc)
    dst = decoder.cache_manager.allocate_blocks_cache(desc)
    links(prompt, decoder)
    computed = [threading.Event(), threading.Event()]

    class Layers:
        def synchronize_layer(self, i: int, timeout_in_millis: int | None) -> bool:
            return computed[i].wait(None if timeout_in_millis is None
                                    else timeout_in_millis / 1000)

    task = prompt.cache_manager.transfer_cache_async(
        src, Layers(), [dd.TransferConfig(1, dst.cache_id)], [0, 1], [2, 3],
        tensor_num_per_layer=2)
    computed[0].set()
    for _ in range(500):  # the decoder took the push (it pins its cache while it receives)
        if decoder.cache_manager.state.caches[dst.cache_id].pins:
            break
        threading.Event().wait(0.01)
    assert 1 == decoder.cache_manager.state.caches[dst.cache_id].pins
    assert (CODE.LLM_SUCCESS, [CODE.LLM_SUCCESS]) == decoder.unlink_clusters(
        [dd.ClusterInfo(0, *prompt.listen_address)])
    for _ in range(500):  # the prompt side learns of the unlink through its inbox
        if 1 not in prompt._links:  # closed (its send thread shut down), then forgotten
            break
        threading.Event().wait(0.01)
    assert 1 not in prompt._links
    computed[1].set()
    with pytest.raises(LLMError) as info:
        task.synchronize(10_000)
    assert CODE.LLM_LINK_FAILED == info.value.status_code, info.value
