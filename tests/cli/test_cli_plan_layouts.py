"""``kvfunc plan`` shows both layouts: a pool per manager key and one pool shared by every group."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kvfunc.cli import Budget, PlanConfig, build_preset, plan_model, preset_names
from kvfunc.core import SizingConfig, calculate_shared_block_num, shared_page_layout

sys.path.insert(0, str(Path(__file__).parent))
from cli_run import run_main  # the helper beside this file

GIB = 2**30


@pytest.mark.parametrize("name", preset_names())
def test_the_shared_pool_is_calculate_shared_block_num(name: str) -> None:
    """The shared plan's pool, page and slots are the core's sizing for the same budget."""
    preset = build_preset(name)
    report = plan_model(preset, PlanConfig(Budget(80 * GIB, 0.9, used_bytes=8 * GIB)))
    sizing = calculate_shared_block_num(
        SizingConfig(64, 0.9, 8192, next_n=preset.next_n), preset.cache_info,
        free_memory_bytes=72 * GIB, total_memory_bytes=80 * GIB)
    shared = report.shared
    assert shared is not None, report.shared_error
    assert (sizing.num_blocks, sizing.page_bytes, len(sizing.layout.slot_bytes)) == (
        shared.num_blocks, shared.page_bytes, shared.num_slots)
    assert [(g.manager_key, g.block_bytes, sizing.layout.padding(g.manager_key))
            for g in sizing.layout.groups] == [(g.manager_key, g.block_bytes, g.padding_bytes)
                                               for g in shared.groups]


def test_one_group_gets_the_same_pool_either_way() -> None:
    """llama-3-8b has one group: the shared pool is its per-type pool."""
    report = plan_model(build_preset("llama-3-8b"), PlanConfig(Budget(64 * GIB)))
    assert report.shared is not None
    (group,) = report.groups
    (row,) = report.shared.groups
    assert (group.num_blocks, group.tokens, report.max_concurrency) == (
        report.shared.num_blocks, row.tokens, report.shared.max_concurrency)


def test_a_request_holds_blocks_of_every_group_in_the_one_pool() -> None:
    """gpt-oss at 8,192 tokens: 512 full + 9 window blocks a request, from one pool."""
    report = plan_model(build_preset("gpt-oss-120b"), PlanConfig(Budget(24 * GIB)))
    shared = report.shared
    assert shared is not None
    page = 18 * 2 * 16 * 8 * 64 * 2  # 18 slots of K and V, 16 rows, 8 heads x 64, bf16
    blocks = int(24 * GIB * 0.9 // page)
    assert (page, blocks, (blocks - 1) // (512 + 9)) == (
        shared.page_bytes, shared.num_blocks, shared.max_concurrency)
    assert [("SlidingWindow", 9, (blocks - 1) * 16), ("FullAttention", 512, (blocks - 1) * 16)] \
        == [(g.manager_key, g.blocks_per_request, g.tokens) for g in shared.groups]


def test_plan_prints_both_layouts(capsys: pytest.CaptureFixture[str]) -> None:
    """The text output has the per-type table, then the shared pool and its rows."""
    code, out, _ = run_main(capsys, "plan", "--preset", "gpt-oss-120b", "--memory", "24GiB")
    report = plan_model(build_preset("gpt-oss-120b"), PlanConfig(Budget(24 * GIB)))
    assert report.shared is not None
    per_type, _, shared = out.partition("shared layout")
    assert 0 == code
    assert f"{report.groups[1].num_blocks - 1:,}" in per_type  # the per-type full pool
    assert (f"{report.shared.num_blocks - 1:,} usable blocks of 576.00 KiB (18 layer slots)"
            in shared)
    assert (f"fit at once: {report.shared.max_concurrency} (per-type: "
            f"{report.max_concurrency})") in shared
    assert report.shared.max_concurrency > report.max_concurrency
    assert all(key in shared for key in ("SlidingWindow", "FullAttention", "100%"))


def test_plan_json_has_the_shared_pool(capsys: pytest.CaptureFixture[str]) -> None:
    """--json gives the shared pool's blocks, page and groups beside the per-type groups."""
    code, out, _ = run_main(capsys, "plan", "--preset", "gpt-oss-120b", "--memory", "24GiB",
                            "--json")
    data = json.loads(out)
    shared = data["shared"]
    page = 18 * 2 * 16 * 8 * 64 * 2
    blocks = int(24 * GIB * 0.9 // page)
    assert (0, 2, blocks, blocks - 1, page, 18) == (
        code, len(data["groups"]), shared["num_blocks"], shared["usable_blocks"],
        shared["page_bytes"], shared["num_slots"])
    assert shared["total_bytes"] == shared["num_blocks"] * shared["page_bytes"]
    assert ["SlidingWindow", "FullAttention"] == [g["manager_key"] for g in shared["groups"]]


def test_a_shared_pool_that_does_not_fit_is_explained(capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    """qwen3-next at 24 GiB: per-type fits; the shared page is a Mamba page, say so, exit 0."""
    code, out, err = run_main(capsys, "plan", "--preset", "qwen3-next-80b", "--memory", "24GiB")
    page = shared_page_layout(build_preset("qwen3-next-80b").cache_info).page_bytes
    assert (0, "") == (code, err)
    assert "the shared layout does not fit the budget" in out
    assert f"of {page} bytes" in out and "FullAttention fills 0.6% of it" in out
    code, out, _ = run_main(capsys, "plan", "--preset", "qwen3-next-80b", "--memory", "24GiB",
                            "--json")
    assert "does not fit the budget" in json.loads(out)["shared"]["error"]
