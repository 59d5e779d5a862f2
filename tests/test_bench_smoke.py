"""Smoke test of ``benchmarks/bench_core.py --quick`` (no timing is ever asserted)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_core.py"


def test_bench_core_quick_runs_and_cross_checks_block_ids(tmp_path: Path) -> None:
    """``--quick`` exits 0 and every path ended with the same block ids, for both configs."""
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--quick", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for config in ("full", "hybrid"):
        assert f"cross-check [{config}]: final block tables and free queues identical" \
            in proc.stdout
    result = json.loads(out.read_text())
    assert result["quick"] is True
    checked = {name: runs > 0 for name, runs in result["cross_check"].items()}
    assert checked == {"full": True, "hybrid": True,
                       "flatness_full": True, "flatness_hybrid": True}
    paths = {"a", "c_call", "s", "b", "c_batch", "b_slot", "b_call"}
    for config in ("full", "hybrid"):
        assert set(result["timing"][config]["runs_ns"]) == paths
        assert (f"cross-check [{config}]: final block tables and free queues identical across "
                f"{len(paths)} paths") in proc.stdout


def test_cross_check_rejects_different_block_ids() -> None:
    """The benchmark's cross-check fails when two paths end with different free queues."""
    spec = importlib.util.spec_from_file_location("bench_core", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    same = {"full": ({1: (1, 2)}, (3, 4))}
    bench.cross_check({"a": same, "b": dict(same)})
    with pytest.raises(AssertionError, match="free queues of a and b differ"):
        bench.cross_check({"a": same, "b": {"full": ({1: (1, 2)}, (4, 3))}})


BENCH_PREFIX = BENCH.with_name("bench_prefix.py")


def test_bench_prefix_quick_runs_and_cross_checks(tmp_path: Path) -> None:
    """``bench_prefix.py --quick --profile`` exits 0, cross-checks both configs and finds hits."""
    out = tmp_path / "prefix.json"
    proc = subprocess.run([sys.executable, str(BENCH_PREFIX), "--quick", "--profile",
                           "--json", str(out)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for config in ("full", "hybrid"):
        assert f"cross-check [{config}]: caching off = bench_core's naive allocator" in proc.stdout
    assert "== profile: caching on" in proc.stdout
    result = json.loads(out.read_text())
    assert result["quick"] is True
    fns = result["hash_fns"]
    assert "sha256" in fns
    for config in ("full", "hybrid"):
        timed = result["configs"][config]
        for mode in ("batch", "call", "decode"):
            assert set(timed[mode]["ratio_on_off"]) == set(fns)
            assert set(timed[mode]["us_per_call"]) == {f"off_{mode}",
                                                        *(f"on_{fn}_{mode}" for fn in fns)}
    cache = result["configs"]["full"]["cache"]["batch"]
    assert 0 < cache["hit_tokens"] <= cache["ideal_hit_tokens"]
    assert 0 < cache["hit_rate"] < 1


def test_bench_prefix_trace_shares_system_prompts() -> None:
    """Shared prompts start with their system prompt; the trace is seeded (same twice)."""
    spec = importlib.util.spec_from_file_location("bench_prefix", BENCH_PREFIX)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    trace = bench.Trace(8, 16)
    assert [len(p) for p in trace.system] == list(bench.SYSTEM_LENGTHS)
    assert min(bench.SYSTEM_LENGTHS) == 256 and max(bench.SYSTEM_LENGTHS) == 2048
    shared = 0
    for rid, prompt in trace.prompts.items():
        k = trace.system_of[rid]
        if k is not None:
            shared += 1
            assert prompt[:len(trace.system[k])] == trace.system[k]
            assert len(prompt) >= len(trace.system[k]) + 128
    assert 0 < shared < len(trace.prompts)
    assert [a for _, a in trace.steps] == [tuple((r, c, 1 if c else len(x)) for r, c, x in ops)
                                           for _, ops in trace.on_steps]
    again = bench.Trace(8, 16)
    assert again.prompts == trace.prompts and again.on_steps == trace.on_steps
