"""The seed-compatible facade: same names, signatures, ids and messages as the seed module."""

from __future__ import annotations

import pytest
import torch

import kvfunc as kf
from kvfunc.compat import (
    ATTN_TYPE_MANAGER_MAP,
    BlockPool,
    FullAttentionManager,
    KVCacheManager,
    MambaManager,
    SingleTypeKVCacheManager,
    SlidingWindowManager,
    create_single_type_managers,
)


def hybrid(full_blocks: int = 12, swa_blocks: int = 10, window: int = 8) -> KVCacheManager:
    return KVCacheManager(1024, [
        FullAttentionManager("FullAttention", full_blocks, 4),
        SlidingWindowManager("SlidingWindow", swa_blocks, 4, sliding_window=window),
    ], None)


# -- BlockPool ------------------------------------------------------------------

def test_block_pool_fifo_and_tail_reentry() -> None:
    """A pool hands out from the head and takes freed ids back at the tail, in call order."""
    pool = BlockPool(6, 16)
    assert (5, 0) == (pool.get_num_free_blocks(), pool.get_null_block())
    assert [1, 2, 3] == pool.get_new_blocks(3)
    pool.free_blocks([3, 1])
    assert (4, 5, 3, 1) == pool._free_block_queue
    assert [4, 5, 3] == pool.get_new_blocks(3)


def test_block_pool_errors_leave_it_unchanged() -> None:
    """Every BlockPool error has the seed's type and message and changes nothing."""
    with pytest.raises(ValueError, match="num_blocks must be positive"):
        BlockPool(0, 16)
    pool = BlockPool(4, 16)
    taken = pool.get_new_blocks(2)
    with pytest.raises(ValueError, match="num_blocks must be non-negative"):
        pool.get_new_blocks(-1)
    with pytest.raises(ValueError, match="requested 2 blocks, but only 1 are available"):
        pool.get_new_blocks(2)
    with pytest.raises(IndexError, match=r"block_id 4 is out of range \[0, 4\)"):
        pool.get_block(4)
    with pytest.raises(ValueError, match="block_id 3 is already free"):
        pool.free_blocks([taken[0], 3])
    with pytest.raises(IndexError):
        pool.free_blocks([taken[0], 99])
    assert (3,) == pool._free_block_queue  # atomic: taken[0] was not freed by either call
    pool.free_blocks([0, 0])
    assert (3,) == pool._free_block_queue


# -- single-type managers ----------------------------------------------------------

def test_pre_allocate_returns_need_and_a_real_bool() -> None:
    """pre_allocate_blocks returns (need, ok) with ok a bool, and changes nothing."""
    m = FullAttentionManager("FullAttention", 4, 4)
    need, ok = m.pre_allocate_blocks("a", 13)
    assert (4, False, bool) == (need, ok, type(ok))
    assert (3, True) == m.pre_allocate_blocks("a", 12)
    assert {} == dict(m.req_to_blocks)
    with pytest.raises(ValueError, match="num_tokens must be non-negative"):
        m.pre_allocate_blocks("a", -1)


def test_sliding_window_manager_prefill_and_skipping() -> None:
    """SWA manager: prefill gets a null head; remove_skipped_blocks frees highest index first."""
    m = SlidingWindowManager("SlidingWindow", 10, 2, manager_key="swa", sliding_window=4)
    assert (3, True) == m.pre_allocate_blocks("a", 8)
    m.allocate_new_blocks("a", 3, 8)
    assert [0, 1, 2, 3] == m.get_blocks("a")
    assert 9 == m.get_num_skipped_tokens(12)
    m.remove_skipped_blocks("a", 12)
    assert [0, 0, 0, 0] == m.get_blocks("a")
    assert (4, 5, 6, 7, 8, 9, 3, 2, 1) == m.block_pool._free_block_queue
    assert (3, True) == m.pre_allocate_blocks("a", 13, reserved_tokens=10**6)


def test_sliding_window_length_mismatch_takes_nothing() -> None:
    """A prefill allocation of the wrong size raises the seed's error before taking any block."""
    m = SlidingWindowManager("SlidingWindow", 10, 2, sliding_window=4)
    with pytest.raises(ValueError, match="length mismatch after prefill allocation: got=3, "
                                         "expected=4"):
        m.allocate_new_blocks("a", 2, 8)
    assert (9, {}) == (m.get_num_free_blocks(), dict(m.req_to_blocks))


def test_mamba_manager_tops_up() -> None:
    """MambaManager: 1 block, then any later pre-allocation tops up to 1 + next_n."""
    m = MambaManager("Mamba", 6, 1, next_n=2)
    assert (1, True) == m.pre_allocate_blocks("a", 100)
    m.allocate_new_blocks("a", 1)
    assert (2, True) == m.pre_allocate_blocks("a", 0)


def test_base_manager_is_abstract_where_the_seed_is() -> None:
    """The base class raises NotImplementedError for skipping and kwargs building."""
    m = SingleTypeKVCacheManager("Custom", 4, 4)
    with pytest.raises(NotImplementedError, match="Subclasses must implement get_num_skipped"):
        m.get_num_skipped_tokens(3)
    with pytest.raises(NotImplementedError, match="validate_and_build_kwargs"):
        SingleTypeKVCacheManager.validate_and_build_kwargs([])
    mgr = KVCacheManager(64, [m], None)
    with pytest.raises(NotImplementedError):
        mgr.allocate_slots("a", 0, 4)


def test_manager_attributes_match_the_seed() -> None:
    """Managers expose the seed's attributes, per type."""
    mgr = hybrid()
    full, swa = mgr.single_type_managers
    assert ("FullAttention", "FullAttention", 4, 1, None) == (
        full.manager_key, full.attn_type, full.block_size, full.compress_ratio, full.max_model_len)
    assert (8, 10) == (swa.sliding_window, swa.block_pool.num_blocks)
    assert {"FullAttention": FullAttentionManager, "SlidingWindow": SlidingWindowManager,
            "Mamba": MambaManager} == ATTN_TYPE_MANAGER_MAP


# -- KVCacheManager --------------------------------------------------------------------

def test_allocate_slots_matches_the_pure_core() -> None:
    """The facade hands out the same ids as the pure API and exposes the same state."""
    mgr = hybrid()
    state = mgr.state
    for rid, computed, new in [("a", 0, 20), ("b", 0, 9), ("a", 20, 1), ("b", 9, 8)]:
        assert mgr.allocate_slots(rid, computed, new)
        state = kf.allocate_slots(state, rid, computed, new).state
    assert state == mgr.state
    assert {"FullAttention": [1, 2, 3, 4, 5, 9], "SlidingWindow": [0, 0, 0, 2, 3, 7]} == \
        mgr.get_block_ids("a")
    kf.check_invariants(mgr.state)


def test_refused_allocate_slots_changes_nothing() -> None:
    """A refused call returns False and leaves the state identical (no SWA recycling)."""
    mgr = hybrid(full_blocks=100, swa_blocks=5, window=4)
    assert mgr.allocate_slots("a", 0, 16)
    assert mgr.allocate_slots("b", 0, 8)
    before = mgr.state
    assert not mgr.allocate_slots("b", 8, 9)
    assert before == mgr.state
    assert [0, 0, 1, 2] == mgr.get_block_ids("a")["SlidingWindow"]


def test_manager_calls_and_facade_calls_see_each_other() -> None:
    """A call on a single-type manager is seen by the KVCacheManager and vice versa."""
    mgr = hybrid()
    full, _swa = mgr.single_type_managers
    assert mgr.allocate_slots("a", 0, 8)
    assert [1, 2] == full.get_blocks("a")
    full.allocate_new_blocks("a", 1)
    assert [1, 2, 3] == mgr.get_block_ids("a")["FullAttention"]
    full.free("a")
    assert {"FullAttention": [], "SlidingWindow": [1, 2]} == mgr.get_block_ids("a")
    assert "FullAttention:1/12,SlidingWindow:3/10" == mgr.format_usage()
    assert 11 == full.block_pool.get_num_free_blocks()


def test_returned_lists_are_snapshots() -> None:
    """get_block_ids, get_blocks and req_to_blocks return copies, never live internals."""
    mgr = hybrid()
    mgr.allocate_slots("a", 0, 4)
    got = mgr.get_block_ids("a")
    got["FullAttention"].append(99)
    mgr.single_type_managers[0].get_blocks("a").append(98)
    with pytest.raises(TypeError):
        mgr.single_type_managers[0].req_to_blocks["a"] = [97]  # type: ignore[index]
    assert [1] == mgr.get_block_ids("a")["FullAttention"]


def test_zero_block_registrations_are_visible() -> None:
    """allocate_slots(rid, 0, 0) registers the request with empty lists (seen by reservations)."""
    mgr = hybrid()
    assert mgr.allocate_slots("a", 0, 0)
    assert {"a": []} == dict(mgr.single_type_managers[0].req_to_blocks)


def test_snapshot_and_restore() -> None:
    """snapshot() keeps a value; restore() brings it back exactly, for every view."""
    mgr = hybrid()
    mgr.allocate_slots("a", 0, 20)
    snap = mgr.snapshot()
    mgr.allocate_slots("b", 0, 20)
    mgr.free("a")
    assert snap != mgr.state
    mgr.restore(snap)
    assert snap == mgr.state
    assert [] == mgr.single_type_managers[0].get_blocks("b")
    with pytest.raises(ValueError):
        mgr.restore(hybrid(full_blocks=13).state)


def test_restore_refuses_a_state_in_vllms_free_order() -> None:
    """The seed's ids need the seed's FIFO: a state made with free_order="vllm" is refused,
    and the manager goes on as before."""
    mgr = KVCacheManager(100, [FullAttentionManager("FullAttention", 5, 16)], None)
    mgr.allocate_slots("a", 0, 20)
    before = mgr.state
    other = kf.KVState.create({"FullAttention": kf.FullAttention(num_blocks=5, block_size=16)},
                              100, free_order="vllm")
    with pytest.raises(ValueError, match="seed's order"):
        mgr.restore(other)
    assert mgr.state == before and mgr.allocate_slots("b", 0, 16)


def test_other_queries() -> None:
    """Owner keys, block sizes and max table widths as in the seed."""
    mgr = KVCacheManager(100, [FullAttentionManager("FullAttention", 5, 16),
                               MambaManager("Mamba", 5, 1, manager_key="m")], None)
    assert {"FullAttention", "m"} == mgr.get_request_owner_manager_keys(True)
    assert {"m"} == mgr.get_request_owner_manager_keys(False)
    assert {"FullAttention": 16, "m": 1} == mgr.get_block_sizes()
    assert {"FullAttention": 7, "m": 100} == mgr.get_block_table_max_lens(100)
    assert (2, 2, False) == (mgr.num_managers, mgr.num_attn_types, mgr.is_mla_backend)
    assert "0/0" == KVCacheManager(8, [], None).format_usage()


def test_duplicate_manager_keys_are_rejected() -> None:
    """Two managers with one key cannot share a state: a clear ValueError."""
    with pytest.raises(ValueError, match="manager keys must be unique"):
        KVCacheManager(8, [FullAttentionManager("FullAttention", 5, 4),
                           FullAttentionManager("FullAttention", 5, 4)], None)


# -- factory and buffer infos -------------------------------------------------------------

def _info() -> kf.ModelCacheInfo:
    return kf.ModelCacheInfo(2, [
        kf.LayerCacheInfo(1, [kf.CacheEntry("k", "FullAttention", [2, 8], 2, torch.float16, True,
                                            block_size=4)]),
        kf.LayerCacheInfo(0, [
            kf.CacheEntry("k", "SlidingWindow", 8, 2, torch.float32, True, block_size=4,
                          sliding_window=16, manager_key="swa"),
            kf.CacheEntry("idx", "Unknown", 8, 2, torch.float32, False),
        ]),
    ])


def test_create_single_type_managers_in_first_appearance_order() -> None:
    """The factory groups by group_key in layer-list order and passes type kwargs."""
    ms = create_single_type_managers(_info(), {"FullAttention": 6, "swa": 5, "extra": 1}, 256)
    assert [("FullAttention", FullAttentionManager, 6), ("swa", SlidingWindowManager, 5)] == [
        (m.manager_key, type(m), m.block_pool.num_blocks) for m in ms]
    assert (16, 256) == (ms[1].sliding_window, ms[1].max_model_len)


@pytest.mark.parametrize(("entries", "message"), [
    ([("FullAttention", 4, 1, None), ("SlidingWindow", 4, 1, 8)],
     r"group_key=g must share one attn_type, but got \['FullAttention', 'SlidingWindow'\]"),
    ([("Linear", 4, 1, None)], r"Unknown attn_type: Linear, Please add a SingleTypeKVCacheManager"),
    ([("FullAttention", 4, 1, None), ("FullAttention", 8, 1, None)],
     r"group_key=g, attn_type=FullAttention, block_sizes=\[4, 8\]"),
    ([("FullAttention", 4, 1, None), ("FullAttention", 4, 2, None)],
     r"share the same compress_ratio, but got \[1, 2\]"),
    ([("SlidingWindow", 4, 1, None)], r"SlidingWindow cache must define sliding_window"),
    ([("SlidingWindow", 4, 1, 8), ("SlidingWindow", 4, 1, 16)],
     r"share the same sliding_window, but got \[8, 16\]"),
])
def test_create_single_type_managers_errors(entries: list[tuple[str, int, int, int | None]],
                                            message: str) -> None:
    """Each grouping error of the factory has the seed's message."""
    caches = [kf.CacheEntry(f"c{i}", t, 8, 1, "bfloat16", True, block_size=bs, manager_key="g",
                            compress_ratio=cr, sliding_window=w)
              for i, (t, bs, cr, w) in enumerate(entries)]
    info = kf.ModelCacheInfo(1, [kf.LayerCacheInfo(0, caches)])
    with pytest.raises(ValueError, match=message):
        create_single_type_managers(info, {"g": 5}, 64)


def test_get_contiguous_buf_infos_order_and_sizes() -> None:
    """Five lists, sorted by layer index then definition order, storage block size in bytes."""
    info = _info()
    k_full = torch.zeros(6, 4, 2, 16, dtype=torch.float16)
    k_swa = torch.zeros(5, 4, 2, 8, dtype=torch.float32)
    layers = (kf.LayerCacheInfo(1, [info.layer_infos[0].caches[0].__class__(
                  **{**_fields(info.layer_infos[0].caches[0]), "tensor": k_full})]),
              kf.LayerCacheInfo(0, [info.layer_infos[1].caches[0].__class__(
                  **{**_fields(info.layer_infos[1].caches[0]), "tensor": k_swa}),
                  info.layer_infos[1].caches[1]]))
    info = kf.ModelCacheInfo(2, list(layers))
    mgr = KVCacheManager(64, create_single_type_managers(info, {"FullAttention": 6, "swa": 5},
                                                         64), info)
    ptrs, lens, items, keys, sizes = mgr.get_contiguous_buf_infos()
    assert [k_swa.data_ptr(), k_full.data_ptr()] == ptrs
    assert [5 * 4 * 2 * 8 * 4, 6 * 4 * 2 * 16 * 2] == lens
    assert [4 * 2 * 8 * 4, 4 * 2 * 16 * 2] == items
    assert (["swa", "FullAttention"], [4, 4]) == (keys, sizes)
    missing = KVCacheManager(64, [], _info())
    with pytest.raises(RuntimeError, match="has no tensor \u2014 allocate_cache_tensors"):
        missing.get_contiguous_buf_infos()


def _fields(entry: kf.CacheEntry) -> dict[str, object]:
    import attrs
    return {a.name: getattr(entry, a.name) for a in attrs.fields(type(entry)) if a.init}
