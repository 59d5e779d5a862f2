"""A greedy decoder cannot starve the other decoders of a prompt cluster.

The attack (see ``hostile.Flood``): a decoder posts its whole per-link limit
of ``CacheKey`` pulls and acknowledges each as late as it legally can.  The
prompt cluster serves it at most its share (its own slot and ``LINK_SHARE``
shared ones) while the other decoders' pulls run in their own slots: they
complete while the flooder still holds its whole share, so none of them
waited for any of its transfers, and no link is marked broken but by its own
slowness.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch
from hostile import Flood, Hostile, wait_for
from peering import options
from torch_threads import one_torch_thread  # noqa: F401  (autouse)

import kvfunc.datadist as dd
from kvfunc.datadist._link import MAX_REQUESTS
from kvfunc.datadist._serving import LINK_SHARE

BLOCKS = dd.CacheDesc(4, (16, 2, 8), dd.DataType.DT_FLOAT16)
ENTRY = dd.CacheDesc(4, (1, 64), dd.DataType.DT_FLOAT16)  # what the flooder pulls
KEY = dd.CacheKey(0, 1)
SMALL = '{"memory_size": 1048576, "page_shift": 12}'


def opts(timeout_s: float) -> dict[str, object]:
    """A 1 MiB pool and the given transfer timeout."""
    return options(**{"llm.MemPoolConfig": SMALL, "llm.SyncKvCacheWaitTime":
                      int(timeout_s * 1000)})


class Prompt:
    """A listening PROMPT holding a blocks cache (for honest pulls) and a keyed entry (for
    the flooder), with a flooding DECODER (1) linked to it."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.dd = dd.LLMDataDist(dd.LLMRole.PROMPT, 0,
                                 opts(timeout_s) | {"llm.listenIpInfo": "127.0.0.1:0"})
        cm = self.dd.cache_manager
        self.src = cm.allocate_blocks_cache(BLOCKS, dd.BlocksCacheKey(0, 0))
        for i, t in enumerate(self.src.tensors):
            t.copy_(torch.arange(t.numel()).view(t.shape) + 100 * i)
        self.entry = cm.allocate_cache(ENTRY, [KEY])
        self.flooder = Hostile(self.dd, dd.LLMRole.DECODER, 1, opts(timeout_s))
        self.decoders: list[dd.LLMDataDist] = []

    def link_decoders(self, n: int) -> list[dd.LLMDataDist]:
        """``n`` honest DECODER clusters (ids 2, 3, ...) linked to this one."""
        assert self.dd.listen_address is not None
        for i in range(n):
            d = dd.LLMDataDist(dd.LLMRole.DECODER, 2 + i, opts(self.timeout_s))
            self.decoders.append(d)
            status, _ = d.link_clusters([dd.ClusterInfo(0, *self.dd.listen_address)])
            assert dd.LLMStatusCode.LLM_SUCCESS == status
        assert wait_for(lambda: len(self.dd.linked_clusters()) == n + 1)
        return self.decoders

    def flood(self, hold_s: float) -> Flood:
        """Start the flood; returns once the prompt serves the flooder's whole share."""
        cm = self.flooder.dd.cache_manager
        flood = Flood(self.flooder, KEY, cm.allocate_cache(ENTRY), MAX_REQUESTS, hold_s)
        link = self.dd._links[1]
        assert wait_for(lambda: 1 + LINK_SHARE == self.dd._server.running(link))
        return flood

    def close(self) -> None:
        for d in self.decoders:
            d.finalize()
        self.flooder.close()
        self.dd.finalize()


@pytest.fixture
def prompt(request: pytest.FixtureRequest) -> Iterator[Prompt]:
    """A :class:`Prompt` with the timeout a test names (indirect parameter; 5 s else)."""
    p = Prompt(getattr(request, "param", 5.0))
    try:
        yield p
    finally:
        p.close()


def honest_pulls(prompt: Prompt, decoders: list[dd.LLMDataDist]) -> list[BaseException]:
    """Every decoder pulls blocks [5, 6, 2] into [9, 10, 11] at once and checks them;
    the errors raised."""
    errors: list[BaseException] = []

    def pull(d: dd.LLMDataDist) -> None:
        try:
            dst = d.cache_manager.allocate_blocks_cache(BLOCKS)
            d.cache_manager.pull_blocks(dd.BlocksCacheKey(0, 0), dst, [5, 6, 2], [9, 10, 11])
            assert all(torch.equal(s[[5, 6, 2]], t[[9, 10, 11]])
                       for s, t in zip(prompt.src.tensors, dst.tensors, strict=True))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=pull, args=(d,)) for d in decoders]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return errors


def unbroken(prompt: Prompt) -> list[str | None]:
    """Why each link on either side is broken (None where it is not)."""
    links = list(prompt.dd._links.values()) + [prompt.flooder.link]
    links += [link for d in prompt.decoders for link in d._links.values()]
    return [link.broken for link in links]


@pytest.mark.parametrize("honest", [1, 4, 16])
def test_honest_pulls_complete_while_a_flooder_holds_its_whole_share(prompt: Prompt,
                                                                     honest: int) -> None:
    """A decoder posts 64 CacheKey pulls and holds each accepted one: the prompt serves
    it 1 + LINK_SHARE at a time; 1, 4 or 16 honest decoders pull meanwhile and all
    complete while the flooder still holds that share (none waited for its transfers);
    then the flood is answered, the rest of it served, and no link anywhere is broken."""
    decoders = prompt.link_decoders(honest)
    flood = prompt.flood(hold_s=prompt.timeout_s - 1.0)
    flooder_link = prompt.dd._links[1]
    assert [] == honest_pulls(prompt, decoders)
    assert (1 + LINK_SHARE, 0) == (prompt.dd._server.running(flooder_link), flood.answered)
    flood.stop()
    assert ([], MAX_REQUESTS) == (flood.errors, flood.answered)
    assert [None] * (2 * honest + 2) == unbroken(prompt)
    cm = prompt.dd.cache_manager
    assert wait_for(lambda: 0 == sum(r.pins for r in cm.state.caches.values()))
    dd.find_key(cm.state, KEY)  # never acknowledged: still held


@pytest.mark.parametrize("prompt", [1.5], indirect=True)
def test_a_frozen_flooder_breaks_its_own_link_only(prompt: Prompt) -> None:
    """A flooder that never answers: the honest decoders' pulls complete before and after
    its requests time out; the prompt then marks the flooder's link broken (its own
    timeout) and no other link."""
    decoders = prompt.link_decoders(4)
    flood = prompt.flood(hold_s=60.0)
    assert [] == honest_pulls(prompt, decoders)
    flooder_link = prompt.dd._links[1]
    assert wait_for(lambda: flooder_link.broken is not None, prompt.timeout_s + 5)
    assert "LLM_WAIT_PROCESS_TIMEOUT" in str(flooder_link.broken)
    assert [] == honest_pulls(prompt, decoders)
    flood.stop()
    assert all(link.broken is None for d in decoders for link in d._links.values())
    assert all(prompt.dd._links[d.cluster_id].broken is None for d in decoders)
    cm = prompt.dd.cache_manager
    assert wait_for(lambda: 0 == sum(r.pins for r in cm.state.caches.values()))
