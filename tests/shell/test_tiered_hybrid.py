"""A hybrid model's tiers end to end: the tiny decoder's full-attention and sliding-window
layers over one shared pool, a host tier of pages, the block mover doing every move.

A request computes, the device evicts its blocks to the host tier (or copies them down as
it caches them), another request overwrites every device block, then the first prompt
comes back: it hits below the device, the mover loads a page of each group per position,
and the logits of the tokens computed after the loads match dense attention.  A wrong load,
a missing window block or a page copied from the wrong place changes them.  With a Mooncake
Store behind a small host tier, the pages the host evicts go to the store under their tier
keys and come back through a staging pool.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import kvfunc as kf
from kvfunc.shell import (
    BlockMover,
    BlockTableBuffer,
    HostBlockPool,
    TinyDecoder,
    TinyDecoderConfig,
    shared_page_buffers,
    with_shared_cache_tensors,
)

CONFIG = TinyDecoderConfig()  # full, sliding (a window of 12 tokens) and latent layers
BS = CONFIG.block_size


class TieredRun:
    """A tiered state over the decoder's shared caches, every move done by a BlockMover."""

    def __init__(self, num_blocks: int, host_blocks: int, write_policy: str, *,
                 servers: Any = None) -> None:
        self.model = TinyDecoder(CONFIG)
        info = with_shared_cache_tensors(self.model.cache_info(), num_blocks, "cpu")
        self.model.bind_caches(info)
        for cache in self.model.caches.values():
            cache.fill_(float("nan"))
        keys = {c.group_key for _, c in info.iter_caches() if c.needs_block}
        device = kf.KVState.from_cache_info(info, dict.fromkeys(keys, num_blocks),
                                            CONFIG.max_model_len, layout="shared",
                                            enable_prefix_caching=True)
        self.state = kf.TieredState.create(device, host_blocks=host_blocks,
                                           write_policy=write_policy,
                                           remote=servers is not None)
        pages = shared_page_buffers([c.tensor for _, c in info.iter_caches() if c.needs_block])
        self.host = HostBlockPool.like(pages, host_blocks, layout="block")
        self.mover = BlockMover.create(pages, self.host)
        self.stores: list[Any] = []
        if servers is not None:  # the store behind the host, and a staging pool for fetches
            from kvfunc.shell import MooncakeStore, MooncakeStoreConfig

            config = MooncakeStoreConfig(master_address=servers.master_address,
                                         metadata_server=servers.metadata_server,
                                         probe_timeout_s=5.0, call_timeout_s=5.0)
            staging = HostBlockPool.like(pages, 1, layout="block")
            self.stores = [MooncakeStore.connect(config, pool, namespace="tiny",
                                                 group_key="pages")
                           for pool in (self.host, staging)]
            self.staging = BlockMover.create(pages, staging)
        self.buffer = BlockTableBuffer.from_state(device, max_num_requests=4)
        self.tokens: dict[str, list[int]] = {}
        self.loaded: list[tuple[str, int]] = []  # (group, device block) of every load
        self.ran: list[str] = []  # the direction of every move run
        self.done: list[int] = []  # moves run and not yet reported

    def close(self) -> None:
        self.mover.close()
        for store in self.stores:
            store.close()
        if self.stores:
            self.staging.close()

    def _moves(self, delta: kf.TierDelta, directions: tuple[str, ...]) -> None:
        for move_id, direction, tier_key, src, dst, _, _, key in delta.moves():
            if direction not in directions:
                continue
            self.ran.append(direction)
            self.done.append(move_id)
            if direction == "host->remote":  # a host block the next store reuses: read first
                assert self.stores[0].put_blocks([tier_key], [src]).ok == (0,)
                continue
            if direction == "remote->device":
                assert self.stores[1].get_blocks([tier_key], [0]).ok == (0,)
                handle = self.staging.load([0], [dst])
            elif direction == "device->host":
                handle = self.mover.store([src], [dst])
            else:
                handle = self.mover.load([src], [dst])
            if direction != "device->host":
                self.loaded.append((key, dst))
            assert handle.wait(10)

    def step(self, rid: str, tokens: list[int]) -> None:
        """Admit ``rid`` with ``tokens`` (its hit from any tier), or run it on to ``tokens``,
        and check the logits of what it computes against dense attention."""
        h = kf.BlockHashes.of(tokens, BS)
        if rid not in self.tokens:
            hit = kf.lookup_tiers(self.state, h, max_tokens=len(tokens) - 1)
            entry = (rid, hit.num_tokens, len(tokens) - hit.num_tokens, 0, 0, None, h, hit)
            start = hit.num_tokens
            res = kf.allocate_tiered(self.state, [entry])
        else:
            start = len(self.tokens[rid])
            res = kf.allocate_tiered(self.state, [(rid, start, len(tokens) - start)],
                                     block_hashes={rid: h})
        assert not res.refused
        self.state = res.state
        self.buffer.apply(res.delta)
        write_back = self.state.write_policy == "write-back"
        # Stores of evicted blocks read them before the forward pass reuses them; loads fill
        # the request's blocks before it computes.
        self._moves(res.delta, ("host->remote", "device->host", "host->device",
                                "remote->device") if write_back
                    else ("host->device", "remote->device"))
        self._settle()
        positions = torch.arange(start, len(tokens))
        ends = [len(tokens) - start]
        logits = self.model.forward_paged(tokens[start:], positions, ends,
                                          self.buffer.block_tables([rid]),
                                          self.buffer.slot_mappings([rid], positions, ends))
        dense = self.model.forward_dense(tokens)[start:]
        worst = float((logits - dense).abs().max())
        assert worst <= 1e-5, f"paged and dense logits of {rid} differ by {worst}"
        if not write_back:  # stores of blocks just cached: after the forward pass fills them
            self._moves(res.delta, ("device->host",))
        self._settle()
        self.tokens[rid] = list(tokens)

    def _settle(self) -> None:
        """Report every move that ran done (a move is reported only once its copy is made)."""
        while self.done:  # write-through: a done host store starts a remote one
            res = kf.complete_moves(self.state, done=self.done)
            self.done = []
            self.state = res.state
            self.buffer.apply(res.delta)
            self._moves(res.delta, ("host->remote",))

    def free(self, rid: str) -> None:
        self.state, delta = kf.free_tiered(self.state, rid)
        self.buffer.apply(delta)
        if self.state.write_policy == "write-back":
            self._moves(delta, ("host->remote", "device->host"))
        self._settle()
        del self.tokens[rid]


def _comes_back(run: TieredRun, fillers: int = 1) -> None:
    """Prompt "a" computes and decodes, ``fillers`` requests in turn overwrite the device,
    "a" comes back from below the device: prefill and decode match dense attention."""
    rng = random.Random(7)
    prompt = [rng.randrange(CONFIG.vocab_size) for _ in range(30)]
    run.step("a", prompt)
    for _ in range(3):
        run.step("a", [*run.tokens["a"], rng.randrange(CONFIG.vocab_size)])
    history = run.tokens["a"]
    run.free("a")
    for _ in range(fillers):
        run.step("filler", [rng.randrange(CONFIG.vocab_size) for _ in range(40)])
        run.free("filler")
    h = kf.BlockHashes.of(history, BS)
    assert kf.lookup_prefix(run.state.device, h).num_tokens == 0  # none left on the device
    tokens = [*history, rng.randrange(CONFIG.vocab_size), rng.randrange(CONFIG.vocab_size)]
    run.step("a2", tokens)
    keys, positions = run.state.keys, len(history) // BS
    assert sorted({k for k, _ in run.loaded}) == sorted(keys)
    assert len(run.loaded) == len(keys) * positions  # 8 positions, every group
    tables = kf.get_block_ids(run.state.device, "a2")
    assert set(run.loaded) == {(k, tables[k][p]) for k in keys for p in range(positions)}
    for _ in range(6):
        run.step("a2", [*run.tokens["a2"], rng.randrange(CONFIG.vocab_size)])
    kf.check_tiered_invariants(run.state)
    assert not run.state.moves  # every move ran and was reported


@pytest.mark.parametrize("write_policy", kf.WRITE_POLICIES)
def test_a_hybrid_prefix_comes_back_from_the_host_tier(write_policy: str) -> None:
    """Both groups' pages of a prompt go down to a host tier large enough for all of them."""
    run = TieredRun(num_blocks=21, host_blocks=48, write_policy=write_policy)
    try:
        _comes_back(run)
    finally:
        run.close()


@pytest.mark.parametrize("write_policy", kf.WRITE_POLICIES)
def test_a_hybrid_prefix_comes_back_from_a_mooncake_store(write_policy: str,
                                                         tmp_path: Path) -> None:
    """Behind a host tier of 18 pages, the prompt's pages go on to a real Mooncake Store under
    their tier keys when a second filler needs the host (write-back), or once stored on the
    host (write-through), and come back from there."""
    pytest.importorskip("mooncake.store", reason="needs the kvfunc[mooncake] extra")
    sys.path.insert(0, str(Path(__file__).parent))
    from mooncake_servers import MooncakeServers

    servers = MooncakeServers(tmp_path / "mooncake")
    try:
        run = TieredRun(num_blocks=21, host_blocks=18, write_policy=write_policy,
                        servers=servers)
        try:
            _comes_back(run, fillers=2)
            assert {"host->remote", "remote->device"} <= set(run.ran)
        finally:
            run.close()
    finally:
        servers.stop()


def test_shared_page_buffers_refuse_views_that_are_not_pages() -> None:
    """Views of one buffer that disagree on the page or block count, a block that is not
    contiguous, buffers that overlap in memory, views of no block, junk, or nothing at all:
    typed errors."""
    from kvfunc.shell import overlay_view

    buf = torch.zeros(4, 64, dtype=torch.uint8)
    a = overlay_view(buf, 0, (4, 2), torch.float32)
    assert [b.data_ptr() for b in shared_page_buffers([a])] == [buf.data_ptr()]
    b = overlay_view(buf, 32, (8,), torch.float32)
    pages = shared_page_buffers({"a": a, "b": b})
    assert len(pages) == 1 and pages[0].shape == (4, 64)
    mem = torch.zeros(8, 64, dtype=torch.uint8)
    overlapping = [torch.from_numpy(mem.numpy()).view(torch.float32),
                   torch.from_numpy(mem.numpy()[4:]).view(torch.float32)]  # two storages
    for bad in ([], [a, buf[:2].view(torch.float32)], [a, a.transpose(1, 2)],
                [a, torch.zeros(4, 64, dtype=torch.uint8).view(torch.float32)[:, ::2]],
                overlapping, [torch.zeros(0, 4), torch.zeros(0, 4)]):
        with pytest.raises(kf.InvalidArgumentError):
            shared_page_buffers(bad)
    for junk in ("ab", 3, [a, "b"]):
        with pytest.raises(kf.InvalidTypeError):
            shared_page_buffers(junk)  # type: ignore[arg-type]
