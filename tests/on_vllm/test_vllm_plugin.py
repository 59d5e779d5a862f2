"""One switch: vLLM's plugin entry point, KVFUNC_VLLM, install() and uninstall()."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from importlib.metadata import entry_points
from types import SimpleNamespace
from typing import Any

import pytest
import vllm.v1.core.kv_cache_manager as kcm
import vllm.v1.core.sched.scheduler as sched
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

import kvfunc as kf
from kvfunc.vllm import (
    KVCacheManager,
    NotModelledError,
    ShadowKVCacheManager,
    install,
    installed_mode,
    uninstall,
)
from kvfunc.vllm._plugin import check_scheduler, register

VLLMS = kcm.KVCacheManager


@pytest.fixture(autouse=True)
def _vllm_untouched_after() -> Iterator[None]:
    """Every test leaves vLLM with its own manager."""
    yield
    uninstall()
    assert (VLLMS, VLLMS) == (kcm.KVCacheManager, sched.KVCacheManager)


def test_entry_point_is_registered() -> None:
    """kvfunc's register() is in vLLM's general-plugins entry-point group."""
    found = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert "kvfunc.vllm._plugin:register" == found.get("kvfunc")


@pytest.mark.parametrize(("value", "mode", "cls"), [
    ("", None, VLLMS), ("0", None, VLLMS), ("1", "manager", KVCacheManager),
    ("shadow", "shadow", ShadowKVCacheManager)])
def test_register_follows_the_environment(monkeypatch: pytest.MonkeyPatch, value: str,
                                          mode: str | None, cls: type) -> None:
    """KVFUNC_VLLM unset or 0 leaves vLLM untouched; 1 and shadow install the manager asked for."""
    monkeypatch.setenv("KVFUNC_VLLM", value)
    register()
    assert (mode, cls, cls) == (installed_mode(), sched.KVCacheManager, kcm.KVCacheManager)


def test_a_bad_setting_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """An unknown KVFUNC_VLLM value is a typed error naming the choices; nothing is installed."""
    monkeypatch.setenv("KVFUNC_VLLM", "yes please")
    with pytest.raises(kf.InvalidArgumentError, match=r"use 1 .* shadow"):
        register()
    assert installed_mode() is None


def test_install_and_uninstall_switch_back_and_forth() -> None:
    """install() twice, another mode, then uninstall(): vLLM gets its own class back."""
    install()
    install()
    assert sched.KVCacheManager is KVCacheManager
    install(mode="shadow")
    assert sched.KVCacheManager is ShadowKVCacheManager
    with pytest.raises(kf.InvalidArgumentError):
        install(mode="mirror")
    assert "shadow" == installed_mode()


def test_every_vllm_process_follows_the_switch() -> None:
    """In a fresh process, vLLM's own plugin loading installs what KVFUNC_VLLM says."""
    code = ("import warnings; warnings.simplefilter('ignore')\n"
            "from vllm.plugins import load_general_plugins\n"
            "load_general_plugins()\n"
            "import vllm.v1.core.sched.scheduler as s\n"
            "print(s.KVCacheManager.__module__)\n")
    seen = {}
    for value in ("", "1", "shadow"):
        env = {**os.environ, "KVFUNC_VLLM": value, "VLLM_TARGET_DEVICE": "cpu"}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, timeout=300, check=True)
        seen[value] = out.stdout.split()[-1]
    assert {"": "vllm.v1.core.kv_cache_manager", "1": "kvfunc.vllm._manager",
            "shadow": "kvfunc.vllm._shadow"} == seen


class _PoolReader(KVConnectorBase_V1):
    """A connector that binds the manager's block pool (kvfunc's manager has none to give)."""

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        self.pool = gpu_block_pool


_PoolReader.__abstractmethods__ = frozenset()  # only its class is looked at


def test_connector_reading_manager_internals_is_refused() -> None:
    """A scheduler whose connector binds the block pool is refused, the connector named."""
    scheduler = SimpleNamespace(connector=object.__new__(_PoolReader), aux_output_connector=None)
    with pytest.raises(NotModelledError, match="the _PoolReader KV connector"):
        check_scheduler(scheduler)
    check_scheduler(SimpleNamespace(connector=None, aux_output_connector=None))
