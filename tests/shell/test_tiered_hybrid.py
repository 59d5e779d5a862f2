"""A hybrid model's tiers end to end: the tiny decoder's full-attention and sliding-window
layers over one shared pool, a host tier of pages, the block mover doing every move.

A request computes, the device evicts its blocks to the host tier (or copies them down as
it caches them), another request overwrites every device block, then the first prompt
comes back: it hits below the device, the mover loads a page of each group per position,
and the logits of the tokens computed after the loads match dense attention.  A wrong load,
a missing window block or a page copied from the wrong place changes them.
"""

from __future__ import annotations

import random

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

    def __init__(self, num_blocks: int, host_blocks: int, write_policy: str) -> None:
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
                                           write_policy=write_policy)
        pages = shared_page_buffers([c.tensor for _, c in info.iter_caches() if c.needs_block])
        self.host = HostBlockPool.like(pages, host_blocks)
        self.mover = BlockMover.create(pages, self.host)
        self.buffer = BlockTableBuffer.from_state(device, max_num_requests=4)
        self.tokens: dict[str, list[int]] = {}
        self.loaded: list[tuple[str, int]] = []  # (group, device block) of every load

    def close(self) -> None:
        self.mover.close()

    def _moves(self, delta: kf.TierDelta, directions: tuple[str, ...]) -> None:
        for _, direction, _, src, dst, _, _, key in delta.moves():
            if direction not in directions:
                continue
            if direction == "device->host":
                handle = self.mover.store([src], [dst])
            else:
                handle = self.mover.load([src], [dst])
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
        self._moves(res.delta, ("device->host", "host->device") if write_back
                    else ("host->device",))
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
        if self.state.moves:
            res = kf.complete_moves(self.state, done=list(self.state.moves))
            self.state = res.state
            self.buffer.apply(res.delta)

    def free(self, rid: str) -> None:
        self.state, delta = kf.free_tiered(self.state, rid)
        self.buffer.apply(delta)
        if self.state.write_policy == "write-back":
            self._moves(delta, ("device->host",))
        self._settle()
        del self.tokens[rid]


@pytest.mark.parametrize("write_policy", kf.WRITE_POLICIES)
def test_a_hybrid_prefix_comes_back_from_the_host_tier(write_policy: str) -> None:
    """Both groups' blocks of a prompt go down, a filler overwrites the device, and the prompt
    comes back loaded from the host: prefill and decode match dense attention."""
    rng = random.Random(7)
    run = TieredRun(num_blocks=21, host_blocks=48, write_policy=write_policy)
    try:
        prompt = [rng.randrange(CONFIG.vocab_size) for _ in range(30)]
        run.step("a", prompt)
        for _ in range(3):
            run.step("a", [*run.tokens["a"], rng.randrange(CONFIG.vocab_size)])
        history = run.tokens["a"]
        run.free("a")
        run.step("filler", [rng.randrange(CONFIG.vocab_size) for _ in range(40)])
        run.free("filler")
        h = kf.BlockHashes.of(history, BS)
        assert kf.lookup_prefix(run.state.device, h).num_tokens == 0  # none left on the device
        tokens = [*history, rng.randrange(CONFIG.vocab_size), rng.randrange(CONFIG.vocab_size)]
        run.step("a2", tokens)
        keys = run.state.keys
        assert sorted({k for k, _ in run.loaded}) == sorted(keys)
        assert len(run.loaded) == len(keys) * (len(history) // BS)  # 8 positions, every group
        tables = kf.get_block_ids(run.state.device, "a2")
        assert {(k, b) for k, b in run.loaded} == {(k, tables[k][p]) for k in keys
                                                   for p in range(len(history) // BS)}
        for _ in range(6):
            run.step("a2", [*run.tokens["a2"], rng.randrange(CONFIG.vocab_size)])
        kf.check_tiered_invariants(run.state)
    finally:
        run.close()


def test_shared_page_buffers_refuse_views_that_are_not_pages() -> None:
    """Views of one buffer that disagree on the page or block count, a block that is not
    contiguous, junk, or nothing at all: typed errors."""
    from kvfunc.shell import overlay_view

    buf = torch.zeros(4, 64, dtype=torch.uint8)
    a = overlay_view(buf, 0, (4, 2), torch.float32)
    assert [b.data_ptr() for b in shared_page_buffers([a])] == [buf.data_ptr()]
    b = overlay_view(buf, 32, (8,), torch.float32)
    pages = shared_page_buffers({"a": a, "b": b})
    assert len(pages) == 1 and pages[0].shape == (4, 64)
    for bad in ([], [a, buf[:2].view(torch.float32)], [a, a.transpose(1, 2)],
                [a, torch.zeros(4, 64, dtype=torch.uint8).view(torch.float32)[:, ::2]]):
        with pytest.raises(kf.InvalidArgumentError):
            shared_page_buffers(bad)
    for junk in ("ab", 3, [a, "b"]):
        with pytest.raises(kf.InvalidTypeError):
            shared_page_buffers(junk)  # type: ignore[arg-type]
