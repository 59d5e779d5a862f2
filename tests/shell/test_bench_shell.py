"""Smoke test of ``benchmarks/bench_shell.py --quick`` (no timing is ever asserted)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_shell.py"


def test_bench_shell_quick_runs_and_cross_checks(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """``--quick`` returns 0, both table paths agree at every step, and copies are checked."""
    spec = importlib.util.spec_from_file_location("bench_shell", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "bench.json"
    assert 0 == bench.main(["--quick", "--json", str(out)])
    printed = capsys.readouterr().out
    assert "cross-check [blocks]: copy_blocks equals an indexed assignment: OK" in printed
    result = json.loads(out.read_text())
    assert (True, 8) == (result["quick"], result["tables"]["checked_steps"])
    assert ["copy", "swap", "zero"] == list(result["blocks"])
