"""vLLM's own tests prove kvfunc was their manager: a run where the switch did nothing fails.

Needs vLLM's tests laid out (``bash .ci/vllm-tests.sh DIR``) and ``KVFUNC_VLLM_TESTS=DIR``
(CI sets both); skipped otherwise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
TESTS = os.environ.get("KVFUNC_VLLM_TESTS")
IDS = ["tests/v1/core/test_scheduler.py::test_add_requests",
       "tests/v1/core/test_prefix_caching.py::test_basic_prefix_caching_disabled"]

pytestmark = pytest.mark.skipif(TESTS is None or not Path(TESTS, "tests").is_dir(),
                                reason="vLLM's tests are not laid out (KVFUNC_VLLM_TESTS)")


def run_vllm_tests(tmp_path: Path, **env: str) -> tuple[int, str, dict]:
    """Run IDS from vLLM's tests with the suite plugin; (exit status, output, report)."""
    report = tmp_path / "report.json"
    full_env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1",
                "HF_HOME": str(Path(TESTS, "hf")), "PYTHONPATH": str(HERE), **env}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-c", str(HERE / "vllm-suite.ini"),
         "--rootdir", str(TESTS), "-p", "kvfunc_vllm_suite", "-p", "no:cacheprovider",
         "-q", f"--kvfunc-report={report}", *IDS], cwd=TESTS, env=full_env,
        capture_output=True, text=True, timeout=600, check=False)
    assert report.exists(), (proc.stdout + proc.stderr)[-4000:]  # pytest itself failed
    return proc.returncode, proc.stdout + proc.stderr, json.loads(report.read_text())


def test_switch_on_every_test_built_kvfuncs_manager(tmp_path: Path) -> None:
    """With KVFUNC_VLLM=1 the tests pass and each built kvfunc's manager and none of vLLM's."""
    rc, out, report = run_vllm_tests(tmp_path, KVFUNC_VLLM="1")
    assert 0 == rc, out
    built = [report["tests"][t]["managers"] for t in IDS]
    assert all(b["kvfunc"] > 0 and b["vllm"] == 0 for b in built), built


def test_switch_that_did_nothing_fails_the_run(tmp_path: Path) -> None:
    """With the plugin not loaded (VLLM_PLUGINS=none) the same run fails, saying why."""
    rc, out, report = run_vllm_tests(tmp_path, KVFUNC_VLLM="1", VLLM_PLUGINS="none")
    assert 0 != rc
    assert "the switch did nothing" in out
    assert all(report["tests"][t]["managers"]["kvfunc"] == 0 for t in IDS)
