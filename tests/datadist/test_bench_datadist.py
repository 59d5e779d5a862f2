"""Smoke test of ``benchmarks/bench_datadist.py --quick`` (no timing is ever asserted)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

from torch_threads import one_torch_thread  # noqa: F401  (autouse)

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_datadist.py"


def bench_has_mooncake() -> bool:
    """Whether the benchmark runs its Mooncake lanes here (its own check: the engine
    imports, which needs libibverbs1 as well as the package)."""
    spec = importlib.util.spec_from_file_location("bench_datadist", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bool(bench.has_mooncake())


def test_bench_datadist_quick_runs_and_checks_every_block(tmp_path: Path) -> None:
    """``--quick`` exits 0 after checking every pulled and pushed block (and, with
    Mooncake, that scattered blocks are staged on both sides and contiguous runs on
    neither), reports each lane's ratio to its baseline, the crossover where Mooncake's
    engine loads, and the fairness section: every honest pull beside the flood done."""
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--quick", "--json", str(out)],
                          capture_output=True, text=True, timeout=600, check=False)
    assert 0 == proc.returncode, proc.stdout + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert (True, 8.0) == (result["quick"], result["mib"])
    ratios = {line.strip().split("  ")[0] for line in proc.stdout.splitlines() if "ratio" in line}
    assert {"ratio contiguous/raw tcp throughput", "ratio scattered/(raw tcp + copy) time",
            "ratio scattered/raw tcp throughput", "ratio raw gloo/raw tcp throughput",
            "ratio total/(compute + 1 layer)"} <= ratios
    mooncake = bench_has_mooncake()
    assert ("ratio mooncake pull/raw write throughput" in ratios) == mooncake
    assert ("crossover" in result) == mooncake
    assert ["1", "4", "16"] == list(result["fairness"])
    assert [0, 0, 0] == [f["failed"] for f in result["fairness"].values()]
    assert [0, 0, 0] == [f["flood_errors"] for f in result["fairness"].values()]
