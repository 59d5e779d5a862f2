"""Sizing (spec §5.4, §5.5), its seed-compatible wrappers and the device memory query."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace as NS

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kvfunc.compat._sizing as compat
import kvfunc.shell._memory as memory
from kvfunc.core._cache_info import CacheEntry, LayerCacheInfo, MambaCacheEntry, ModelCacheInfo
from kvfunc.core._errors import (
    InsufficientMemoryError,
    InvalidArgumentError,
    InvalidCacheInfo,
    InvalidTypeError,
    NotSupportedError,
)
from kvfunc.core._sizing import (
    SizingConfig,
    calculate_block_num,
    calculate_block_num_lazy,
    calculate_fixed_block_memory_bytes,
)

GIB = 2**30


def config(**changes: object) -> SizingConfig:
    fields: dict[str, object] = {"batch_size_per_dp_rank": 4, "mem_fraction_static": 0.9,
                                 "max_prefill_tokens": 1000}
    fields.update(changes)
    return SizingConfig(**fields)  # type: ignore[arg-type]


def full(name: str = "kv", **changes: object) -> CacheEntry:
    """A FullAttention entry of 1024 bytes per token (512 bf16 values, one head)."""
    fields: dict[str, object] = {"cache_name": name, "attn_type": "FullAttention", "dim": 512,
                                 "num_head": 1, "dtype": "bfloat16", "needs_block": True,
                                 "block_size": 128}
    fields.update(changes)
    return CacheEntry(**fields)  # type: ignore[arg-type]


def swa(name: str = "w", **changes: object) -> CacheEntry:
    """A SlidingWindow entry: window 128, block 16, 256 bytes per token."""
    fields: dict[str, object] = {"attn_type": "SlidingWindow", "dim": 64, "num_head": 2,
                                 "dtype": "float16", "block_size": 16, "sliding_window": 128}
    fields.update(changes)
    return full(name, **fields)


def model(*layers: list[CacheEntry]) -> ModelCacheInfo:
    return ModelCacheInfo(len(layers),
                          [LayerCacheInfo(i, caches) for i, caches in enumerate(layers)])


def online(info: ModelCacheInfo, free: int, total: int, **kw: object) -> dict[str, int]:
    cfg = kw.pop("cfg", config())
    return calculate_block_num(cfg, info, free_memory_bytes=free,  # type: ignore[arg-type]
                               total_memory_bytes=total, **kw)  # type: ignore[arg-type]


def error_of(exc: type[Exception], fn: object, *args: object, **kwargs: object) -> str:
    with pytest.raises(exc) as raised:
        fn(*args, **kwargs)  # type: ignore[operator]
    return str(raised.value)


# --- SizingConfig -------------------------------------------------------------------------

def test_from_infer_config_reads_nested_attributes() -> None:
    """from_infer_config reads the seed's scheduler, model and parallel settings."""
    cfg = NS(scheduler_config=NS(batch_size_per_dp_rank=8, mem_fraction_static=0.8,
                                 max_prefill_tokens=2048),
             model_config=NS(next_n=2), parallel_config=NS(offline_prefill_dp_group_size=4))
    expected = SizingConfig(8, 0.8, 2048, next_n=2, offline_prefill_dp_group_size=4)
    assert expected == SizingConfig.from_infer_config(cfg)


def test_from_infer_config_defaults_and_missing_settings() -> None:
    """next_n and the DP group size default when absent; scheduler settings are required."""
    sched = NS(batch_size_per_dp_rank=8, mem_fraction_static=0.8, max_prefill_tokens=2048)
    expected = SizingConfig(8, 0.8, 2048)
    assert expected == SizingConfig.from_infer_config(NS(scheduler_config=sched))
    message = error_of(InvalidArgumentError, SizingConfig.from_infer_config,
                       NS(scheduler_config=NS(batch_size_per_dp_rank=8)))
    assert message.startswith("infer_config has no scheduler_config.mem_fraction_static")


@pytest.mark.parametrize(("changes", "exc", "message"), [
    ({"batch_size_per_dp_rank": 0}, InvalidArgumentError,
     "SizingConfig batch_size_per_dp_rank must be >= 1, but got 0"),
    ({"batch_size_per_dp_rank": 2.0}, InvalidTypeError,
     "SizingConfig batch_size_per_dp_rank must be an int, but got 2.0"),
    ({"next_n": -1}, InvalidArgumentError, "SizingConfig next_n must be >= 0, but got -1"),
    ({"max_prefill_tokens": True}, InvalidTypeError,
     "SizingConfig max_prefill_tokens must be an int, but got True"),
    ({"mem_fraction_static": 1.5}, InvalidArgumentError,
     "SizingConfig mem_fraction_static must lie in [0, 1], but got 1.5"),
    ({"mem_fraction_static": "0.9"}, InvalidTypeError,
     "SizingConfig mem_fraction_static must be a number, but got '0.9'"),
])
def test_config_rejects_bad_values(changes: dict[str, object], exc: type[Exception],
                                   message: str) -> None:
    """Bad settings raise a typed error that shows the value."""
    assert message == error_of(exc, config, **changes)


# --- fixed-block sizing (§5.4) ------------------------------------------------------------

def test_sliding_window_blocks_with_mtp_and_bytes_of_every_layer() -> None:
    """SWA: batch*(ceil((W+2*next_n)/bs)+1)+1 blocks; bytes per layer at full block_size."""
    info = model([swa()], [swa(compress_ratio=2)])  # compression is ignored here
    # per request (2*2 + 128 + 15) // 16 = 9; 4 * (9 + 1) + 1 = 41; 41*16*2*64*2 bytes a layer
    expected = ({"SlidingWindow": 41}, 2 * 167936)
    assert expected == calculate_fixed_block_memory_bytes(config(next_n=2), info)


def test_mamba_blocks_use_the_entry_next_n() -> None:
    """Mamba: batch*(1+entry.next_n)+1 blocks of prod(shape)*itemsize bytes."""
    m = MambaCacheEntry(cache_name="ssm", dtype="float32", needs_block=True, shape=[4, 8],
                        next_n=3)
    expected = ({"Mamba": 17}, 17 * 32 * 4)
    assert expected == calculate_fixed_block_memory_bytes(config(next_n=5), model([m]))


def test_fixed_non_hbm_and_blockless_entries() -> None:
    """Swapped-memory entries count blocks but no bytes; needs_block=False entries nothing."""
    info = model([swa(allocator="swapped_memory"), swa("x", needs_block=False, sliding_window=1)])
    expected = ({"SlidingWindow": 37}, 0)
    assert expected == calculate_fixed_block_memory_bytes(config(), info)


def test_fixed_group_block_num_conflict() -> None:
    """Entries of one fixed group that need different block counts raise the seed's message."""
    info = model([swa()], [swa(sliding_window=144)])
    expected = ("Fixed-block caches sharing manager_key=SlidingWindow must require the same "
                "block_num, but got 37 and 41.")
    assert expected == error_of(InvalidCacheInfo, calculate_fixed_block_memory_bytes,
                                config(), info)


def test_sliding_window_without_window() -> None:
    """A sliding-window entry without sliding_window raises instead of crashing."""
    message = error_of(InvalidCacheInfo, calculate_fixed_block_memory_bytes, config(),
                       model([swa(sliding_window=None)]))
    assert message.endswith("must define a non-negative int sliding_window, but got None.")


# --- paged sizing, offline (§5.5) ---------------------------------------------------------

def test_offline_formula() -> None:
    """Offline: ceil(L/bs)*batch+1 blocks per paged group."""
    expected = {"FullAttention": 8 * 4 + 1}
    assert expected == online(model([full()], [full()]), GIB, GIB, offline_max_len=1000)


def test_offline_dp_partition_applies_to_full_attention_only() -> None:
    """With offline_prefill_dp_group_size > 1, only FullAttention divides the batch."""
    indexer = full("idx", attn_type="Indexer", needs_block=False, block_size=64)
    got = online(model([full(), indexer]), GIB, GIB, offline_max_len=1000,
                 cfg=config(batch_size_per_dp_rank=8, offline_prefill_dp_group_size=3))
    expected = {"FullAttention": 8 * (8 // 3) + 1, "Indexer": 16 * 8 + 1}
    assert expected == got


def test_offline_free_memory_check() -> None:
    """Offline needs paged + fixed + extra <= free, else the seed's MemoryError."""
    info = model([full(), swa()])
    _, fixed = calculate_fixed_block_memory_bytes(config(), info)
    need = 33 * 128 * 1024 + fixed + 5
    expected = {"SlidingWindow": 37, "FullAttention": 33}
    assert expected == online(info, need, GIB, offline_max_len=1000,
                              extra_reserved_memory_bytes=5)
    expected_message = (f"Insufficient memory for offline mode cache allocation. "
                        f"required={need}, free={need - 1}, extra_reserved=5. Please reduce the "
                        "length of requests or the total batch size.")
    assert expected_message == error_of(
        InsufficientMemoryError, online, info, need - 1, GIB, offline_max_len=1000,
        extra_reserved_memory_bytes=5)


def test_offline_max_len_zero_means_online() -> None:
    """offline_max_len=0 falls through to the online budget."""
    info = model([full()])
    assert online(info, GIB, GIB) == online(info, GIB, GIB, offline_max_len=0)


# --- paged sizing, online (§5.5) ----------------------------------------------------------

def test_online_formula() -> None:
    """Online: (total*frac - used - fixed - extra) // per_token_bytes tokens, // bs blocks."""
    # 2**30 * 0.9 - 2**28 = 697932185.6 bytes; 2048 bytes a token -> 340787 tokens
    expected = {"FullAttention": 340787 // 128}
    assert expected == online(model([full()], [full()]), GIB - 2**28, GIB)


def test_online_null_block_comes_out_of_the_budget() -> None:
    """1280 tokens of budget give 10 blocks (no +1), so 1152 tokens fit, 1151 prefill max."""
    info, budget = model([full()]), 1280 * 1024
    expected = {"FullAttention": 10}
    assert expected == online(info, budget, budget, cfg=config(mem_fraction_static=1,
                                                               max_prefill_tokens=1151))
    expected_message = ("Current memory cannot satisfy max input length requirement. "
                        "supported max tokens=1152, required max tokens=1152, "
                        "fixed_block_memory_gb=0.00, extra_reserved_memory_gb=0.00")
    assert expected_message == error_of(
        InsufficientMemoryError, online, info, budget, budget,
        cfg=config(mem_fraction_static=1, max_prefill_tokens=1152))


def test_online_first_pass_counts_blockless_entries_and_hbm_only() -> None:
    """needs_block=False paged entries count in per-token bytes; swapped ones do not."""
    budget = 2560 * 1024
    info = model([full(), full("idx", needs_block=False), full("v", allocator="swapped_memory")])
    expected = {"FullAttention": 2560 // 2 // 128}
    assert expected == online(info, budget, budget, cfg=config(mem_fraction_static=1,
                                                               max_prefill_tokens=0))


def test_online_compress_ratio_floor_divides_token_bytes() -> None:
    """Token bytes are numel*heads*itemsize // compress_ratio (3 // 2 = 1 byte)."""
    info = model([full(dim=3, dtype="int8", block_size=16, compress_ratio=2)])
    expected = {"FullAttention": 1000 // 16}
    assert expected == online(info, 1000, 1000, cfg=config(mem_fraction_static=1,
                                                           max_prefill_tokens=0))


def test_online_groups_with_different_block_sizes() -> None:
    """Each paged group gets max_tokens // its block_size; capacity is the smallest."""
    info = model([full(), full("idx", manager_key="idx", block_size=64)])
    budget = 1280 * 2048
    expected = {"FullAttention": 10, "idx": 20}
    assert expected == online(info, budget, budget, cfg=config(mem_fraction_static=1,
                                                               max_prefill_tokens=1151))


def test_online_no_memory_left() -> None:
    """A budget that is spent before paged caches raises the seed's message."""
    expected = ("No available memory for paged attention after fixed-block cache reservation. "
                "used=268435456, fixed_block=0, extra_reserved=0, total=1073741824, "
                "mem_fraction_static=0.2, Please boost mem_fraction_static in yaml.")
    assert expected == error_of(InsufficientMemoryError, online, model([full()]),
                                GIB - 2**28, GIB, cfg=config(mem_fraction_static=0.2))


def test_online_no_hbm_paged_entry() -> None:
    """With every paged entry in swapped memory, online sizing is impossible."""
    expected = ("No HBM-backed paged-attention cache entry remains for dynamic block sizing. "
                "Please use offline mode or keep at least one paged cache entry in HBM.")
    assert expected == error_of(InsufficientMemoryError, online,
                                model([full(allocator="swapped_memory")]), GIB, GIB)


def test_online_reports_fixed_and_extra_in_gib() -> None:
    """The capacity error shows fixed and extra reservations in GiB."""
    info = model([full(), swa()])
    message = error_of(InsufficientMemoryError, online, info, GIB, GIB,
                       extra_reserved_memory_bytes=GIB // 2,
                       cfg=config(max_prefill_tokens=10**9))
    assert message.endswith("fixed_block_memory_gb=0.00, extra_reserved_memory_gb=0.50")


def test_min_across_ranks_lowers_capacity() -> None:
    """min_across_ranks replaces the local token capacity (the TP all-reduce MIN)."""
    seen: list[int] = []

    def smallest(local: int) -> int:
        seen.append(local)
        return 1280

    expected = ({"FullAttention": 10}, [GIB // 1024])
    got = online(model([full()]), GIB, GIB, cfg=config(mem_fraction_static=1),
                 min_across_ranks=smallest)
    assert expected == (got, seen)
    message = error_of(InvalidArgumentError, online, model([full()]), GIB, GIB,
                       min_across_ranks=lambda local: local + 1)
    assert message.startswith("min_across_ranks(")


def test_block_size_mismatch_in_a_paged_group() -> None:
    """Entries of one paged group must share block_size (checked on every entry)."""
    info = model([full()], [full(needs_block=False, block_size=64)])
    expected = ("Caches sharing one paged attention manager must share block_size. "
                "manager_key=FullAttention, attn_type=FullAttention, block_sizes=[64, 128]")
    assert expected == error_of(InvalidCacheInfo, online, info, GIB, GIB)


@pytest.mark.parametrize(("kwargs", "exc", "fragment"), [
    ({"free": -1}, InvalidArgumentError, "free_memory_bytes must be >= 0, but got -1"),
    ({"free": 1.0}, InvalidTypeError, "free_memory_bytes must be an int, but got 1.0"),
    ({"free": GIB + 1}, InvalidArgumentError, "exceeds total_memory_bytes"),
    ({"offline_max_len": -5}, InvalidArgumentError, "offline_max_len must be >= 0"),
    ({"extra_reserved_memory_bytes": -1}, InvalidArgumentError,
     "extra_reserved_memory_bytes must be >= 0"),
])
def test_bad_arguments(kwargs: dict[str, object], exc: type[Exception], fragment: str) -> None:
    """Bad memory figures and options raise typed errors."""
    free = kwargs.pop("free", GIB)
    assert fragment in error_of(exc, online, model([full()]), free, GIB, **kwargs)


def test_result_lists_fixed_keys_first() -> None:
    """Fixed-block keys come first, then paged keys in order of first appearance."""
    info = model([full("a", manager_key="z"), swa(), full("b", manager_key="a", block_size=64)])
    expected = ["SlidingWindow", "z", "a"]
    assert expected == list(online(info, GIB, GIB))


def test_lazy_reads_memory_once_and_only_when_needed() -> None:
    """read_memory runs once per sizing with paged groups, never without or after an error."""
    calls: list[int] = []

    def read() -> tuple[int, int]:
        calls.append(1)
        return GIB, GIB

    lazy = calculate_block_num_lazy
    lazy(config(), model([full()]), read_memory=read)
    lazy(config(), model([full()]), read_memory=read, offline_max_len=100)
    expected_fixed = {"SlidingWindow": 37}
    assert expected_fixed == lazy(config(), model([swa()]), read_memory=read)
    with pytest.raises(InvalidCacheInfo):
        lazy(config(), model([swa(), full()], [swa(sliding_window=1), full()]), read_memory=read)
    expected = [1, 1]
    assert expected == calls


entries = st.builds(
    lambda dim, head, dtype, bs, hbm: full(dim=dim, num_head=head, dtype=dtype, block_size=bs,
                                           manager_key=f"g{bs}",
                                           allocator="hbm" if hbm else "swapped_memory"),
    st.integers(1, 1024), st.integers(1, 16), st.sampled_from(["int8", "bfloat16", "float32"]),
    st.sampled_from([16, 64, 128]), st.booleans())


@given(st.lists(entries, min_size=1, max_size=4), st.integers(2**20, 2**36),
       st.floats(0, 1), st.floats(0.05, 1), st.integers(0, 4096), st.integers(0, 2**20))
def test_online_never_exceeds_the_budget(caches: list[CacheEntry], total: int, used_share: float,
                                         fraction: float, prefill: int, extra: int) -> None:
    """Paged blocks + fixed + extra fit in total*frac - used; capacity covers the prefill."""
    used = int(total * used_share)
    cfg = config(mem_fraction_static=fraction, max_prefill_tokens=prefill)
    try:
        got = online(model(caches), total - used, total, cfg=cfg,
                     extra_reserved_memory_bytes=extra)
    except InsufficientMemoryError:
        return
    block_bytes: dict[str, int] = {}
    for c in caches:
        if c.allocator == "hbm":
            key, bs = c.group_key, c.block_size or 0
            block_bytes[key] = block_bytes.get(key, 0) + bs * c.cache_dim_numel() * c.num_head * {
                "int8": 1, "bfloat16": 2, "float32": 4}[c.dtype]  # type: ignore[operator]
    paged = sum(n * block_bytes.get(key, 0) for key, n in got.items())
    assert paged + extra <= total * fraction - used
    assert min((n - 1) * int(key[1:]) for key, n in got.items()) - 1 >= prefill


@given(st.integers(0, GIB), st.integers(0, GIB))
def test_online_is_monotone_in_free_memory(free_a: int, free_b: int) -> None:
    """More free memory never gives fewer blocks."""
    low, high = sorted((free_a, free_b))
    cfg = config(max_prefill_tokens=0, mem_fraction_static=1)
    try:
        small = online(model([full()]), low, GIB, cfg=cfg)
    except InsufficientMemoryError:
        return
    assert small["FullAttention"] <= online(model([full()]), high, GIB, cfg=cfg)["FullAttention"]


# --- seed-compatible wrappers -------------------------------------------------------------

def infer_config(**scheduler: object) -> NS:
    settings: dict[str, object] = {"batch_size_per_dp_rank": 4, "mem_fraction_static": 0.9,
                                   "max_prefill_tokens": 1000}
    settings.update(scheduler)
    return NS(scheduler_config=NS(**settings), model_config=NS(next_n=0))


def test_compat_signatures_match_the_seed() -> None:
    """The wrappers keep the seed's parameter names and defaults."""
    expected = ["infer_config", "cache_info", "offline_max_len=None", "tp_group=None",
                "extra_reserved_memory_bytes=0"]
    params = inspect.signature(compat.calculate_block_num).parameters.values()
    assert expected == [str(p).split(":")[0] + (f"={p.default}" if p.default is not p.empty
                                                 else "") for p in params]
    expected_fixed = ["infer_config", "cache_info"]
    assert expected_fixed == list(inspect.signature(
        compat.calculate_fixed_block_memory_bytes).parameters)


def test_compat_reads_device_memory_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The wrapper queries the device once and sizes from that reading."""
    calls: list[int] = []

    def fake() -> tuple[int, int]:
        calls.append(1)
        return GIB - 2**28, GIB

    monkeypatch.setattr(compat, "device_memory_info", fake)
    info = model([full()], [full()])
    expected = (online(info, GIB - 2**28, GIB), [1])
    assert expected == (compat.calculate_block_num(infer_config(), info, tp_group=object()),
                        calls)


def test_compat_no_paged_keys_no_device_query(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without paged caches the device is never queried."""
    def fail() -> tuple[int, int]:
        raise AssertionError("device queried")

    monkeypatch.setattr(compat, "device_memory_info", fail)
    expected = {"SlidingWindow": 37}
    assert expected == compat.calculate_block_num(infer_config(), model([swa()]))


def test_compat_fixed_reads_only_batch_and_next_n() -> None:
    """The fixed-block wrapper needs only the settings the seed reads."""
    cfg = NS(scheduler_config=NS(batch_size_per_dp_rank=4), model_config=NS(next_n=2))
    expected = ({"SlidingWindow": 41}, 167936)
    assert expected == compat.calculate_fixed_block_memory_bytes(cfg, model([swa()]))


_RANK_SCRIPT = """
import json, sys
import torch.distributed as dist
rank, free, store = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2)
import kvfunc.compat._sizing as compat
from types import SimpleNamespace as NS
from kvfunc.core._cache_info import CacheEntry, LayerCacheInfo, ModelCacheInfo
compat.device_memory_info = lambda: (free, 2**30)
entry = CacheEntry("kv", "FullAttention", 512, 1, "bfloat16", True, block_size=128)
cfg = NS(scheduler_config=NS(batch_size_per_dp_rank=4, mem_fraction_static=0.9,
                             max_prefill_tokens=1000))
info = ModelCacheInfo(1, [LayerCacheInfo(0, [entry])])
print(json.dumps(compat.calculate_block_num(cfg, info, tp_group=dist.group.WORLD)))
dist.destroy_process_group()
"""


def test_compat_all_reduce_min_over_two_ranks(tmp_path: Path) -> None:
    """Two gloo ranks with different free memory both size from the smaller reading."""
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": root, "PYTHONWARNINGS": "ignore"}
    frees = [GIB - 2**29, GIB - 2**28]
    ranks = [subprocess.Popen([sys.executable, "-c", _RANK_SCRIPT, str(rank), str(free),
                               str(tmp_path / "store")], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for rank, free in enumerate(frees)]
    outputs = [p.communicate(timeout=120) for p in ranks]
    assert [0, 0] == [p.returncode for p in ranks], outputs
    smallest = online(model([full()]), min(frees), GIB)
    expected = [smallest, smallest]
    assert expected == [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]


def test_dtype_itemsize_of_torch_dtypes() -> None:
    """torch dtypes are sized by their itemsize attribute, without a table lookup."""
    expected = [2, 2, 4, 1, 8]
    assert expected == [compat.dtype_itemsize(d) for d in (
        torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.int64)]


# --- device memory query --------------------------------------------------------------------

def test_host_memory_from_meminfo(tmp_path: Path) -> None:
    """Host memory is MemAvailable and MemTotal from /proc/meminfo, in bytes."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  1000 kB\nMemFree:  100 kB\nMemAvailable:  400 kB\n")
    expected = (400 * 1024, 1000 * 1024)
    assert expected == memory.host_memory_info(str(meminfo))


def test_host_memory_falls_back_to_sysconf(monkeypatch: pytest.MonkeyPatch,
                                           tmp_path: Path) -> None:
    """Without /proc/meminfo, host memory comes from os.sysconf page counts."""
    pages = {"SC_PAGE_SIZE": 4096, "SC_AVPHYS_PAGES": 10, "SC_PHYS_PAGES": 30}
    monkeypatch.setattr(memory.os, "sysconf", pages.__getitem__)
    expected = (40960, 122880)
    assert expected == memory.host_memory_info(str(tmp_path / "absent"))


def test_device_memory_prefers_torch_npu(monkeypatch: pytest.MonkeyPatch) -> None:
    """With torch.npu present (torch_npu imported), its mem_get_info answers."""
    asked: list[object] = []

    def mem_get_info(*device: object) -> tuple[int, int]:
        asked.append(device)
        return 3, 8

    monkeypatch.setattr(torch, "npu", NS(mem_get_info=mem_get_info), raising=False)
    expected = ((3, 8), (3, 8), [(), ("npu:1",)])
    assert expected == (memory.device_memory_info(), memory.device_memory_info("npu:1"), asked)


def test_device_memory_cuda_then_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without torch.npu: CUDA when available, else the host."""
    monkeypatch.delattr(torch, "npu", raising=False)
    monkeypatch.setattr(memory, "host_memory_info", lambda: (1, 2))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    host = memory.device_memory_info()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *device: (5, 6))
    expected = ((1, 2), (5, 6), (1, 2))
    assert expected == (host, memory.device_memory_info(), memory.device_memory_info("cpu"))


def test_device_memory_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    """An NPU without torch.npu, an unknown kind and a non-device raise typed errors."""
    monkeypatch.delattr(torch, "npu", raising=False)
    assert "torch.npu is absent" in error_of(NotSupportedError, memory.device_memory_info, "npu")
    assert "no memory query" in error_of(NotSupportedError, memory.device_memory_info, "xpu:0")
    assert "but got 3" in error_of(InvalidTypeError, memory.device_memory_info, 3)
