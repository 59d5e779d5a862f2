"""A pytest plugin that runs vLLM's own ``tests/v1/core`` unmodified, with kvfunc switched on.

Load it with ``-p kvfunc_vllm_suite`` (this directory on ``PYTHONPATH``) from
the directory that holds vLLM's ``tests`` package.  It gives vLLM's tests
what they otherwise take from vLLM's own (heavy) top-level ``conftest.py``:

* the markers they use and the two logging fixtures of ``test_scheduler.py``
  (``temporary_enable_log_propagate``, ``caplog_vllm``);
* vLLM's plugins, loaded at start-up as every vLLM process loads them, so
  ``KVFUNC_VLLM`` acts through kvfunc's entry point, as in a real engine.

With ``KVFUNC_VLLM`` set, every test must prove that kvfunc was its manager:
an autouse fixture counts the managers the test built and fails the test
(an error at teardown) when kvfunc built none, or when vLLM's own manager
was built although kvfunc's was asked for (``KVFUNC_VLLM=1``).  A run in
which the switch silently did nothing therefore fails.
``--kvfunc-report=PATH`` also writes every test's outcome and counts as JSON.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

MARKERS = ("cpu_test", "slow_test", "skip_global_cleanup", "core_model", "split", "distributed",
           "optional")
BUILT = {"kvfunc": 0, "vllm": 0}
SPECS: list[str] = []  # the KV cache specs of every manager built, in order
SHADOWS: list[Any] = []  # the shadow managers built (KVFUNC_VLLM=shadow)
REPORT: dict[str, dict[str, Any]] = {}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--kvfunc-report", default=None, metavar="PATH",
                     help="write each test's outcome and manager counts as JSON")


def _count(cls: type, name: str) -> None:
    """Count the instances of ``cls`` built from now on under ``BUILT[name]``."""
    init = cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        BUILT[name] += 1
        config = kwargs.get("kv_cache_config", args[0] if args else None)
        groups = getattr(config, "kv_cache_groups", ())
        SPECS.append("+".join(type(g.kv_cache_spec).__name__ for g in groups))
        init(self, *args, **kwargs)

    cls.__init__ = __init__  # type: ignore[method-assign]


def pytest_configure(config: pytest.Config) -> None:
    for marker in MARKERS:
        config.addinivalue_line("markers", marker)
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import vllm.v1.core.kv_cache_manager as kcm
    from vllm.plugins import load_general_plugins

    _count(kcm.KVCacheManager, "vllm")  # vLLM's own class, before any plugin rebinds it
    load_general_plugins()
    from kvfunc.vllm import KVCacheManager, ShadowKVCacheManager

    _count(KVCacheManager, "kvfunc")
    init = ShadowKVCacheManager.__init__

    def keep(self: Any, *args: Any, **kwargs: Any) -> None:
        SHADOWS.append(self)  # counted when asked for, even if vLLM's own manager refuses
        init(self, *args, **kwargs)

    ShadowKVCacheManager.__init__ = keep  # type: ignore[method-assign]


def _wanted() -> str | None:
    value = os.environ.get("KVFUNC_VLLM", "").strip().lower()
    return None if value in ("", "0", "false", "off") else value


@pytest.fixture(autouse=True)
def _kvfunc_was_the_manager(request: pytest.FixtureRequest) -> Iterator[None]:
    """With KVFUNC_VLLM set, the test built kvfunc's manager (and no vLLM one unless shadowing)."""
    before, first_spec = dict(BUILT), len(SPECS)
    SHADOWS.clear()
    yield
    built = {k: BUILT[k] - before[k] for k in BUILT}
    entry = REPORT.setdefault(request.node.nodeid, {})
    entry.update(managers=built, specs=sorted(set(SPECS[first_spec:])))
    found = [d for s in SHADOWS if (d := getattr(s, "divergence", None)) is not None]
    if found:
        entry["divergences"] = [{"call": d.call, "what": d.what, "calls": list(d.calls[-12:])}
                                for d in found]
    entry["shadows"] = len(SHADOWS)
    entry["not_mirrored"] = sorted({why for s in SHADOWS
                                    if (why := getattr(s, "not_mirrored", None))})
    shadows = len(SHADOWS)
    SHADOWS.clear()
    wanted = _wanted()
    if wanted is None:
        return
    if wanted == "shadow":
        assert shadows > 0 or built["vllm"] == 0, (
            f"KVFUNC_VLLM=shadow but this test built {built['vllm']} vLLM manager(s) and no "
            "shadow: the switch did nothing")
        return
    assert built["kvfunc"] > 0, (
        f"KVFUNC_VLLM={wanted} but this test built no kvfunc manager (vLLM built "
        f"{built['vllm']} of its own): the switch did nothing")
    assert built["vllm"] == 0, (
        f"KVFUNC_VLLM={wanted} but this test built {built['vllm']} vLLM manager(s)")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    entry = REPORT.setdefault(report.nodeid, {})
    if report.failed or report.when == "call" or "outcome" not in entry:
        entry["outcome"] = report.outcome if report.when == "call" or report.failed else (
            entry.get("outcome", report.outcome))


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = session.config.getoption("--kvfunc-report")
    if path:
        Path(path).write_text(json.dumps({"kvfunc_vllm": _wanted(), "tests": REPORT},
                                         indent=1, sort_keys=True))


@pytest.fixture
def temporary_enable_log_propagate() -> Iterator[None]:
    """vLLM's ``vllm`` logger propagates to the root logger while the test runs."""
    logger = logging.getLogger("vllm")
    old = logger.propagate
    logger.propagate = True
    yield
    logger.propagate = old


@pytest.fixture
def caplog_vllm(temporary_enable_log_propagate: None,
                caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """pytest's ``caplog`` capturing vLLM's log records at INFO."""
    caplog.set_level(logging.INFO)
    yield caplog
