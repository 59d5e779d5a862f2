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
