"""kvfunc inside vLLM: a drop-in KV cache manager for vLLM 0.33's scheduler.

* :class:`KVCacheManager` has vLLM's constructor and everything its
  ``Scheduler`` calls, backed by one kvfunc state: every scheduler call that
  changes the cache is one pure transition (one that only caches the block
  it filled is folded into a later one, before anything reads the cache),
  and the state is a value (``snapshot()`` / ``restore()``);
* :func:`install` makes vLLM build it (``install(mode="shadow")``: vLLM's own
  manager stays primary and kvfunc's is mirrored and compared,
  :class:`ShadowKVCacheManager`); the ``KVFUNC_VLLM`` environment variable
  does the same in every vLLM process through vLLM's plugin entry point;
* what kvfunc does not model is refused when the manager is built
  (:class:`NotModelledError`).

Importing this package does not import vLLM; its names do, when first used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvfunc.vllm._layout import NotModelledError
    from kvfunc.vllm._manager import KVCacheManager
    from kvfunc.vllm._plugin import install, installed_mode, uninstall
    from kvfunc.vllm._shadow import ShadowKVCacheManager
    from kvfunc.vllm._shadow_log import Divergence, DivergenceError
    from kvfunc.vllm._views import ManagerInternalsError

__all__ = [
    "Divergence",
    "DivergenceError",
    "KVCacheManager",
    "ManagerInternalsError",
    "NotModelledError",
    "ShadowKVCacheManager",
    "install",
    "installed_mode",
    "uninstall",
]

_WHERE = {
    "Divergence": "_shadow_log", "DivergenceError": "_shadow_log", "KVCacheManager": "_manager",
    "ManagerInternalsError": "_views", "NotModelledError": "_layout",
    "ShadowKVCacheManager": "_shadow", "install": "_plugin", "installed_mode": "_plugin",
    "uninstall": "_plugin",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'kvfunc.vllm' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"kvfunc.vllm.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
