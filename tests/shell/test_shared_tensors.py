"""Cache tensors of a shared pool: overlaid views by layer slot, and block operations on them."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kvfunc as kf
from kvfunc import COPY_INTO_NEW, BlocksChanged, InvalidArgumentError
from kvfunc.shell import (
    ALIGNMENT_BYTES,
    BlockMover,
    HostBlockPool,
    TinyDecoder,
    TinyDecoderConfig,
    apply_delta,
    cache_tensors_by_key,
    create_shared_cache_tensors,
    overlay_view,
    plan_cache_tensors,
    with_cache_tensors,
    with_shared_cache_tensors,
)

NUM_BLOCKS = 6


def byte_span(view: torch.Tensor, block: int) -> range:
    """The addresses block ``block`` of ``view`` covers (it is contiguous)."""
    start = view[block].data_ptr()
    return range(start, start + view[block].numel() * view.element_size())


def spans(info: kf.ModelCacheInfo) -> list[tuple[str, str, int, range]]:
    """(group, entry name, block, addresses) of every block of every paged entry."""
    return [(key, name, b, byte_span(t, b))
            for key, tensors in cache_tensors_by_key(info).items()
            for name, t in tensors.items() for b in range(t.shape[0])]


def overlap(a: range, b: range) -> bool:
    """Whether two address ranges share a byte."""
    return a.start < b.stop and b.start < a.stop


def test_views_have_the_per_type_shapes_and_dtypes() -> None:
    """Each entry's view has the shape a per-type tensor of the pool's size would have."""
    info = TinyDecoder(TinyDecoderConfig()).cache_info()
    shared = cache_tensors_by_key(with_shared_cache_tensors(info, NUM_BLOCKS, "cpu"))
    own = cache_tensors_by_key(with_cache_tensors(
        info, dict.fromkeys(("FullAttention", "SlidingWindow"), NUM_BLOCKS), "cpu"))
    assert {k: {n: (t.shape, t.dtype) for n, t in ts.items()} for k, ts in own.items()} == {
        k: {n: (t.shape, t.dtype) for n, t in ts.items()} for k, ts in shared.items()}


def test_groups_overlay_by_layer_slot_and_blocks_never_overlap() -> None:
    """Same block id, same slot: shared bytes; different ids: disjoint; one group: disjoint."""
    info = TinyDecoder(TinyDecoderConfig()).cache_info()  # full, sliding, latent layers
    blocks = spans(with_shared_cache_tensors(info, NUM_BLOCKS, "cpu"))
    shared_pairs = 0
    for i, (key_a, name_a, b_a, a) in enumerate(blocks):
        for key_b, name_b, b_b, b in blocks[i + 1:]:
            if b_a != b_b or key_a == key_b:
                assert not overlap(a, b), (key_a, name_a, b_a, key_b, name_b, b_b)
            elif overlap(a, b):
                shared_pairs += 1
    # the full layer's K/V and the window layer's K/V share slot 0, block by block
    assert 2 * NUM_BLOCKS == shared_pairs  # (each slot buffer's size: the test below)


def test_slot_buffers_are_aligned_and_sized_by_the_page() -> None:
    """Each slot buffer starts at 2 MiB and holds num_blocks pages of the slot's size."""
    info = TinyDecoder(TinyDecoderConfig()).cache_info()
    layout = kf.shared_page_layout(info)
    tensors = cache_tensors_by_key(with_shared_cache_tensors(info, NUM_BLOCKS, "cpu"))
    by_slot: dict[int, set[int]] = {}
    for e in layout.entries:
        t = tensors[e.manager_key][f"layer {e.layer_idx} {e.cache_name}"]
        by_slot.setdefault(e.slot, set()).add(t.data_ptr() - e.offset)
        assert t.stride(0) * t.element_size() == layout.slot_bytes[e.slot]
        assert t.untyped_storage().nbytes() >= NUM_BLOCKS * layout.slot_bytes[e.slot]
    assert len(by_slot) == len(layout.slot_bytes)
    assert all(len(bases) == 1 and next(iter(bases)) % ALIGNMENT_BYTES == 0
               for bases in by_slot.values()), by_slot


def test_a_swapped_entry_keeps_a_tensor_of_its_own() -> None:
    """swapped_memory entries are not overlaid: their own contiguous tensor, nothing shared."""
    full = kf.CacheEntry("k", "FullAttention", 8, 2, "fp32", True, block_size=4)
    host = kf.CacheEntry("k", "SlidingWindow", 8, 2, "fp32", True, block_size=4,
                         sliding_window=8, allocator="swapped_memory")
    info = kf.ModelCacheInfo(2, [kf.LayerCacheInfo(0, [full]), kf.LayerCacheInfo(1, [host])])
    a, b = (layer.caches[0].tensor for layer in
            with_shared_cache_tensors(info, NUM_BLOCKS, "cpu").layer_infos)
    assert (True, True) == (a.is_contiguous(), b.is_contiguous())
    assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()


@pytest.mark.parametrize("num_blocks", [-1, True, 2**25, "6", 6.0])
def test_a_bad_block_count_allocates_nothing(num_blocks: Any) -> None:
    """A typed error naming the value; the input records keep no tensor."""
    info = TinyDecoder(TinyDecoderConfig()).cache_info()
    with pytest.raises(InvalidArgumentError, match="num_blocks must be an int"):
        with_shared_cache_tensors(info, num_blocks, "cpu")
    assert all(e.tensor is None for _, e in info.iter_caches())


def test_specs_of_another_model_are_refused() -> None:
    """Specs and a page layout of different models, or another block count, do not mix."""
    info = TinyDecoder(TinyDecoderConfig()).cache_info()
    other = TinyDecoder(TinyDecoderConfig(layers=("full", "full"))).cache_info()
    windows = TinyDecoder(TinyDecoderConfig(layers=("sliding", "sliding"))).cache_info()
    specs = plan_cache_tensors(other, {"FullAttention": NUM_BLOCKS})
    with pytest.raises(InvalidArgumentError, match="does not match its place"):
        create_shared_cache_tensors(specs, kf.shared_page_layout(windows), NUM_BLOCKS, "cpu")
    with pytest.raises(InvalidArgumentError, match="device cache entries"):
        create_shared_cache_tensors(specs, kf.shared_page_layout(info), NUM_BLOCKS, "cpu")
    with pytest.raises(InvalidArgumentError, match="does not match its place"):
        create_shared_cache_tensors(specs, kf.shared_page_layout(other), NUM_BLOCKS + 1, "cpu")


def test_overlay_view_checks_its_fit() -> None:
    """An offset off the element size, a block past the page, a buffer of another dtype."""
    buf = torch.zeros(3, 8, dtype=torch.uint8)
    for offset, shape in ((2, (1,)), (4, (2,)), (-4, (1,))):
        with pytest.raises(InvalidArgumentError, match="does not fit a page of 8 bytes"):
            overlay_view(buf, offset, shape, torch.float32)
    with pytest.raises(InvalidArgumentError, match="2-D uint8"):
        overlay_view(torch.zeros(3, 2), 0, (1,), torch.float32)


def shared_pair(num_blocks: int) -> dict[str, list[torch.Tensor]]:
    """Two groups' one-float blocks, overlaid: block b of 'a' is block b of 'b'."""
    buf = torch.zeros(num_blocks, 4, dtype=torch.uint8)
    return {"a": [overlay_view(buf, 0, (1,), torch.float32)],
            "b": [overlay_view(buf, 0, (1,), torch.float32)]}


def test_a_copy_reads_its_source_before_another_group_overwrites_it() -> None:
    """b seeds block 1 from its cached block 3, then a copies into 3: b gets the old 3."""
    tensors = shared_pair(8)
    tensors["a"][0][:, 0] = torch.arange(8.0)
    delta = BlocksChanged(
        order="CCC", copied_keys=("a", "b", "a"), copied_request_ids=("z", "x", "y"),
        copied_positions=(1, COPY_INTO_NEW, 0), copied_src_block_ids=(6, 3, 5),
        copied_dst_block_ids=(7, 1, 3))
    apply_delta(tensors, delta)
    assert [0.0, 3.0, 2.0, 5.0, 4.0, 5.0, 6.0, 6.0] == tensors["a"][0][:, 0].tolist()


def test_a_copy_waits_for_another_groups_earlier_write() -> None:
    """a writes block 3, then b reads it: b sees a's copy (one block space, in order)."""
    tensors = shared_pair(8)
    tensors["a"][0][:, 0] = torch.arange(8.0)
    delta = BlocksChanged(
        order="CCC", copied_keys=("b", "a", "b"), copied_request_ids=("z", "x", "y"),
        copied_positions=(1, 0, 0), copied_src_block_ids=(0, 5, 3),
        copied_dst_block_ids=(7, 3, 6))
    apply_delta(tensors, delta)
    assert [5.0, 5.0, 0.0] == tensors["b"][0][[3, 6, 7], 0].tolist()


def test_a_block_seeded_by_another_group_later_is_not_zeroed() -> None:
    """a takes block 4 (new), gives it back, b takes it seeded from 2: 4 keeps b's seed."""
    tensors = shared_pair(8)
    tensors["a"][0][:, 0] = torch.arange(1.0, 9.0)
    delta = BlocksChanged(
        order="AAC", appended_keys=("a", "b"), appended_request_ids=("x", "y"),
        appended_block_ids=(4, 4), copied_keys=("b",), copied_request_ids=("y",),
        copied_positions=(COPY_INTO_NEW,), copied_src_block_ids=(2,), copied_dst_block_ids=(4,))
    apply_delta(tensors, delta, zero_new_blocks=True)
    assert 3.0 == float(tensors["a"][0][4, 0])
    separate = {"a": [torch.arange(1.0, 9.0).view(8, 1)], "b": [torch.arange(1.0, 9.0).view(8, 1)]}
    apply_delta(separate, delta, zero_new_blocks=True)  # two pools: a's block 4 is its own
    assert (0.0, 3.0) == (float(separate["a"][0][4, 0]), float(separate["b"][0][4, 0]))


ENTRY_KINDS = st.sampled_from(["full", "swa", "mamba", "latent"])


@st.composite
def shared_models(draw: st.DrawFn) -> kf.ModelCacheInfo:
    """Random models: layers of full, window, latent and Mamba caches of assorted sizes."""
    layers = []
    for i in range(draw(st.integers(1, 6))):
        caches: list[kf.CacheEntry] = []
        for j in range(draw(st.integers(1, 2))):
            kind = draw(ENTRY_KINDS)
            dtype = draw(st.sampled_from(["fp16", "fp32", "int8"]))
            if kind == "mamba":
                caches.append(kf.MambaCacheEntry(
                    cache_name=f"s{j}", dtype=dtype, needs_block=True,
                    shape=[draw(st.integers(1, 5)), draw(st.integers(1, 7))]))
                continue
            attn = "SlidingWindow" if kind == "swa" else "FullAttention"
            extra: dict[str, Any] = {"sliding_window": 8} if kind == "swa" else {}
            dim: Any = [2, draw(st.integers(1, 5))] if kind == "latent" else \
                draw(st.integers(1, 9))
            caches.append(kf.CacheEntry(
                f"c{j}", attn, dim, draw(st.integers(1, 3)), dtype, True,
                block_size={"full": 4, "latent": 4, "swa": 2}[kind],
                cache_layout=draw(st.sampled_from(["BnBsND", "BnNBsD"])),
                manager_key="latent" if kind == "latent" else None, **extra))
        layers.append(kf.LayerCacheInfo(i, caches))
    return kf.ModelCacheInfo(len(layers), layers)


@given(info=shared_models(), num_blocks=st.integers(1, 4))
def test_random_models_overlay_without_overlap_between_ids(info: kf.ModelCacheInfo,
                                                           num_blocks: int) -> None:
    """Any model: blocks of different ids never share a byte, nor do two blocks of one group."""
    blocks = spans(with_shared_cache_tensors(info, num_blocks, "cpu"))
    layout = kf.shared_page_layout(info)
    for i, (key_a, name_a, b_a, a) in enumerate(blocks):
        for key_b, name_b, b_b, b in blocks[i + 1:]:
            if b_a != b_b or key_a == key_b:
                assert not overlap(a, b), (key_a, name_a, b_a, key_b, name_b, b_b)
    assert layout.page_bytes == sum(layout.slot_bytes)
    assert all(g.block_bytes <= layout.page_bytes for g in layout.groups)
    assert sum(len(s) for *_, s in blocks) == num_blocks * sum(e.block_bytes
                                                              for e in layout.entries)


@pytest.mark.parametrize("host_layout", ["layer", "block"])
def test_the_host_tier_moves_overlaid_blocks(host_layout: str) -> None:
    """Store and load one group's blocks of a shared pool; the other group's ids keep theirs."""
    info = with_shared_cache_tensors(TinyDecoder(TinyDecoderConfig()).cache_info(),
                                     NUM_BLOCKS, "cpu")
    tensors = cache_tensors_by_key(info)
    gen = torch.Generator().manual_seed(0)
    for views in tensors.values():
        for view in views.values():
            view.copy_(torch.randn(view.shape, generator=gen))
    full, swa = tensors["FullAttention"], tensors["SlidingWindow"]
    others = {n: v[[2, 4]].clone() for n, v in swa.items()}  # ids the window group holds
    mover = BlockMover.create(full, HostBlockPool.like(full, 4, layout=host_layout))
    try:
        kept = {n: v[[3, 5]].clone() for n, v in full.items()}
        mover.store([3, 5], [0, 1]).wait()
        for view in full.values():
            view[[3, 5]] = 0
        mover.load([0, 1], [3, 5]).wait()
    finally:
        mover.close()
    assert all(torch.equal(kept[n], v[[3, 5]]) for n, v in full.items())
    assert all(torch.equal(others[n], v[[2, 4]]) for n, v in swa.items())
