"""The Mooncake transport (the optional ``mooncake`` extra): pull, push and layer-wise push,
in place or staged."""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

pytest.importorskip("mooncake.engine", reason="needs the kvfunc[mooncake] extra and libibverbs1")

from hostile import Hostile, wait_for
from peer import pattern
from peering import PeerProcess, options
from torch_threads import one_torch_thread  # noqa: F401  (autouse)

import kvfunc.datadist as dd
from kvfunc.core import LLMError, LLMStatusCode
from kvfunc.datadist._link import Link

BLOCKS = dd.CacheDesc(4, (16, 2, 8), dd.DataType.DT_BF16)
MOONCAKE = {"llm.TransferBackend": "mooncake"}


#: How long either side of these tests waits for the other (ms).  Destroying a Mooncake
#: engine that has talked to a peer holds Python's GIL for 0.5-1 s; finalize()
#: does it now, but other stalls of a few tenths of a second remain (imports, the first
#: handshake), so waits stay generous and bounded.
WAIT_MS = 10000


@pytest.fixture(scope="module")
def prompt() -> Iterator[PeerProcess]:
    """A prompt cluster over Mooncake, listening on loopback."""
    peer = PeerProcess("PROMPT", 0, options(**MOONCAKE, **{"llm.listenIpInfo": "127.0.0.1:0",
                                                          "llm.SyncKvCacheWaitTime": WAIT_MS}))
    try:
        yield peer
    finally:
        peer.close()


@pytest.fixture
def decoder(prompt: PeerProcess) -> Iterator[dd.LLMDataDist]:
    """A decoder over Mooncake in this process, linked to the prompt cluster (waits
    ``WAIT_MS``)."""
    d = dd.LLMDataDist(dd.LLMRole.DECODER, 1,
                       options(**MOONCAKE, **{"llm.SyncKvCacheWaitTime": WAIT_MS}))
    try:
        assert [LLMStatusCode.LLM_SUCCESS] == d.link_clusters(
            [dd.ClusterInfo(0, *prompt.address)], timeout=WAIT_MS)[1]
        yield d
    finally:
        d.finalize()


def zeros(cm: dd.CacheManager, desc: dd.CacheDesc = BLOCKS) -> dd.Cache:
    """A zero-filled blocks cache of this cluster."""
    cache = cm.allocate_blocks_cache(desc)
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


def test_finalize_destroys_the_engine_and_later_use_fails_typed(prompt: PeerProcess) -> None:
    """finalize() lets the engine go (Mooncake destroys it then, not during whatever the
    garbage collector interrupts later, which once stalled a timed pull for a second);
    the closed engine's staging and reads refuse with a typed error."""
    from kvfunc.datadist._mooncake_engine import Read

    d = dd.LLMDataDist(dd.LLMRole.DECODER, 1, options(**MOONCAKE))
    try:
        assert [LLMStatusCode.LLM_SUCCESS] == d.link_clusters(
            [dd.ClusterInfo(0, *prompt.address)], timeout=WAIT_MS)[1]
        engine = d._engine
        assert engine.staging.take(1 << 16) is not None
        alive = weakref.ref(engine.engine)
    finally:
        d.finalize()
    assert engine.engine is None and engine.staging.engine is None
    assert alive() is None  # destroyed in finalize: nothing else held it
    with pytest.raises(dd.LinkFailedError):
        engine.staging.take(1 << 16)
    with pytest.raises(dd.LinkFailedError):
        Read(engine.engine, "127.0.0.1:1", [(0, 0, 1)])
    engine.close()  # closing twice is harmless


class FakeEngine:
    """The engine calls a :class:`Read` makes: every read succeeds at once."""

    def batch_transfer_async_read(self, *args: Any) -> int:
        return 7  # a batch id

    def transfer_check_status(self, batch: int) -> int:
        return 1  # done

    def batch_transfer_sync_read(self, *args: Any) -> int:
        return 0  # done


@pytest.mark.parametrize("slices", [1, 3])
def test_a_read_lets_its_engine_go_once_it_settles(slices: int) -> None:
    """A settled read (polled, or read by its thread) holds no engine: a closed engine
    dies when its last read returns, not whenever the read object is collected."""
    from kvfunc.datadist._mooncake_engine import Read

    engine = FakeEngine()
    alive = weakref.ref(engine)
    read = Read(engine, "127.0.0.1:1", [(0, 0, 1)] * slices)
    del engine
    read.wait(time.monotonic() + 5, "a read")
    assert (0, None) == (read.status, alive())


MID = dd.CacheDesc(2, (16, 8, 1024), dd.DataType.DT_BF16)  # rows of 16 KiB


@pytest.fixture(scope="module")
def mid(prompt: PeerProcess) -> dd.BlocksCacheKey:
    """A blocks cache of 16 KiB rows on the prompt cluster (pattern 13), by its key."""
    prompt.ok("alloc", desc=MID.to_json(), blocks=True, model_id=1, fill=13)
    return dd.BlocksCacheKey(0, 1)


def staged(peer: PeerProcess | dd.LLMDataDist) -> tuple[int, bool]:
    """Bytes a cluster's engine has copied through its staging arena so far, and whether
    all of the arena is free now."""
    if isinstance(peer, PeerProcess):
        reply = peer.ok("staged")
        return reply["bytes"], reply["free"] == reply["size"]
    staging = peer._engine.staging
    return staging.staged_bytes, staging.ranges.free_bytes == staging.size


@pytest.mark.parametrize(("src", "dst", "stages"), [
    ([9, 2, 14, 5], [3, 11, 0, 7], (True, True)),  # runs of 16 KiB on both sides
    (list(range(8)), list(range(8, 16)), (False, False)),  # one run of 128 KiB each side
    (list(range(8)), [15, 3, 9, 1, 12, 6, 0, 10], (False, True)),
    ([15, 3, 9, 1, 12, 6, 0, 10], list(range(8)), (True, False)),
])
def test_each_side_stages_short_runs_and_reads_long_runs_in_place(
        prompt: PeerProcess, decoder: dd.LLMDataDist, mid: dd.BlocksCacheKey, src: list[int],
        dst: list[int], stages: tuple[bool, bool]) -> None:
    """A side whose runs average under STAGE_BELOW copies them through its staging
    arena (the sender gathers, the receiver scatters); long runs move with no copy; the
    blocks land exactly, and both arenas are free again afterwards."""
    dst_cache = zeros(decoder.cache_manager, MID)
    before = staged(prompt)[0], staged(decoder)[0]
    decoder.cache_manager.pull_blocks(mid, dst_cache, src, dst)
    assert all(torch.equal(w[src], t[dst])
               for w, t in zip(pattern(MID, 13), dst_cache.tensors, strict=True))
    region = MID.num_tensors * len(src) * MID.row_nbytes
    (sent, sent_free), (received, received_free) = staged(prompt), staged(decoder)
    assert (sent - before[0], received - before[1]) == tuple(region * s for s in stages)
    assert sent_free and received_free


def test_a_staged_push_and_layerwise_push_land_in_the_decoder(
        prompt: PeerProcess, decoder: dd.LLMDataDist) -> None:
    """Scattered blocks pushed (push_blocks, and transfer_cache_async layer by layer) are
    gathered, reported chunk by chunk, read and scattered: they land exactly."""
    dst = zeros(decoder.cache_manager, BLOCKS)
    src = prompt.ok("alloc", desc=BLOCKS.to_json(), blocks=True, fill=14)["cache_id"]
    before = staged(prompt)[0], staged(decoder)[0]
    prompt.ok("push_blocks", cluster=1, dst_cache_id=dst.cache_id, src_cache_id=src,
              src_blocks=[0, 5], dst_blocks=[9, 2])
    prompt.ok("transfer", cluster=1, dst_cache_id=dst.cache_id, src_cache_id=src,
              src_blocks=[4, 9, 6], dst_blocks=[1, 12, 3], tpl=2)
    prompt.ok("layer", index=0)
    prompt.ok("layer", index=1)
    prompt.ok("sync", src_cache_id=src)
    want = pattern(BLOCKS, 14)
    assert all(torch.equal(w[[0, 5, 4, 9, 6]], t[[9, 2, 1, 12, 3]])
               for w, t in zip(want, dst.tensors, strict=True))
    moved = BLOCKS.num_tensors * 5 * BLOCKS.row_nbytes
    assert (moved, moved) == (staged(prompt)[0] - before[0], staged(decoder)[0] - before[1])


def test_a_full_arena_reads_in_place(decoder: dd.LLMDataDist, mid: dd.BlocksCacheKey) -> None:
    """A decoder whose staging arena cannot hold the region reads the scattered blocks in
    place (one slice per block): they land exactly and nothing is staged there."""
    from kvfunc.datadist._mooncake_engine import Staging

    engine = decoder._engine
    engine.staging = Staging(engine.engine, size=1 << 16)  # smaller than the 128 KiB needed
    dst = zeros(decoder.cache_manager, MID)
    decoder.cache_manager.pull_blocks(mid, dst, [9, 2, 14, 5], [3, 11, 0, 7])
    assert all(torch.equal(w[[9, 2, 14, 5]], t[[3, 11, 0, 7]])
               for w, t in zip(pattern(MID, 13), dst.tensors, strict=True))
    assert (0, True) == staged(decoder)


HOSTILE_OPTS = options(**MOONCAKE, **{"llm.SyncKvCacheWaitTime": 1500})


@pytest.fixture
def hostile() -> Iterator[tuple[dd.LLMDataDist, Hostile, dd.Cache]]:
    """A victim DECODER (1) over Mooncake and a hostile PROMPT (0) holding blocks cache
    ``(0, 0)`` (pattern 16), both in this process."""
    victim = dd.LLMDataDist(dd.LLMRole.DECODER, 1, HOSTILE_OPTS)
    attacker = Hostile(victim, dd.LLMRole.PROMPT, 0, HOSTILE_OPTS)
    try:
        src = attacker.dd.cache_manager.allocate_blocks_cache(BLOCKS, dd.BlocksCacheKey(0, 0))
        for t, v in zip(src.tensors, pattern(BLOCKS, 16), strict=True):
            t.copy_(v)
        yield victim, attacker, src
    finally:
        attacker.close()
        victim.finalize()


def staged_accept(attacker: Hostile, address: int, then: list[dict[str, Any]]
                  ) -> Callable[[Link, dict[str, Any]], None]:
    """A script that accepts a pull of 2 rows as staged at ``address`` (a chunk per row)
    and then reports the chunks with the bodies ``then``."""
    def script(link: Link, message: dict[str, Any]) -> None:
        tid = message["tid"]
        sender = {"staged": address, "n_rows": 2, "chunk_rows": 1,
                  "row_bytes": BLOCKS.row_nbytes}
        attacker.put(f"x/{tid}/accept", {"ok": True, "sender": sender, "ack": True})
        for k, body in enumerate(then):
            attacker.put(f"x/{tid}/staged/{k}", body)
    return script


@pytest.mark.parametrize(("then", "unregistered", "code"), [
    ([{"ok": 7}], False, LLMStatusCode.LLM_LINK_FAILED),  # a malformed report
    ([], False, LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT),  # never reports a chunk
    ([{"ok": True}] * 8, True, LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT),  # nothing there
])
def test_a_hostile_staged_sender_fails_the_pull_typed_and_leaks_nothing(
        hostile: tuple[dd.LLMDataDist, Hostile, dd.Cache], then: list[dict[str, Any]],
        unregistered: bool, code: LLMStatusCode) -> None:
    """A sender that claims a staged region and then reports a chunk wrongly, never, or
    names memory it never registered: the pull fails with a typed error within the
    timeout, the link is broken, no pin is left and the receiver's staging arena is free
    again; after a relink an honest pull works."""
    victim, attacker, src = hostile
    cm = victim.cache_manager
    dst = zeros(cm)
    arena = attacker.dd._engine.staging.take(1 << 16)
    assert arena is not None
    address = 1 << 40 if unregistered else arena[1].data_ptr()
    attacker.answer(staged_accept(attacker, address, then))
    start = time.monotonic()
    with pytest.raises(LLMError) as info:
        cm.pull_blocks(dd.BlocksCacheKey(0, 0), dst, [0, 1], [3, 9])
    assert code == info.value.status_code, info.value
    assert time.monotonic() - start < 1.5 + 3.0  # the timeout, and a stall (see WAIT_MS)
    assert wait_for(lambda: 0 == sum(r.pins for r in cm.state.caches.values()))
    assert wait_for(lambda: staged(victim)[1])
    attacker.answer(None)
    attacker.relink_victim()
    cm.pull_blocks(dd.BlocksCacheKey(0, 0), dst, [5, 2], [3, 9])
    assert all(torch.equal(s[[5, 2]], t[[3, 9]])
               for s, t in zip(src.tensors, dst.tensors, strict=True))
