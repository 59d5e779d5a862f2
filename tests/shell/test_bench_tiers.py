"""Smoke test of ``benchmarks/bench_tiers.py --quick`` (no timing is ever asserted)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from kvfunc.shell import BlockMover, HostBlockPool

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_tiers.py"


def test_bench_tiers_quick_runs_every_lane_and_checks_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--quick`` returns 0, checks every lane's bytes, and reports every lane of each case."""
    spec = importlib.util.spec_from_file_location("bench_tiers", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "bench.json"
    assert 0 == bench.main(["--quick", "--json", str(out)])
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    cases = bench.Settings(True).cases
    assert (True, [f"{b}x{n}" for b, n in cases]) == (result["quick"], list(result["cases"]))
    lanes = {f"{cache}/{pool} {pattern} {direction}" for cache, pool in bench.LAYOUTS
             for pattern in bench.PATTERNS for direction in bench.DIRECTIONS}
    for b, n in cases:
        assert lanes == set(result["cases"][f"{b}x{n}"])
        assert f"cross-check [{b // 1024} KiB x {n}]: every lane moved the right bytes: OK" \
            in printed


def test_bench_tiers_check_rejects_a_wrong_move() -> None:
    """The benchmark's check fails when the mover writes other bytes than an indexed copy."""
    spec = importlib.util.spec_from_file_location("bench_tiers", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    device = {"t0": torch.arange(8, dtype=torch.float16).view(4, 2)}
    host = HostBlockPool.like(device, 4)
    host.tensors[0].zero_()
    mover = BlockMover.create(device, host)

    class Wrong:
        """A mover that stores into the wrong host block."""

        def store(self, src: list[int], dst: list[int]) -> object:
            return mover.store(src, [(d + 1) % 4 for d in dst])

    try:
        with pytest.raises(AssertionError, match="store moved the wrong bytes"):
            bench.check(Wrong(), device, host, "store", [1, 2], [0, 1])
    finally:
        mover.close()
