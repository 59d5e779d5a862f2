"""LLM-DataDist's documented forms: init(options), LLMConfig, LLMClusterInfo, TransferConfig.

Both clusters live in this process; a push names the decoder's cache by
the addresses of its tensors, as the guide's ``transfer_cache_async``
sample does, and the decoder resolves them against its own caches.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from hostile import assert_clean, snapshot, wait_for
from peering import options
from torch_threads import one_torch_thread  # noqa: F401  (autouse)

import kvfunc.datadist as dd
from kvfunc.core import LLMError, LLMStatusCode

CODE = LLMStatusCode
BATCH = dd.CacheDesc(4, (3, 2, 8), dd.DataType.DT_FLOAT16)  # 3 entries, 2 layers of K, V
BLOCKS = dd.CacheDesc(4, (8, 2, 8), dd.DataType.DT_FLOAT16)


def test_init_is_the_documented_two_step_form() -> None:
    """LLMDataDist(role, id) does nothing until init(options); calls before are LLM_FAILED;
    init a second time is a no-op; ge.flowGraphMemMaxSize sizes the device pool."""
    cluster = dd.LLMDataDist(dd.LLMRole.DECODER, 3)
    with pytest.raises(dd.DataDistFailedError) as info:
        _ = cluster.kv_cache_manager
    assert CODE.LLM_FAILED == info.value.status_code
    with pytest.raises(dd.DataDistFailedError):
        cluster.link_clusters([dd.ClusterInfo(0, "127.0.0.1", 1)])
    assert "not initialized" in repr(cluster)
    cluster.init({"ge.flowGraphMemMaxSize": "131072", "ge.exec.deviceId": "0",
                  "llm.MemoryUtilization": "0.95", "llm.Device": "cpu"})
    cluster.init({"ge.flowGraphMemMaxSize": "1"})
    assert 131072 == cluster.cache_manager.state.pools[dd.Placement.DEVICE].size
    cluster.finalize()
    dd.LLMDataDist(dd.LLMRole.PROMPT, 4).finalize()  # never initialized: nothing to release


@pytest.mark.parametrize("bad", [
    {"ge.flowGraphMemMaxSize": "1,2"},
    {"ge.flowGraphMemMaxSize": "0"},
    {"ge.flowGraphMemMaxSize": "4096", "llm.MemPoolConfig": '{"memory_size": 4096}'},
    {"ge.exec.deviceId": "npu0"},
    {"llm.EnableCacheManager": "1"},
])
def test_bad_options_are_refused_before_anything_starts(bad: dict[str, Any]) -> None:
    """A malformed or conflicting option, or one kvfunc does not know, is LLM_PARAM_INVALID
    and leaves the cluster uninitialized."""
    cluster = dd.LLMDataDist(dd.LLMRole.DECODER, 3)
    with pytest.raises(dd.InvalidParamError):
        cluster.init(bad)
    with pytest.raises(dd.DataDistFailedError):
        _ = cluster.cache_manager


def test_llm_config_generates_checked_options() -> None:
    """LLMConfig's properties become the option strings init takes; a bad one is refused
    when the options are generated."""
    config = dd.LLMConfig()
    config.device_id = 1
    config.sync_kv_timeout = 2000
    config.listen_ip_info = "127.0.0.1:0"
    config.ge_options = {"ge.flowGraphMemMaxSize": "65536"}
    assert {"ge.exec.deviceId": "1", "llm.SyncKvCacheWaitTime": "2000",
            "llm.listenIpInfo": "127.0.0.1:0",
            "ge.flowGraphMemMaxSize": "65536"} == config.generate_options()
    config.sync_kv_timeout = "soon"
    with pytest.raises(dd.InvalidParamError):
        config.generate_options()
    config.sync_kv_timeout = None
    config.ge_options = {"ge.flowGraphMemMaxSize": 65536}  # type: ignore[dict-item]
    with pytest.raises(dd.InvalidParamError):
        config.generate_options()


def build(steps: Callable[[dd.LLMClusterInfo], None]) -> dd.LLMClusterInfo:
    """An LLMClusterInfo after ``steps``."""
    cluster = dd.LLMClusterInfo()
    steps(cluster)
    return cluster


def test_llm_cluster_info_takes_the_documented_steps_and_refuses_bad_ones() -> None:
    """remote_cluster_id and append_*_ip_info (str or LLM-DataDist's little-endian int)
    give a ClusterInfo; no id, no or two remote addresses, a bad ip or port are
    LLM_PARAM_INVALID."""
    def good(c: dd.LLMClusterInfo) -> None:
        c.remote_cluster_id = 7
        c.append_local_ip_info(0x0100007F, 0)  # 127.0.0.1 as LLM-DataDist packs it
        c.append_remote_ip_info("127.0.0.1", 26000)

    assert dd.ClusterInfo(7, "127.0.0.1", 26000) == build(good).to_cluster_info()
    assert [("127.0.0.1", 0)] == build(good).local_ip_info_list
    for steps in (lambda c: c.append_remote_ip_info("127.0.0.1", 1),
                  lambda c: setattr(c, "remote_cluster_id", 1),
                  lambda c: (good(c), c.append_remote_ip_info("127.0.0.2", 2))):
        with pytest.raises(dd.InvalidParamError):
            build(steps).to_cluster_info()
    for steps in (lambda c: c.append_remote_ip_info("not an ip", 1),
                  lambda c: c.append_remote_ip_info("127.0.0.1", 70000),
                  lambda c: setattr(c, "remote_cluster_id", -1)):
        with pytest.raises(dd.InvalidParamError):
            build(steps)


@pytest.mark.parametrize("args", [
    (1, []), (1, [0]), (1, ["0x10"]), (1, "0x10"), (1, [16], range(0, 4, 2)),
    (1, [16], range(2, 2)), (1, [16], [0, 1]), (1, -3),
])
def test_transfer_config_refuses_what_cannot_name_a_destination(args: tuple[Any, ...]
                                                                ) -> None:
    """Empty or non-int addresses, a layer range with a step or no layers, a negative
    cache id: LLM_PARAM_INVALID at construction."""
    with pytest.raises(dd.InvalidParamError):
        dd.TransferConfig(*args)


@pytest.fixture
def pair() -> Iterator[tuple[dd.LLMDataDist, dd.LLMDataDist]]:
    """A prompt cluster (0, listening) and a decoder (1) in this process, linked with an
    LLMClusterInfo."""
    prompt = dd.LLMDataDist(dd.LLMRole.PROMPT, 0)
    prompt.init(options(**{"llm.listenIpInfo": "127.0.0.1:0"}))
    decoder = dd.LLMDataDist(dd.LLMRole.DECODER, 1)
    decoder.init(options())
    cluster = dd.LLMClusterInfo()
    cluster.remote_cluster_id = 0
    cluster.append_local_ip_info("127.0.0.1", 0)
    assert prompt.listen_address is not None
    cluster.append_remote_ip_info(*prompt.listen_address)
    try:
        assert (CODE.LLM_SUCCESS, [CODE.LLM_SUCCESS]) == decoder.link_clusters([cluster])
        assert wait_for(lambda: 1 in prompt.linked_clusters())
        yield prompt, decoder
    finally:
        decoder.unlink_clusters([cluster], force=True)
        decoder.finalize()
        prompt.finalize()


class Computed:
    """A layer synchronizer whose every layer is computed already."""

    def __init__(self) -> None:
        self.asked: list[int] = []
        self.lock = threading.Lock()

    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        with self.lock:
            self.asked.append(layer_index)
        return True


def filled(cm: dd.CacheManager, desc: dd.CacheDesc, blocks: bool) -> dd.Cache:
    """A cache with distinct non-zero values everywhere."""
    cache = cm.allocate_blocks_cache(desc) if blocks else cm.allocate_cache(desc)
    for i, t in enumerate(cache.tensors):
        t.copy_(torch.arange(1, t.numel() + 1).view(t.shape) + 100 * i)
    return cache


def zeros(cm: dd.CacheManager, desc: dd.CacheDesc, blocks: bool) -> dd.Cache:
    """A zero-filled cache."""
    cache = cm.allocate_blocks_cache(desc) if blocks else cm.allocate_cache(desc)
    for t in cache.tensors:
        t.zero_()
    return cache


def test_a_push_by_address_sends_a_layer_range_of_one_entry_into_the_named_entry(
        pair: tuple[dd.LLMDataDist, dd.LLMDataDist]) -> None:
    """Layer 1 (tensors 2, 3) of source entry 2 goes to the decoder tensors whose
    addresses, moved by one entry, name entry 1; only layer 1 is waited for; nothing
    else is written and nothing stays pinned."""
    prompt, decoder = pair
    src = filled(prompt.cache_manager, BATCH, blocks=False)
    dst = zeros(decoder.cache_manager, BATCH, blocks=False)
    before = snapshot(decoder.cache_manager, dst)
    addrs = [a + BATCH.row_nbytes for a in dst.per_device_tensor_addrs[0][2:]]
    layers = Computed()
    config = dd.TransferConfig(1, addrs, range(1, 2), src_batch_index=2)
    prompt.cache_manager.transfer_cache_async(src, layers, [config]).synchronize(10_000)
    assert [1] == layers.asked
    assert all(torch.equal(src.tensors[i][2], dst.tensors[i][1]) for i in (2, 3))
    assert_clean(decoder.cache_manager, dst, before, offered=[1])
    assert 0 == int(dst.tensors[0].count_nonzero()) + int(dst.tensors[1].count_nonzero())


def test_a_push_by_address_into_a_blocks_cache(
        pair: tuple[dd.LLMDataDist, dd.LLMDataDist]) -> None:
    """The guide's blocks form: every tensor's address, src_blocks [0, 1] into
    dst_blocks [2, 3]."""
    prompt, decoder = pair
    src = filled(prompt.cache_manager, BLOCKS, blocks=True)
    dst = zeros(decoder.cache_manager, BLOCKS, blocks=True)
    before = snapshot(decoder.cache_manager, dst)
    config = dd.TransferConfig(1, dst.per_device_tensor_addrs[0])
    prompt.cache_manager.transfer_cache_async(src, Computed(), [config], [0, 1],
                                              [2, 3]).synchronize(10_000)
    assert all(torch.equal(s[[0, 1]], d[[2, 3]])
               for s, d in zip(src.tensors, dst.tensors, strict=True))
    assert_clean(decoder.cache_manager, dst, before, offered=[2, 3])


@pytest.mark.parametrize("name", ["unknown", "two caches", "mid-row", "a block", "twice"])
def test_addresses_that_name_no_single_cache_are_refused_by_the_decoder(
        pair: tuple[dd.LLMDataDist, dd.LLMDataDist], name: str) -> None:
    """Addresses outside every cache, spanning two caches, inside a row, naming block 1
    of a blocks cache, or naming a tensor twice: the push fails LLM_PARAM_INVALID (the
    decoder's answer), nothing is written or pinned, the link stays usable."""
    prompt, decoder = pair
    src = filled(prompt.cache_manager, BLOCKS, blocks=True)
    dst = zeros(decoder.cache_manager, BLOCKS, blocks=True)
    other = zeros(decoder.cache_manager, BLOCKS, blocks=True)
    before = snapshot(decoder.cache_manager, dst)
    a, b = dst.per_device_tensor_addrs[0], other.per_device_tensor_addrs[0]
    addrs = {"unknown": [1 << 40, 2 << 40, 3 << 40, 4 << 40], "two caches": a[:2] + b[2:],
             "mid-row": [a[0] + 2, *a[1:]], "a block": [x + BLOCKS.row_nbytes for x in a],
             "twice": [a[0], a[0], a[2], a[3]]}[name]
    task = prompt.cache_manager.transfer_cache_async(
        src, Computed(), [dd.TransferConfig(1, addrs)], [0, 1], [2, 3])
    with pytest.raises(LLMError) as info:
        task.synchronize(10_000)
    assert CODE.LLM_PARAM_INVALID == info.value.status_code, info.value
    assert str(info.value).startswith("LLM_PARAM_INVALID: peer: "), info.value
    assert_clean(decoder.cache_manager, dst, before)
    assert decoder._links[0].broken is None
    config = dd.TransferConfig(1, a)
    prompt.cache_manager.transfer_cache_async(src, Computed(), [config], [0, 1],
                                              [2, 3]).synchronize(10_000)
    assert torch.equal(src.tensors[3][[0, 1]], dst.tensors[3][[2, 3]])


def test_configs_the_prompt_side_can_check_are_refused_before_anything_is_sent(
        pair: tuple[dd.LLMDataDist, dd.LLMDataDist]) -> None:
    """Addresses that do not count the tensors sent, a layer range past the cache, a
    batch index on a blocks cache: LLM_PARAM_INVALID from transfer_cache_async itself."""
    prompt, decoder = pair
    src = filled(prompt.cache_manager, BLOCKS, blocks=True)
    addrs = zeros(decoder.cache_manager, BLOCKS, blocks=True).per_device_tensor_addrs[0]
    for config in (dd.TransferConfig(1, addrs[:3]), dd.TransferConfig(1, addrs[:2], range(2, 3)),
                   dd.TransferConfig(1, addrs, src_batch_index=1)):
        with pytest.raises(dd.InvalidParamError):
            prompt.cache_manager.transfer_cache_async(src, Computed(), [config], [0], [1])
    assert 0 == sum(r.pins for r in prompt.cache_manager.state.caches.values())
