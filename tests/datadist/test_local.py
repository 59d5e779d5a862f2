"""One cluster on its own: the pool, cache views, local copies and swaps, bad input."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch_threads import one_torch_thread  # noqa: F401  (autouse)

import kvfunc.datadist as dd
from kvfunc.core import LLMError, LLMStatusCode

F32 = dd.DataType.DT_FLOAT
CODE = LLMStatusCode


@pytest.fixture
def cluster() -> Iterator[dd.LLMDataDist]:
    """A PROMPT cluster with a 1 MiB device pool and a 256 KiB host pool (pages of 4 KiB)."""
    d = dd.LLMDataDist(dd.LLMRole.PROMPT, 0, {
        "llm.MemPoolConfig": '{"memory_size": 1048576, "page_shift": 12}',
        "llm.HostMemPoolConfig": '{"memory_size": 262144, "page_shift": 12}',
        "llm.Device": "cpu"})
    try:
        yield d
    finally:
        d.finalize()


def filled(cm: dd.CacheManager, desc: dd.CacheDesc, blocks: bool = True) -> dd.Cache:
    """A cache whose element ``k`` of tensor ``i`` holds ``100 * i + k``."""
    cache = cm.allocate_blocks_cache(desc) if blocks else cm.allocate_cache(desc)
    for i, t in enumerate(cache.tensors):
        t.copy_(torch.arange(t.numel(), dtype=torch.float32).view(t.shape) + 100 * i)
    return cache


def test_caches_are_views_into_the_one_pool(cluster: dd.LLMDataDist) -> None:
    """Every tensor lies inside the pre-allocated pool, page aligned, back to back."""
    cm = cluster.cache_manager
    pool = cm._pool.buffers[dd.Placement.DEVICE]
    a = cm.allocate_cache(dd.CacheDesc(2, (3, 5), F32))
    b = cm.allocate_blocks_cache(dd.CacheDesc(4, (10, 2, 3), dd.DataType.DT_BF16))
    base = pool.data_ptr()
    offsets = [t.data_ptr() - base for c in (a, b) for t in c.tensors]
    assert [0, 60, 4096, 4216, 4336, 4456] == offsets
    assert [torch.Size([10, 2, 3])] * 4 == [t.shape for t in b.tensors]


def test_pool_exhausted_raises_out_of_memory_with_nothing_allocated(
        cluster: dd.LLMDataDist) -> None:
    """LLM_DEVICE_OUT_OF_MEMORY (a MemoryError); the registry is the same object after."""
    cm = cluster.cache_manager
    cm.allocate_cache(dd.CacheDesc(1, (1, 200_000), F32))
    before = cm.state
    with pytest.raises(MemoryError) as info:
        cm.allocate_cache(dd.CacheDesc(1, (1, 100_000), F32), [dd.CacheKey(0, 1)])
    assert (CODE.LLM_DEVICE_OUT_OF_MEMORY, True) == (info.value.status_code, cm.state is before)


def test_deallocate_releases_and_invalidates(cluster: dd.LLMDataDist) -> None:
    """After deallocate_cache the pool bytes are free, the handle empty, a second call a no-op."""
    cm = cluster.cache_manager
    cache = cm.allocate_cache(dd.CacheDesc(1, (4, 4), F32))
    cm.deallocate_cache(cache)
    cm.deallocate_cache(cache)
    assert (0, False, []) == (cm.state.used_bytes(), cache.valid, cache.tensors)
    with pytest.raises(dd.InvalidParamError):
        cm.copy_cache(cache, cache)


def test_copy_cache_copies_a_prefix_into_another_batch_entry(cluster: dd.LLMDataDist) -> None:
    """Bytes [8, 24) of entry 1 of every tensor land in entry 0 of the destination."""
    cm = cluster.cache_manager
    src = filled(cm, dd.CacheDesc(2, (2, 8), F32), blocks=False)
    dst = cm.allocate_cache(dd.CacheDesc(2, (3, 12), F32))
    for t in dst.tensors:
        t.zero_()
    cm.copy_cache(dst, src, dst_batch_index=0, src_batch_index=1, offset=8, size=16)
    expected = [[0.0, 0.0, 10.0, 11.0, 12.0, 13.0] + [0.0] * 6,
                [0.0, 0.0, 110.0, 111.0, 112.0, 113.0] + [0.0] * 6]
    assert expected == [t[0].tolist() for t in dst.tensors]
    for bad in ({"offset": 6}, {"size": 0}, {"offset": 40, "size": 16}, {"src_batch_index": 2}):
        with pytest.raises(dd.InvalidParamError):
            cm.copy_cache(dst, src, **bad)


def test_copy_blocks_fans_one_block_out_in_every_tensor(cluster: dd.LLMDataDist) -> None:
    """{1: [3, 4]} copies block 1 into blocks 3 and 4 of all tensors at once."""
    cm = cluster.cache_manager
    cache = filled(cm, dd.CacheDesc(3, (5, 2), F32))
    cm.copy_blocks(cache, {1: [3, 4]})
    assert [[2.0, 3.0]] * 2 == cache.tensors[0][3:].tolist()
    assert [[202.0, 203.0]] * 2 == cache.tensors[2][3:].tolist()
    for bad in ({1: [5]}, {-1: [2]}, {1: [2, 2]}):
        with pytest.raises(dd.InvalidParamError):
            cm.copy_blocks(cache, bad)


def test_swap_blocks_goes_between_host_and_device_only(cluster: dd.LLMDataDist) -> None:
    """Swap out then in restores the blocks; DEVICE -> DEVICE is refused."""
    cm = cluster.cache_manager
    device = filled(cm, dd.CacheDesc(2, (6, 4), F32))
    host = cm.allocate_blocks_cache(dd.CacheDesc(2, (3, 4), F32, dd.Placement.HOST))
    cm.swap_blocks(device, host, {5: 0, 2: 1})
    assert [20.0, 21.0, 22.0, 23.0] == host.tensors[0][0].tolist()
    cm.swap_blocks(host, device, {0: 0})
    assert [120.0, 121.0, 122.0, 123.0] == device.tensors[1][0].tolist()
    other = cm.allocate_blocks_cache(dd.CacheDesc(2, (6, 4), F32))
    with pytest.raises(dd.InvalidParamError, match="DEVICE -> DEVICE"):
        cm.swap_blocks(device, other, {0: 0})
    wrong = cm.allocate_blocks_cache(dd.CacheDesc(2, (6, 5), F32, dd.Placement.HOST))
    with pytest.raises(dd.InvalidParamError, match="do not match"):
        cm.swap_blocks(device, wrong, {0: 0})


def test_wrong_role_unknown_cluster_and_bad_blocks_are_typed_errors(
        cluster: dd.LLMDataDist) -> None:
    """Each bad call raises its status code; nothing is pinned or allocated by it."""
    cm = cluster.cache_manager
    blocks = cm.allocate_blocks_cache(dd.CacheDesc(2, (4, 4), F32))
    before = cm.state
    calls = [
        (CODE.LLM_PARAM_INVALID, lambda: cm.pull_blocks(dd.BlocksCacheKey(1), blocks, [0], [1])),
        (CODE.LLM_NOT_YET_LINK, lambda: cm.push_blocks(dd.CacheKeyByIdAndIndex(7, 1), blocks,
                                                       [0], [1])),
        (CODE.LLM_PARAM_INVALID, lambda: cm.push_blocks(dd.CacheKeyByIdAndIndex(7, 1), blocks,
                                                        [0, 1], [1])),
        (CODE.LLM_PARAM_INVALID, lambda: cm.push_blocks(dd.CacheKeyByIdAndIndex(7, 1), blocks,
                                                        [-1], [1])),
        (CODE.LLM_PARAM_INVALID, lambda: cm.push_blocks(dd.CacheKeyByIdAndIndex(7, 1), blocks,
                                                        [4], [1])),
        (CODE.LLM_PARAM_INVALID, lambda: cm.push_cache(dd.CacheKeyByIdAndIndex(7, 1), blocks)),
        (CODE.LLM_PARAM_INVALID, lambda: cm.transfer_cache_async(
            blocks, object(), [dd.TransferConfig(7, 1)], [0], [1])),  # type: ignore[arg-type]
        (CODE.LLM_CLUSTER_NUM_EXCEED_LIMIT, lambda: cluster.link_clusters(
            [dd.ClusterInfo(i, "127.0.0.1", 1) for i in range(17)])),
    ]
    for code, call in calls:
        with pytest.raises(LLMError) as info:
            call()
        assert code == info.value.status_code, info.value
    assert before is cm.state


def test_bad_descs_and_options_are_param_errors() -> None:
    """Descs and options are checked at construction, with LLM_PARAM_INVALID."""
    bad = [lambda: dd.CacheDesc(0, (1,), F32), lambda: dd.CacheDesc(1, (), F32),
           lambda: dd.CacheDesc(1, (2, -1), F32), lambda: dd.CacheDesc(1, (2,), "fp16"),
           lambda: dd.CacheKey(0, 1, prefix_id=2), lambda: dd.CacheKey(0),
           lambda: dd.DataDistOptions.from_mapping({"llm.Nope": 1}),
           lambda: dd.DataDistOptions.from_mapping({"llm.SyncKvCacheWaitTime": "-5"}),
           lambda: dd.DataDistOptions.from_mapping({"llm.MemPoolConfig": "{oops"})]
    for make in bad:
        with pytest.raises(dd.InvalidParamError) as info:
            make()
        assert CODE.LLM_PARAM_INVALID == info.value.status_code


def test_unlinking_an_unknown_cluster_reports_not_yet_linked(cluster: dd.LLMDataDist) -> None:
    """unlink_clusters of a cluster never linked answers LLM_NOT_YET_LINK for it."""
    overall, codes = cluster.unlink_clusters([dd.ClusterInfo(3, "127.0.0.1", 9)])
    assert (CODE.LLM_NOT_YET_LINK, [CODE.LLM_NOT_YET_LINK]) == (overall, codes)
