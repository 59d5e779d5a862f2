"""``kvfunc simulate --host-memory / --remote``: tiers in the simulator, and their hostile flags."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from cli_run import run_main  # the helper beside this file

RUN = ("simulate", "--preset", "deepseek-v3", "--trace", "mooncake-conversation",
       "--requests", "250", "--memory", "8GiB", "--no-plot", "--no-progress", "--json")


@pytest.mark.parametrize(("flags", "needle"), [
    (("--host-memory", "lots"), "--host-memory"),
    (("--host-memory", "-5GiB"), "--host-memory"),
    (("--host-memory", "0"), "--host-memory"),
    (("--host-memory", "1KiB"), "holds 0 blocks"),
    (("--host-memory", "100TiB"), "it must hold 1 to"),
    (("--remote", "mooncake"), "--remote needs --host-memory"),
    (("--host-memory", "1GiB", "--remote", "redis"), "--remote must be mooncake"),
    (("--host-memory", "1GiB", "--remote", "mooncake:"), "--remote must be mooncake"),
    (("--host-memory", "1GiB", "--remote", "mooncake:0"), "--remote size"),
    (("--host-memory", "1GiB", "--remote", "mooncake:x" * 50), "--remote"),
    (("--host-memory", "1GiB", "--host-bandwidth", "0"), "--host-bandwidth"),
    (("--host-memory", "1GiB", "--host-bandwidth", "nan"), "--host-bandwidth"),
    (("--host-memory", "1GiB", "--remote-bandwidth", "inf"), "--remote-bandwidth"),
    (("--host-memory", "1GiB", "--remote-bandwidth=-3"), "--remote-bandwidth"),
    (("--host-memory", "1GiB", "--write-policy", "sometimes"), "--write-policy"),
    (("--host-memory", "1GiB", "--no-prefix-caching"), "need prefix caching"),
])
def test_hostile_tier_flags(capsys: pytest.CaptureFixture[str], flags: tuple[str, ...],
                            needle: str) -> None:
    """Each bad tier flag ends in one line naming it and exit 2."""
    code, _, err = run_main(capsys, *RUN, *flags)
    lines = err.strip().splitlines()
    assert (code, len(lines), needle in err, len(err) < 400) == (2, 1, True, True), err


def test_tiers_need_a_trace_with_blocks_and_one_pool(capsys: pytest.CaptureFixture[str]
                                                     ) -> None:
    """A trace without block ids, a hybrid model in a pool per type, or a model with a
    recurrent state is refused with exit 2."""
    code, _, err = run_main(capsys, "simulate", "--preset", "llama-3-8b", "--trace", "conv",
                            "--memory", "8GiB", "--host-memory", "8GiB", "--no-plot")
    assert code == 2 and "prefix caching" in err, err
    for preset, layout, needle in (("gpt-oss-120b", "per-type", "try --layout shared"),
                                   ("qwen3-next-80b", "shared", "sliding windows")):
        code, _, err = run_main(capsys, "simulate", "--preset", preset, "--trace",
                                "mooncake-conversation", "--requests", "5", "--memory", "24GiB",
                                "--layout", layout, "--host-memory", "8GiB", "--no-plot",
                                "--no-progress")
        assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err


def test_host_memory_behind_a_hybrid_model(capsys: pytest.CaptureFixture[str]) -> None:
    """gpt-oss-120b in the shared layout: a host tier of pages adds host hits, and each
    position hit below the device loads a block of each of its two groups."""
    run = ("simulate", "--preset", "gpt-oss-120b", "--trace", "mooncake-conversation",
           "--requests", "150", "--memory", "4GiB", "--no-plot", "--no-progress", "--json")
    t = _plain_then_tiered(capsys, run, "32GiB")
    assert t["block_bytes"] == 589824  # a page of the shared pool
    assert t["hit_tokens"]["host"] > 0 and t["hit_tokens"]["device"] > 0
    loaded = t["loaded_blocks"]["host"]  # first admissions, and again after a preemption
    assert loaded % 2 == 0 and loaded >= 2 * t["hit_tokens"]["host"] // 16  # blocks of 16


def _plain_then_tiered(capsys: pytest.CaptureFixture[str], run: tuple[str, ...],
                       host_memory: str) -> dict[str, Any]:
    """The ``tiers`` report of ``run`` with ``--host-memory``, checked against ``run`` alone:
    the tiers' hits add up to the run's, and it hits more than the device alone."""
    code, out, err = run_main(capsys, *run)
    assert code == 0, err
    plain = json.loads(out)
    assert plain["tiers"] is None
    code, out, err = run_main(capsys, *run, "--host-memory", host_memory)
    assert code == 0, err
    tiered = json.loads(out)
    t: dict[str, Any] = tiered["tiers"]
    hits = sum(t["hit_tokens"].values())
    assert hits == tiered["prefix_cache"]["hit_tokens"] > plain["prefix_cache"]["hit_tokens"]
    return t


def test_host_memory_hits_below_the_device(capsys: pytest.CaptureFixture[str]) -> None:
    """A host tier adds host hits and loads to the same run, and never loses device hits."""
    t = _plain_then_tiered(capsys, RUN, "64GiB")
    assert t["hit_tokens"]["host"] > 0 and t["loaded_blocks"]["host"] > 0
    assert t["stored_blocks"]["host"] > 0 and t["ttft_saved_s"] > 0
    code, out, err = run_main(capsys, *RUN, "--host-memory", "8GiB", "--remote", "mooncake",
                              "--write-policy", "write-through")
    assert code == 0, err
    r = json.loads(out)["tiers"]
    assert r["remote"] and r["stored_blocks"]["remote"] > 0 and r["hit_tokens"]["remote"] > 0


def test_capacity_sweep_sweeps_host_memory() -> None:
    """With --host-memory, each sweep point keeps --memory and takes its own host memory."""
    from kvfunc.cli._offload import OffloadConfig
    from kvfunc.cli._plan import Budget
    from kvfunc.cli._presets import build_preset
    from kvfunc.cli._simulate import SimulationConfig
    from kvfunc.cli._sweep import run_sweep
    from kvfunc.cli._trace import load_trace

    cfg = SimulationConfig(build_preset("deepseek-v3"),
                           load_trace("mooncake-conversation", limit=120), Budget(8 * 2**30),
                           offload=OffloadConfig(32 * 2**30))
    sweep = run_sweep(cfg, points=2, jobs=1)
    assert [p.host_memory_bytes >> 30 for p in sweep.points] == [16, 32]
    assert {p.memory_bytes for p in sweep.points} == {8 * 2**30}
    small, large = sweep.points
    assert small.capacity_tokens < large.capacity_tokens
    assert small.hit_tokens <= large.hit_tokens
