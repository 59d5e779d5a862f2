"""Free and total memory of the device the caches will live on.

The pure sizing code takes these figures as arguments; this is the one place
that asks a device for them.  Like the seed, it prefers ``torch.npu`` when
that attribute exists at call time (it appears once ``torch_npu`` has been
imported by the engine — we never import it ourselves), then CUDA, and
otherwise reports the host's memory so that planning works on a laptop.
"""

from __future__ import annotations

import os

import torch

from kvfunc.core import InvalidTypeError, NotSupportedError

__all__ = ["device_memory_info", "host_memory_info"]

_MEMINFO = "/proc/meminfo"


def _meminfo_bytes(path: str) -> tuple[int, int] | None:
    """``(MemAvailable, MemTotal)`` in bytes from a ``/proc/meminfo`` file, if readable."""
    fields: dict[str, int] = {}
    try:
        with open(path, encoding="ascii") as meminfo:
            for line in meminfo:
                name, _, rest = line.partition(":")
                parts = rest.split()
                if name in ("MemAvailable", "MemTotal") and parts:
                    scale = 1024 if parts[1:] == ["kB"] else 1
                    fields[name] = int(parts[0]) * scale
    except (OSError, ValueError):
        return None
    if "MemAvailable" not in fields or "MemTotal" not in fields:
        return None
    return fields["MemAvailable"], fields["MemTotal"]


def host_memory_info(meminfo_path: str = _MEMINFO) -> tuple[int, int]:
    """The host's ``(available, total)`` memory in bytes.

    Reads ``MemAvailable``/``MemTotal`` from ``/proc/meminfo`` (available
    memory counts reclaimable caches, unlike free pages); where that file is
    missing, falls back to ``os.sysconf`` page counts.

    Raises:
        NotSupportedError: neither source exists on this platform.

    >>> free, total = host_memory_info()
    >>> 0 <= free <= total
    True
    """
    figures = _meminfo_bytes(meminfo_path)
    if figures is not None:
        return figures
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page
    except (AttributeError, ValueError, OSError) as exc:
        msg = f"cannot read host memory: no {meminfo_path} and no os.sysconf page counts"
        raise NotSupportedError(msg) from exc


def _as_ints(figures: tuple[int, int]) -> tuple[int, int]:
    free, total = figures
    return int(free), int(total)


def device_memory_info(device: str | torch.device | None = None) -> tuple[int, int]:
    """``(free, total)`` bytes of ``device``, or of the current accelerator.

    With no device: ``torch.npu.mem_get_info()`` when ``torch.npu`` exists
    (as the seed does), else ``torch.cuda.mem_get_info()`` when CUDA is
    available, else the host's memory.  A device names its kind:
    ``"npu[:i]"``, ``"cuda[:i]"`` or ``"cpu"``.

    Raises:
        NotSupportedError: an NPU is named but ``torch.npu`` is absent, or
            the device kind has no memory query.

    >>> free, total = device_memory_info("cpu")
    >>> 0 <= free <= total
    True
    """
    npu = getattr(torch, "npu", None)
    if device is None:
        if npu is not None:
            return _as_ints(npu.mem_get_info())
        if torch.cuda.is_available():
            return _as_ints(torch.cuda.mem_get_info())
        return host_memory_info()
    # Parse the kind ourselves: without torch_npu, torch.device("npu") raises.
    if isinstance(device, str):
        kind = device.partition(":")[0]
    elif isinstance(device, torch.device):
        kind = device.type
    else:
        msg = f"device must be a str, a torch.device or None, but got {device!r}"
        raise InvalidTypeError(msg)
    if kind == "npu":
        if npu is None:
            msg = f"device {device!r} is an NPU but torch.npu is absent (import torch_npu first)"
            raise NotSupportedError(msg)
        return _as_ints(npu.mem_get_info(device))
    if kind == "cuda":
        return _as_ints(torch.cuda.mem_get_info(device))
    if kind == "cpu":
        return host_memory_info()
    msg = f"no memory query for device {device!r}; supported kinds: ['cpu', 'cuda', 'npu']"
    raise NotSupportedError(msg)
