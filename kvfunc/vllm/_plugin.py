"""One switch: vLLM's plugin entry point, ``install()`` and ``uninstall()``.

vLLM loads the functions named in the ``vllm.general_plugins`` entry-point
group in every process it starts.  kvfunc registers :func:`register` there;
it reads ``KVFUNC_VLLM``:

* unset, empty or ``0``: nothing happens, vLLM is untouched;
* ``1``: :func:`install` -- vLLM's scheduler builds kvfunc's manager;
* ``shadow``: ``install(mode="shadow")`` -- vLLM's own manager stays the
  primary, kvfunc's is mirrored beside it and compared call by call.

:func:`install` rebinds the name ``KVCacheManager`` where vLLM's code looks
it up: in ``vllm.v1.core.sched.scheduler`` (the scheduler builds its manager
from it) and in ``vllm.v1.core.kv_cache_manager`` (code that imports it
later).  It also checks each new scheduler's KV connector: a connector that
reaches into the manager's internals (its block pool or coordinator) is
refused while the scheduler is built, with the connector named.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["MODES", "install", "installed_mode", "register", "uninstall", "vllm_manager_class"]

MODES = ("manager", "shadow")
_ENV = "KVFUNC_VLLM"
_ORIGINAL: dict[str, Any] = {}
_MODE: list[str | None] = [None]


def register() -> None:
    """vLLM's plugin entry point: act on ``KVFUNC_VLLM`` (see the module docstring).

    >>> import os
    >>> os.environ.pop("KVFUNC_VLLM", None) is None or True
    True
    >>> register()  # unset: nothing happens
    >>> installed_mode() is None
    True
    """
    value = os.environ.get(_ENV, "").strip().lower()
    if value in ("", "0", "false", "off"):
        return
    if value in ("1", "true", "on", "manager"):
        install()
    elif value == "shadow":
        install(mode="shadow")
    else:
        from kvfunc.core import InvalidArgumentError

        msg = f"{_ENV}={os.environ[_ENV]!r}: use 1 (kvfunc's manager), shadow, or 0 / unset"
        raise InvalidArgumentError(msg)


def vllm_manager_class() -> type:
    """vLLM's own ``KVCacheManager`` class, whatever is installed."""
    original = _ORIGINAL.get("kcm")
    if original is None:
        import vllm.v1.core.kv_cache_manager as kcm

        original = kcm.KVCacheManager
    cls: type = original
    return cls


def installed_mode() -> str | None:
    """``"manager"`` or ``"shadow"`` once :func:`install` ran, else None."""
    return _MODE[0]


def install(mode: str = "manager") -> None:
    """Make vLLM build kvfunc's manager (``"manager"``) or mirror it (``"shadow"``).

    Call it before vLLM builds its scheduler.  Installing twice with the same
    mode does nothing; another mode replaces the first.
    """
    if mode not in MODES:
        from kvfunc.core import InvalidArgumentError

        raise InvalidArgumentError(f"mode must be one of {list(MODES)}, got {mode!r}")
    import vllm.v1.core.kv_cache_manager as kcm
    import vllm.v1.core.sched.scheduler as sched

    if not _ORIGINAL:
        _ORIGINAL.update(kcm=kcm.KVCacheManager, sched=sched.KVCacheManager,
                         init=sched.Scheduler.__init__)
    cls: type
    if mode == "manager":
        from kvfunc.vllm._manager import KVCacheManager

        cls = KVCacheManager
    else:
        from kvfunc.vllm._shadow import ShadowKVCacheManager

        cls = ShadowKVCacheManager
    kcm.KVCacheManager = cls
    sched.KVCacheManager = cls
    sched.Scheduler.__init__ = _checked_init(_ORIGINAL["init"])
    _MODE[0] = mode


def uninstall() -> None:
    """Give vLLM its own manager back (a no-op when nothing is installed)."""
    if not _ORIGINAL:
        return
    import vllm.v1.core.kv_cache_manager as kcm
    import vllm.v1.core.sched.scheduler as sched

    kcm.KVCacheManager = _ORIGINAL["kcm"]
    sched.KVCacheManager = _ORIGINAL["sched"]
    sched.Scheduler.__init__ = _ORIGINAL["init"]
    _ORIGINAL.clear()
    _MODE[0] = None


def _checked_init(init: Any) -> Any:
    """``Scheduler.__init__`` followed by the connector check (see the module docstring)."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        check_scheduler(self)

    __init__.__wrapped__ = init  # type: ignore[attr-defined]
    return __init__


def check_scheduler(scheduler: Any) -> None:
    """Refuse a scheduler whose connectors read the manager's internals."""
    from kvfunc.vllm._layout import refuse

    if getattr(scheduler, "aux_output_connector", None) is not None:
        raise refuse("aux-output connectors", "they read the manager's block pool")
    connector = getattr(scheduler, "connector", None)
    if connector is not None:
        bad = _internal_connector(connector)
        if bad is not None:
            raise refuse(f"the {type(bad).__name__} KV connector",
                         "it binds the manager's block pool or coordinator")


def _internal_connector(connector: Any) -> Any:
    """The (sub-)connector that overrides the hooks that hand it the manager's internals."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    for child in getattr(connector, "_connectors", ()) or ():
        bad = _internal_connector(child)
        if bad is not None:
            return bad
    cls = type(connector)
    own = (cls.bind_gpu_block_pool is not KVConnectorBase_V1.bind_gpu_block_pool
           or (cls.bind_kv_cache_manager is not KVConnectorBase_V1.bind_kv_cache_manager
               and not getattr(connector, "_connectors", None)))
    if own or cls.__name__ in _READS_INTERNALS:
        return connector
    return None


#: Connectors that read ``_kv_cache_manager.coordinator`` outside the bind hooks.
_READS_INTERNALS = frozenset({"OffloadingConnector"})
