"""Sizing of a pool shared by every group: the page by layer slots, the block count, errors."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvfunc as kf
from kvfunc import (
    CacheEntry,
    InsufficientMemoryError,
    InvalidArgumentError,
    InvalidCacheInfo,
    InvalidTypeError,
    LayerCacheInfo,
    MambaCacheEntry,
    ModelCacheInfo,
    SizingConfig,
    calculate_block_num,
    calculate_shared_block_num,
    shared_page_layout,
)

GIB = 2**30
CONFIG = SizingConfig(batch_size_per_dp_rank=4, mem_fraction_static=0.9, max_prefill_tokens=256)


def kv(attn: str, heads: int = 2, dim: int = 64, dtype: str = "bf16", bs: int = 16,
       **kw: Any) -> list[CacheEntry]:
    """The K and V caches of one layer."""
    if attn == "SlidingWindow":
        kw.setdefault("sliding_window", 128)
    return [CacheEntry(name, attn, dim, heads, dtype, True, block_size=bs, **kw)
            for name in ("k", "v")]


def info_of(*layers: list[CacheEntry]) -> ModelCacheInfo:
    """A ModelCacheInfo with one layer per list, indices 0, 1, ..."""
    return ModelCacheInfo(len(layers), [LayerCacheInfo(i, c) for i, c in enumerate(layers)])


def size(info: ModelCacheInfo, memory: int = GIB, config: SizingConfig = CONFIG,
         **kw: Any) -> kf.SharedPoolSizing:
    """The shared sizing of ``info`` for ``memory`` bytes, all free."""
    return calculate_shared_block_num(config, info, free_memory_bytes=memory,
                                      total_memory_bytes=memory, **kw)


def test_alternating_layers_of_equal_size_share_slots_without_padding() -> None:
    """gpt-oss style: window and full layers alternate; slot j holds the j-th layer of each."""
    info = info_of(*[kv("SlidingWindow" if i % 2 == 0 else "FullAttention") for i in range(6)])
    layout = shared_page_layout(info)
    block = 16 * 2 * 64 * 2  # one block of K (or V): rows x heads x dim x bf16
    assert (2 * block,) * 3 == layout.slot_bytes
    assert [("SlidingWindow", 3, 6 * block), ("FullAttention", 3, 6 * block)] == [
        (g.manager_key, g.num_layers, g.block_bytes) for g in layout.groups]
    assert (0, 0) == (layout.padding("SlidingWindow"), layout.padding("FullAttention"))
    where = {(e.manager_key, e.layer_idx, e.cache_name): (e.slot, e.offset)
             for e in layout.entries}
    assert where[("SlidingWindow", 2, "v")] == where[("FullAttention", 3, "v")] == (1, block)


def test_a_slot_takes_its_largest_layer_and_smaller_groups_are_padded() -> None:
    """One full layer of 4 heads beside two window layers of 1 head: slot 0 fits the full one."""
    info = info_of(kv("FullAttention", heads=4), kv("SlidingWindow", heads=1),
                   kv("SlidingWindow", heads=1))
    layout = shared_page_layout(info)
    head_block = 16 * 64 * 2 * 2  # K and V of one head over one block
    assert (4 * head_block, head_block) == layout.slot_bytes
    assert 5 * head_block == layout.page_bytes
    assert (head_block, 3 * head_block) == (layout.padding("FullAttention"),
                                            layout.padding("SlidingWindow"))


def test_entries_sit_at_multiples_of_their_element_size() -> None:
    """A 6-byte fp16 block followed by an fp32 one starts at byte 8; the slot is 4-byte whole."""
    layer = [CacheEntry("a", "FullAttention", 3, 1, "fp16", True, block_size=1),
             CacheEntry("b", "FullAttention", 1, 1, "fp32", True, block_size=1)]
    layout = shared_page_layout(info_of(layer))
    assert [(0, 6), (8, 4)] == [(e.offset, e.block_bytes) for e in layout.entries]
    assert (12,) == layout.slot_bytes


def test_swapped_and_blockless_entries_take_no_page() -> None:
    """Host (swapped) entries keep their own tensors; entries without needs_block are skipped."""
    swapped = kv("SlidingWindow", allocator="swapped_memory")
    info = info_of(kv("FullAttention") + [CacheEntry("idx", "FullAttention", 8, 1, "bf16",
                                                     False)], swapped)
    layout = shared_page_layout(info)
    assert [("FullAttention", 1), ("SlidingWindow", 0)] == [
        (g.manager_key, g.num_layers) for g in layout.groups]
    assert ["k", "v"] == [e.cache_name for e in layout.entries]
    assert (0, layout.page_bytes) == (layout.group("FullAttention").block_bytes
                                      - layout.page_bytes, layout.padding("SlidingWindow"))


def test_mamba_states_are_one_block_each() -> None:
    """A Mamba entry's block is its whole state; block size 1."""
    ssm = MambaCacheEntry(cache_name="ssm", dtype="fp32", needs_block=True, shape=[4, 8])
    layout = shared_page_layout(info_of(kv("FullAttention"), [ssm]))
    assert [("Mamba", 1, 128)] == [(g.manager_key, g.block_size, g.block_bytes)
                                   for g in layout.groups if g.attn_type == "Mamba"]
    assert (2 * 16 * 2 * 64 * 2,) == layout.slot_bytes


def test_online_blocks_are_the_budget_over_the_page() -> None:
    """The pool gets (total x fraction - used - extra) // page blocks; every group states it."""
    info = info_of(*[kv("SlidingWindow" if i % 2 == 0 else "FullAttention") for i in range(4)])
    page = 2 * 2 * (16 * 2 * 64 * 2)
    sizing = calculate_shared_block_num(CONFIG, info, free_memory_bytes=GIB // 2,
                                        total_memory_bytes=GIB, extra_reserved_memory_bytes=1000)
    expected = int((GIB * 0.9 - GIB // 2 - 1000) // page)
    assert (expected, page) == (sizing.num_blocks, sizing.page_bytes)
    assert {"SlidingWindow": expected, "FullAttention": expected} == sizing.block_num_by_type
    assert (expected * page, (expected - 1) * 16) == (sizing.total_bytes,
                                                      sizing.tokens("FullAttention"))


def test_the_state_takes_the_sizing() -> None:
    """KVState.from_cache_info with the sizing's counts and layout="shared" makes one pool."""
    info = info_of(kv("SlidingWindow"), kv("FullAttention"))
    sizing = size(info, 64 * 2**20)
    state = kf.KVState.from_cache_info(info, sizing.block_num_by_type, 4096, layout="shared")
    assert [("shared", ("SlidingWindow", "FullAttention"), sizing.num_blocks)] == [
        (p.name, p.members, p.num_blocks) for p in state.pools]


@given(layers=st.integers(1, 6), heads=st.integers(1, 8), dim=st.sampled_from([16, 64, 128]),
       bs=st.sampled_from([1, 16, 128]), dtype=st.sampled_from(["bf16", "fp32", "fp8"]),
       memory=st.integers(1, 64 * GIB), used=st.floats(0, 1), fraction=st.floats(0.05, 1),
       extra=st.integers(0, 2**28))
def test_one_paged_group_gets_the_seeds_count(layers: int, heads: int, dim: int, bs: int,
                                              dtype: str, memory: int, used: float,
                                              fraction: float, extra: int) -> None:
    """One full-attention group: the shared pool has the seed's block count, or both fail."""
    info = info_of(*[kv("FullAttention", heads, dim, dtype, bs) for _ in range(layers)])
    config = SizingConfig(batch_size_per_dp_rank=8, mem_fraction_static=fraction,
                          max_prefill_tokens=512)
    figures: dict[str, Any] = {"free_memory_bytes": memory - int(memory * used),
                               "total_memory_bytes": memory,
                               "extra_reserved_memory_bytes": extra}
    try:
        seed = calculate_block_num(config, info, **figures)
    except InsufficientMemoryError:
        with pytest.raises(InsufficientMemoryError):
            calculate_shared_block_num(config, info, **figures)
        return
    assert seed == calculate_shared_block_num(config, info, **figures).block_num_by_type


def test_offline_holds_every_groups_need_for_the_batch() -> None:
    """Offline: ceil(len / bs) x batch per paged group + the window's blocks + the null block."""
    info = info_of(kv("SlidingWindow"), kv("FullAttention"))
    sizing = size(info, GIB, offline_max_len=1000)
    window = 4 * ((128 + 15) // 16 + 1)  # the seed's per-request window blocks, for the batch
    assert 63 * 4 + window + 1 == sizing.num_blocks
    with pytest.raises(InsufficientMemoryError, match="offline mode"):
        size(info, sizing.num_blocks * sizing.page_bytes - 1, offline_max_len=1000)


def test_offline_splits_full_attention_over_the_dp_group() -> None:
    """offline_prefill_dp_group_size splits a full-attention group's batch, as the seed does."""
    config = SizingConfig(batch_size_per_dp_rank=8, mem_fraction_static=0.9,
                          max_prefill_tokens=16, offline_prefill_dp_group_size=4)
    assert 4 * 2 + 1 == size(info_of(kv("FullAttention")), GIB, config,
                             offline_max_len=64).num_blocks


def test_min_across_ranks_lowers_the_pool() -> None:
    """Every TP rank takes the smallest pool; a reply outside [0, local] is refused."""
    info = info_of(kv("FullAttention"))
    local = size(info).num_blocks
    asked: list[int] = []

    def smallest(n: int) -> int:
        asked.append(n)
        return 100

    assert 100 == size(info, min_across_ranks=smallest).num_blocks
    assert [local] == asked
    for bad in (local + 1, -1, True, 5.0):
        with pytest.raises(InvalidArgumentError, match="min_across_ranks"):
            size(info, min_across_ranks=lambda n, bad=bad: bad)


def test_the_pool_must_hold_the_windows_and_one_prefill_per_paged_group() -> None:
    """Too small a budget: a typed error naming the blocks it has and the blocks it needs."""
    info = info_of(kv("SlidingWindow"), kv("FullAttention"))
    page = shared_page_layout(info).page_bytes
    need = 1 + 4 * ((128 + 15) // 16 + 1) + -(-(256 + 1) // 16)
    assert need <= size(info, int(need * page / 0.9) + page).num_blocks
    with pytest.raises(InsufficientMemoryError, match=f"required blocks={need}"):
        size(info, int((need - 1) * page / 0.9))
    with pytest.raises(InsufficientMemoryError, match="No available memory"):
        calculate_shared_block_num(CONFIG, info, free_memory_bytes=0, total_memory_bytes=GIB)


def test_a_pool_with_no_device_entry_cannot_be_sized_from_memory() -> None:
    """Only swapped entries: no page to divide the budget by; no cache at all: one block."""
    with pytest.raises(InsufficientMemoryError, match="No HBM-backed cache entry"):
        size(info_of(kv("FullAttention", allocator="swapped_memory")))
    blockless = info_of([CacheEntry("idx", "FullAttention", 8, 1, "bf16", False)])
    assert (1, ()) == (size(blockless).num_blocks, size(blockless).layout.groups)


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"free_memory_bytes": -1}, InvalidArgumentError, "free_memory_bytes must be >= 0"),
    ({"free_memory_bytes": 1.5}, InvalidTypeError, "free_memory_bytes must be an int"),
    ({"total_memory_bytes": True}, InvalidTypeError, "total_memory_bytes must be an int"),
    ({"free_memory_bytes": 2 * GIB}, InvalidArgumentError, "exceeds total_memory_bytes"),
    ({"offline_max_len": "8"}, InvalidTypeError, "offline_max_len must be an int"),
    ({"extra_reserved_memory_bytes": -5}, InvalidArgumentError, "extra_reserved"),
    ({"min_across_ranks": 3}, InvalidTypeError, "min_across_ranks must be callable"),
])
def test_bad_arguments_are_typed_errors(kwargs: dict[str, Any], error: type[Exception],
                                        match: str) -> None:
    """Every figure and option is checked before anything is computed."""
    figures: dict[str, Any] = {"free_memory_bytes": GIB, "total_memory_bytes": GIB, **kwargs}
    with pytest.raises(error, match=match):
        calculate_shared_block_num(CONFIG, info_of(kv("FullAttention")), **figures)


def test_bad_models_are_typed_errors() -> None:
    """Wrong types, caches validate_cache_info refuses, groups mixing types or block sizes."""
    with pytest.raises(InvalidTypeError, match="config must be a SizingConfig"):
        calculate_shared_block_num(None, info_of(kv("FullAttention")),  # type: ignore[arg-type]
                                   free_memory_bytes=GIB, total_memory_bytes=GIB)
    with pytest.raises(InvalidTypeError, match="cache_info must be a ModelCacheInfo"):
        shared_page_layout({"layers": []})  # type: ignore[arg-type]
    with pytest.raises(InvalidCacheInfo, match="must have positive num_head"):
        shared_page_layout(info_of(kv("FullAttention", heads=0)))
    mixed = info_of(kv("FullAttention"), kv("FullAttention", bs=32))
    with pytest.raises(InvalidCacheInfo, match="share one attn_type and block_size"):
        shared_page_layout(mixed)
    swa_as_full = info_of(kv("FullAttention"), kv("SlidingWindow", manager_key="FullAttention"))
    with pytest.raises(InvalidCacheInfo, match="FullAttention/16 and SlidingWindow/16"):
        shared_page_layout(swa_as_full)
    with pytest.raises(InvalidArgumentError, match="no group 'nope'"):
        shared_page_layout(info_of(kv("FullAttention"))).padding("nope")
