"""Pull and push between a prompt cluster (a child process) and a decoder (this process)."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator

import pytest
import torch
from peer import pattern
from peering import PeerProcess, options
from torch_threads import one_torch_thread  # noqa: F401  (autouse)

import kvfunc.datadist as dd
from kvfunc.core import LLMError, LLMStatusCode

CODE = LLMStatusCode
BLOCKS = dd.CacheDesc(4, (16, 2, 8), dd.DataType.DT_FLOAT16)
BATCH = dd.CacheDesc(2, (3, 4, 8), dd.DataType.DT_FLOAT)


@pytest.fixture(scope="module")
def prompt() -> Iterator[PeerProcess]:
    """One prompt cluster (id 0) listening on loopback, shared by this module's tests."""
    peer = PeerProcess("PROMPT", 0, options(**{"llm.listenIpInfo": "127.0.0.1:0"}))
    try:
        yield peer
    finally:
        peer.close()


@pytest.fixture
def decoder(prompt: PeerProcess) -> Iterator[dd.LLMDataDist]:
    """A decoder cluster (id 1) in this process, linked to the prompt cluster."""
    d = dd.LLMDataDist(dd.LLMRole.DECODER, 1, options())
    try:
        assert (CODE.LLM_SUCCESS, [CODE.LLM_SUCCESS]) == d.link_clusters(
            [dd.ClusterInfo(0, *prompt.address)])
        yield d
    finally:
        d.finalize()


def zeros(cm: dd.CacheManager, desc: dd.CacheDesc, blocks: bool = True) -> dd.Cache:
    """A zero-filled cache of this cluster."""
    cache = cm.allocate_blocks_cache(desc) if blocks else cm.allocate_cache(desc)
    for t in cache.tensors:
        t.zero_()
    return cache


def test_pull_cache_moves_one_entry_and_releases_only_its_key(
        prompt: PeerProcess, decoder: dd.LLMDataDist) -> None:
    """Entry of key 11 lands in batch 2; a second pull is NOT_EXIST and changes nothing."""
    cm = decoder.cache_manager
    prompt.ok("alloc", desc=BATCH.to_json(), keys=[10, 11], fill=1)
    before = prompt.ok("state")
    dst = zeros(cm, BATCH, blocks=False)
    cm.pull_cache(dd.CacheKey(0, 11), dst, batch_index=2)
    want = pattern(BATCH, 1)
    assert all(torch.equal(w[1], t[2]) for w, t in zip(want, dst.tensors, strict=True))
    assert before["bindings"] - 1 == prompt.ok("state")["bindings"]
    snapshot = [t.clone() for t in dst.tensors]
    after = prompt.ok("state")
    with pytest.raises(dd.CacheNotExistError) as info:
        cm.pull_cache(dd.CacheKey(0, 11), dst, batch_index=0)
    assert CODE.LLM_KV_CACHE_NOT_EXIST == info.value.status_code
    assert all(torch.equal(a, b) for a, b in zip(snapshot, dst.tensors, strict=True))
    assert after == prompt.ok("state")
    cm.pull_cache(dd.CacheKey(0, 10), dst, batch_index=0)  # other requests are unaffected
    assert torch.equal(want[0][0], dst.tensors[0][0])
    assert (0, 0) == (cm.state.caches[dst.cache_id].pins, prompt.ok("state")["pins"])


def test_removed_key_cannot_be_pulled(prompt: PeerProcess, decoder: dd.LLMDataDist) -> None:
    """After remove_cache_key on the prompt side, a pull is LLM_KV_CACHE_NOT_EXIST."""
    prompt.ok("alloc", desc=BATCH.to_json(), keys=[20], fill=2)
    prompt.ok("remove_key", req_id=20)
    with pytest.raises(dd.CacheNotExistError):
        decoder.cache_manager.pull_cache(dd.CacheKey(0, 20),
                                         zeros(decoder.cache_manager, BATCH, False))


def test_pull_blocks_pairs_blocks_by_position(prompt: PeerProcess,
                                              decoder: dd.LLMDataDist) -> None:
    """Prompt blocks [3, 9, 4] land in decoder blocks [0, 5, 6]; the rest stay zero.

    The prompt side asks no ack for a blocks pull: it unpins its cache before
    its last message leaves, so nothing is pinned once ``pull_blocks`` returns.
    """
    prompt.ok("alloc", desc=BLOCKS.to_json(), blocks=True, model_id=1, fill=3)
    dst = zeros(decoder.cache_manager, BLOCKS)
    for _ in range(2):  # the second pull shows the link is clean after an ack-less one
        decoder.cache_manager.pull_blocks(dd.BlocksCacheKey(0, 1), dst, [3, 9, 4], [0, 5, 6])
        assert 0 == prompt.ok("state")["pins"]
    want = pattern(BLOCKS, 3)
    for w, t in zip(want, dst.tensors, strict=True):
        assert torch.equal(w[[3, 9, 4]], t[[0, 5, 6]])
        assert 0 == int(t[[1, 2, 3, 4, 7]].count_nonzero())


def test_bad_pulls_are_rejected_before_any_write(prompt: PeerProcess,
                                                 decoder: dd.LLMDataDist) -> None:
    """Out-of-range source blocks, a mismatched desc, an unknown cluster: typed, no write."""
    prompt.ok("alloc", desc=BLOCKS.to_json(), blocks=True, model_id=2, fill=4)
    cm = decoder.cache_manager
    dst = zeros(cm, BLOCKS)
    other = zeros(cm, dd.CacheDesc(4, (16, 2, 4), dd.DataType.DT_FLOAT16))
    calls = [(CODE.LLM_PARAM_INVALID, lambda: cm.pull_blocks(dd.BlocksCacheKey(0, 2), dst,
                                                             [1, 16], [0, 1])),
             (CODE.LLM_PARAM_INVALID, lambda: cm.pull_blocks(dd.BlocksCacheKey(0, 2), other,
                                                             [1], [0])),
             (CODE.LLM_KV_CACHE_NOT_EXIST, lambda: cm.pull_blocks(dd.BlocksCacheKey(0, 77), dst,
                                                                  [1], [0])),
             (CODE.LLM_NOT_YET_LINK, lambda: cm.pull_blocks(dd.BlocksCacheKey(9, 2), dst,
                                                            [1], [0])),
             (CODE.LLM_PARAM_INVALID, lambda: cm.pull_blocks(dd.BlocksCacheKey(0, 2), dst,
                                                             [1, 2], [0]))]
    for code, call in calls:
        with pytest.raises(LLMError) as info:
            call()
        assert code == info.value.status_code, info.value
    assert 0 == sum(int(t.count_nonzero()) for t in dst.tensors + other.tensors)
    cm.pull_blocks(dd.BlocksCacheKey(0, 2), dst, [5], [5])  # the link is still good
    assert torch.equal(pattern(BLOCKS, 4)[3][5], dst.tensors[3][5])


def test_refused_pulls_take_their_early_receives_back(prompt: PeerProcess,
                                                      decoder: dd.LLMDataDist) -> None:
    """Receives are posted before the pull asks; a refusal unposts them.

    Each refused pull (no such key, a desc that does not match) leaves
    nothing posted on the link and writes nothing; the link stays usable.
    """
    prompt.ok("alloc", desc=BLOCKS.to_json(), blocks=True, model_id=5, fill=6)
    cm = decoder.cache_manager
    link = decoder._links[0]
    assert link.transport.posts_early
    dst = zeros(cm, BLOCKS)
    other = zeros(cm, dd.CacheDesc(4, (16, 2, 4), dd.DataType.DT_FLOAT16))
    for _ in range(3):
        with pytest.raises(dd.CacheNotExistError):
            cm.pull_blocks(dd.BlocksCacheKey(0, 78), dst, [1, 2], [0, 1])
        with pytest.raises(LLMError) as info:
            cm.pull_blocks(dd.BlocksCacheKey(0, 5), other, [1], [0])
        assert CODE.LLM_PARAM_INVALID == info.value.status_code
    assert {} == link.channel._posted
    assert 0 == sum(int(t.count_nonzero()) for t in dst.tensors + other.tensors)
    assert 0 == cm.state.caches[dst.cache_id].pins
    cm.pull_blocks(dd.BlocksCacheKey(0, 5), dst, [1, 2], [0, 1])
    assert all(torch.equal(w[[1, 2]], t[[0, 1]])
               for w, t in zip(pattern(BLOCKS, 6), dst.tensors, strict=True))
    assert link.broken is None


def test_push_blocks_and_push_cache_write_the_decoder(prompt: PeerProcess,
                                                      decoder: dd.LLMDataDist) -> None:
    """The prompt side pushes blocks and a batch entry; out-of-range targets are refused."""
    cm = decoder.cache_manager
    blocks, batch = zeros(cm, BLOCKS), zeros(cm, BATCH, blocks=False)
    src = prompt.ok("alloc", desc=BLOCKS.to_json(), blocks=True, fill=5)["cache_id"]
    prompt.ok("push_blocks", cluster=1, dst_cache_id=blocks.cache_id, src_cache_id=src,
              src_blocks=[0, 1, 2], dst_blocks=[7, 8, 9])
    assert all(torch.equal(w[:3], t[7:10]) for w, t in
               zip(pattern(BLOCKS, 5), blocks.tensors, strict=True))
    bad = prompt.call("push_blocks", cluster=1, dst_cache_id=blocks.cache_id, src_cache_id=src,
                      src_blocks=[0, 1], dst_blocks=[3, 16])
    assert ("LLM_PARAM_INVALID", 0) == (bad["code"], int(blocks.tensors[0][3].count_nonzero()))
    bad = prompt.call("push_blocks", cluster=1, dst_cache_id=batch.cache_id, src_cache_id=src,
                      src_blocks=[0], dst_blocks=[0])
    assert "LLM_PARAM_INVALID" == bad["code"]
    src = prompt.ok("alloc", desc=BATCH.to_json(), fill=6)["cache_id"]
    prompt.ok("push_cache", cluster=1, dst_cache_id=batch.cache_id, batch_index=1,
              src_cache_id=src, src_batch_index=2)
    assert torch.equal(pattern(BATCH, 6)[1][2], batch.tensors[1][1])
    assert 0 == cm.state.caches[batch.cache_id].pins


def wait_until(condition: object, timeout: float = 10) -> bool:
    """Poll a real condition until it holds or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return True
        time.sleep(0.01)
    return False


def test_transfer_cache_async_sends_each_layer_when_it_is_computed(
        prompt: PeerProcess, decoder: dd.LLMDataDist) -> None:
    """Layer 0 arrives while layer 1 is still being computed; both after the second signal."""
    dst = zeros(decoder.cache_manager, BLOCKS)
    src = prompt.ok("alloc", desc=BLOCKS.to_json(), blocks=True, fill=8)["cache_id"]
    want = pattern(BLOCKS, 8)
    prompt.ok("transfer", cluster=1, dst_cache_id=dst.cache_id, src_cache_id=src,
              src_blocks=[2, 3], dst_blocks=[4, 5], tpl=2)
    prompt.ok("layer", index=0)
    assert wait_until(lambda: torch.equal(want[1][2:4], dst.tensors[1][4:6]))
    assert 0 == int(dst.tensors[2].count_nonzero())  # layer 1 not computed yet: not sent
    prompt.ok("layer", index=1)
    prompt.ok("sync", src_cache_id=src)
    assert all(torch.equal(w[2:4], t[4:6]) for w, t in zip(want, dst.tensors, strict=True))


def start_pull(cm: dd.CacheManager, key: dd.BlocksCacheKey, dst: dd.Cache
               ) -> tuple[threading.Thread, list[BaseException | float]]:
    """Run a pull in a thread; the list gets its error (or None) and its duration."""
    result: list[BaseException | float] = []

    def run() -> None:
        start = time.monotonic()
        try:
            cm.pull_blocks(key, dst, [1, 2, 3, 4], [4, 3, 2, 1])
        except LLMError as exc:
            result.append(exc)
        result.append(time.monotonic() - start)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def relink_and_retry(d: dd.LLMDataDist, peer: PeerProcess, dst: dd.Cache, seed: int) -> None:
    """Unlink, link again, pull again: the retry brings the right blocks."""
    d.unlink_clusters([dd.ClusterInfo(0, "127.0.0.1", 1)])
    assert [CODE.LLM_SUCCESS] == d.link_clusters([dd.ClusterInfo(0, *peer.address)])[1]
    d.cache_manager.pull_blocks(dd.BlocksCacheKey(0, 0), dst, [1, 2, 3, 4], [4, 3, 2, 1])
    want = pattern(BLOCKS, seed)
    assert all(torch.equal(w[[1, 2, 3, 4]], t[[4, 3, 2, 1]])
               for w, t in zip(want, dst.tensors, strict=True))


@pytest.mark.parametrize("fault", ["killed", "too_slow"])
def test_stalled_or_killed_peer_times_out_without_leaking_and_relink_retry_works(
        fault: str) -> None:
    """A peer that stops mid-transfer (killed or just slow) gives LLM_WAIT_PROCESS_TIMEOUT
    within the timeout; nothing stays pinned or allocated; unlink + link + retry succeeds."""
    opts = options(**{"llm.listenIpInfo": "127.0.0.1:0", "llm.SyncKvCacheWaitTime": 1500})
    peer = PeerProcess("PROMPT", 0, opts)
    d = dd.LLMDataDist(dd.LLMRole.DECODER, 1, opts | {"llm.listenIpInfo": None})
    replacement = None
    try:
        d.link_clusters([dd.ClusterInfo(0, *peer.address)])
        peer.ok("alloc", desc=BLOCKS.to_json(), blocks=True, model_id=0, fill=9)
        cm = d.cache_manager
        dst = zeros(cm, BLOCKS)
        used = cm.state.used_bytes()
        peer.ok("stall")
        thread, result = start_pull(cm, dd.BlocksCacheKey(0, 0), dst)
        assert "stalled" == peer.event()["event"]  # one tensor sent, the rest held back
        if fault == "killed":
            peer.kill()
        thread.join(timeout=30)
        error, seconds = result
        assert CODE.LLM_WAIT_PROCESS_TIMEOUT == error.status_code  # type: ignore[union-attr]
        assert seconds < 1.5 + 0.5, seconds
        assert (0, used) == (cm.state.caches[dst.cache_id].pins, cm.state.used_bytes())
        with pytest.raises(dd.LinkFailedError):  # broken until relinked
            cm.pull_blocks(dd.BlocksCacheKey(0, 0), dst, [1], [1])
        if fault == "killed":
            replacement = PeerProcess("PROMPT", 0, opts)
            replacement.ok("alloc", desc=BLOCKS.to_json(), blocks=True, model_id=0, fill=9)
            relink_and_retry(d, replacement, dst, 9)
        else:
            peer.ok("unstall")
            relink_and_retry(d, peer, dst, 9)
            assert wait_until(lambda: peer.ok("state")["pins"] == 0)
    finally:
        d.finalize()
        peer.close()
        if replacement is not None:
            replacement.close()


def test_a_frozen_prompt_cluster_bounds_every_wait_and_relink_retry_works() -> None:
    """A stopped prompt process (SIGSTOP; a partition looks the same): a pull ends with
    LLM_WAIT_PROCESS_TIMEOUT and a new link with LLM_LINK_FAILED, each within the
    timeout, with nothing pinned or leaked; once the peer resumes, unlink + link + retry
    brings the right blocks and the peer holds no pin."""
    opts = options(**{"llm.listenIpInfo": "127.0.0.1:0", "llm.SyncKvCacheWaitTime": 1500})
    peer = PeerProcess("PROMPT", 0, opts)
    d = dd.LLMDataDist(dd.LLMRole.DECODER, 1, opts | {"llm.listenIpInfo": None})
    other = dd.LLMDataDist(dd.LLMRole.DECODER, 2, opts | {"llm.listenIpInfo": None})
    try:
        assert [CODE.LLM_SUCCESS] == d.link_clusters([dd.ClusterInfo(0, *peer.address)])[1]
        peer.ok("alloc", desc=BLOCKS.to_json(), blocks=True, model_id=0, fill=9)
        cm = d.cache_manager
        dst = zeros(cm, BLOCKS)
        used = cm.state.used_bytes()
        peer.signal(signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(dd.TransferTimeoutError) as info:
            cm.pull_blocks(dd.BlocksCacheKey(0, 0), dst, [1, 2], [3, 4])
        assert CODE.LLM_WAIT_PROCESS_TIMEOUT == info.value.status_code
        assert time.monotonic() - start < 1.5 + 0.5
        assert (0, used) == (cm.state.caches[dst.cache_id].pins, cm.state.used_bytes())
        assert 0 == sum(int(t.count_nonzero()) for t in dst.tensors)
        start = time.monotonic()
        assert [CODE.LLM_LINK_FAILED] == other.link_clusters(
            [dd.ClusterInfo(0, *peer.address)], timeout=1500)[1]
        assert time.monotonic() - start < 1.5 + 0.5
        peer.signal(signal.SIGCONT)
        relink_and_retry(d, peer, dst, 9)
        assert wait_until(lambda: peer.ok("state")["pins"] == 0)
    finally:
        peer.signal(signal.SIGCONT)
        other.finalize()
        d.finalize()
        peer.close()
