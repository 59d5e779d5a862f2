"""Presets, custom model files and the plan they give (``kvfunc.cli._presets``, ``_plan``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvfunc.cli import (
    Budget,
    CLIError,
    PlanConfig,
    build_preset,
    load_model_file,
    plan_model,
    preset_names,
)
from kvfunc.core import (
    SizingConfig,
    calculate_block_num,
    calculate_fixed_block_memory_bytes,
    dtype_itemsize,
)

GIB = 2**30


def token_bytes(name: str, **options: object) -> dict[str, int]:
    """Bytes one token takes per manager key (Mamba: one state) over all layers."""
    info = build_preset(name, **options).cache_info  # type: ignore[arg-type]
    out: dict[str, int] = {}
    for _, cache in info.iter_caches():
        if cache.attn_type == "Mamba":
            size = cache.cache_dim_numel() * dtype_itemsize(cache.dtype)
        else:
            size = cache.cache_dim_numel() * (cache.num_head or 0) * dtype_itemsize(cache.dtype)
        out[cache.group_key] = out.get(cache.group_key, 0) + size
    return out


def test_llama_3_8b_takes_128_kib_per_token() -> None:
    """32 layers x K and V x 8 heads x 128 dims x 2 bytes = 128 KiB a token."""
    assert {"FullAttention": 32 * 2 * 8 * 128 * 2} == token_bytes("llama-3-8b")


def test_deepseek_v3_caches_latent_and_rope_in_62_layers() -> None:
    """MLA: (512 + 64) x 2 bytes per layer, 61 layers plus the MTP layer."""
    preset = build_preset("deepseek-v3")
    names = [c.cache_name for c in preset.cache_info.layer_infos[0].caches]
    expected = (["kv_latent", "k_rope"], True, 62, {"FullAttention": 62 * 576 * 2})
    assert expected == (names, preset.cache_info.is_mla_backend, preset.cache_info.num_layers,
                        token_bytes("deepseek-v3"))


def test_deepseek_v3_without_mtp_has_61_layers() -> None:
    """--mtp 0 drops the MTP layer."""
    assert 61 == build_preset("deepseek-v3", next_n=0).cache_info.num_layers


def test_gpt_oss_alternates_window_128_and_full_layers() -> None:
    """Even layers slide over 128 tokens, odd layers attend to everything."""
    info = build_preset("gpt-oss-120b").cache_info
    kinds = [(layer.caches[0].attn_type, layer.caches[0].sliding_window)
             for layer in info.layer_infos[:4]]
    expected = [("SlidingWindow", 128), ("FullAttention", None)] * 2
    assert (expected, 36) == (kinds, info.num_layers)


def test_qwen3_next_has_36_state_layers_and_12_full_layers() -> None:
    """Every fourth layer is full attention; the others keep a conv and a recurrent state."""
    info = build_preset("qwen3-next-80b", next_n=0).cache_info
    kinds = [layer.caches[0].attn_type for layer in info.layer_infos]
    state = 3 * 8192 * 2 + 32 * 128 * 128 * 4
    expected = (36, 12, {"Mamba": 36 * state, "FullAttention": 12 * 2 * 2 * 256 * 2})
    assert expected == (kinds.count("Mamba"), kinds.count("FullAttention"),
                        token_bytes("qwen3-next-80b", next_n=0))


@pytest.mark.parametrize("name", preset_names())
def test_plan_block_counts_are_calculate_block_num(name: str) -> None:
    """The plan's blocks per key are exactly what calculate_block_num gives."""
    preset = build_preset(name)
    report = plan_model(preset, PlanConfig(Budget(80 * GIB, 0.9, used_bytes=8 * GIB)))
    expected = calculate_block_num(SizingConfig(64, 0.9, 8192, next_n=preset.next_n),
                                   preset.cache_info, free_memory_bytes=72 * GIB,
                                   total_memory_bytes=80 * GIB)
    assert expected == {g.manager_key: g.num_blocks for g in report.groups}


@pytest.mark.parametrize("name", ["gpt-oss-120b", "qwen3-next-80b"])
def test_plan_fixed_bytes_match_core_sizing(name: str) -> None:
    """Bytes of the fixed-block groups add up to calculate_fixed_block_memory_bytes."""
    preset = build_preset(name)
    report = plan_model(preset, PlanConfig(Budget(80 * GIB)))
    _, expected = calculate_fixed_block_memory_bytes(SizingConfig(64, 0.9, 8192,
                                                                  next_n=preset.next_n),
                                                     preset.cache_info)
    assert expected == sum(g.bytes for g in report.groups if g.sizing == "fixed")


def test_plan_fits_in_the_budget() -> None:
    """Online, the caches take no more than memory x fraction - used."""
    report = plan_model(build_preset("qwen3-next-80b"),
                        PlanConfig(Budget(80 * GIB, 0.85, used_bytes=40 * GIB)))
    assert (True, True) == (report.total_bytes <= 80 * GIB * 0.85 - 40 * GIB,
                            report.total_bytes > 0.99 * (80 * GIB * 0.85 - 40 * GIB))


def test_plan_concurrency_column() -> None:
    """Llama-3-8B on 64 GiB x 0.9: 29,491 blocks of 16, 57 requests of 8,192 tokens."""
    report = plan_model(build_preset("llama-3-8b"), PlanConfig(Budget(64 * GIB)))
    (row,) = report.groups
    assert (29491, 471840, 512, 57) == (row.num_blocks, row.tokens, row.blocks_per_request,
                                        row.max_concurrency)


def test_sliding_window_request_holds_window_blocks() -> None:
    """A long request holds ceil(128 / 16) + 1 window blocks, not its whole length."""
    report = plan_model(build_preset("gpt-oss-120b"), PlanConfig(Budget(80 * GIB)))
    assert [9, 512] == [g.blocks_per_request for g in report.groups]


def test_overrides_change_block_size_and_dtype() -> None:
    """--block-size and --kv-dtype reach every attention cache."""
    caches = [c for _, c in build_preset("llama-3-8b", block_size=32,
                                         kv_dtype="fp8").cache_info.iter_caches()]
    assert {(32, "fp8")} == {(c.block_size, c.dtype) for c in caches}


@pytest.mark.parametrize(("options", "needle"), [
    ({"next_n": 1}, "has no multi-token-prediction layers"),
    ({"block_size": 0}, "--block-size must be an integer from 1 to 16,777,216, got 0"),
    ({"next_n": 17}, "--mtp must be an integer from 0 to 16, got 17"),
    ({"kv_dtype": "float128"}, "--kv-dtype 'float128' is not a dtype"),
])
def test_bad_preset_options_are_cli_errors(options: dict[str, object], needle: str) -> None:
    """Options a preset cannot take raise one clear CLIError."""
    with pytest.raises(CLIError) as info:
        build_preset("llama-3-8b", **options)  # type: ignore[arg-type]
    assert needle in str(info.value)


TOML = """
name = "toy"
max_model_len = 2048
sources = ["https://example.org/toy"]

[[layers]]
repeat = 3
caches = [
  { name = "k", dim = 64, num_head = 2, dtype = "fp16", block_size = 16 },
  { name = "v", dim = 64, num_head = 2, dtype = "fp16", block_size = 16 },
]

[[layers]]
[[layers.caches]]
name = "w"
attn_type = "SlidingWindow"
sliding_window = 256
dim = 64
num_head = 2
dtype = "fp16"
block_size = 16
"""


def test_custom_toml_and_json_models_are_the_same(tmp_path: Path) -> None:
    """A TOML file and its JSON twin describe the same caches."""
    import tomllib

    (tmp_path / "toy.toml").write_text(TOML)
    (tmp_path / "toy.json").write_text(json.dumps(tomllib.loads(TOML)))
    a, b = load_model_file(tmp_path / "toy.toml"), load_model_file(tmp_path / "toy.json")
    expected = (a.cache_info, 4, ("https://example.org/toy",))
    assert expected == (b.cache_info, a.cache_info.num_layers, a.sources)


@pytest.mark.parametrize(("text", "needle"), [
    ("name = 'x'\nlayers = []", "missing key 'max_model_len'"),
    ("name = 'x'\nmax_model_len = 8\nlayers = [{caches = [{name = 'k'}]}]",
     "a FullAttention cache needs ['dim', 'num_head', 'dtype', 'block_size']"),
    ("name = 'x'\nmax_model_len = 8\ncolour = 1\nlayers = []", "unknown key(s) ['colour']"),
    ("name = = 'x'", "is not valid TOML"),
])
def test_bad_model_files_are_one_line_errors(tmp_path: Path, text: str, needle: str) -> None:
    """A broken model file names the problem."""
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(CLIError) as info:
        load_model_file(path)
    assert (True, 1) == (needle in str(info.value), len(str(info.value).splitlines()))


def test_impossible_budget_says_how_to_fix_it() -> None:
    """A budget smaller than the fixed groups is a CLIError that names the options."""
    with pytest.raises(CLIError) as info:
        plan_model(build_preset("qwen3-next-80b"), PlanConfig(Budget(8 * GIB)))
    assert "raise --memory or --mem-fraction, or lower --concurrency" in str(info.value)
