"""Devices and dtypes: the one place that turns names into torch objects.

``resolve_device`` understands ``"cpu"``, ``"cuda[:i]"``, ``"npu[:i]"`` and
``"auto"``.  Ascend NPUs need the ``torch_npu`` adapter, which registers the
``npu`` device type with torch when it is imported; kvfunc imports it only
when an NPU is asked for (or ``"auto"`` finds it installed), never at import
time, so a CPU or CUDA installation never needs it.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType
from typing import Any, TypeAlias

import torch

from kvfunc.core import InvalidArgumentError, InvalidTypeError, KVFuncError

__all__ = [
    "DeviceError",
    "DeviceLike",
    "import_torch_npu",
    "is_accelerator",
    "resolve_device",
    "torch_dtype",
]

DeviceLike: TypeAlias = str | torch.device | None

_NPU_PACKAGE = "torch_npu"
_KINDS = ("auto", "cpu", "cuda", "npu")
# Short names used in engine configs, on top of torch's own attribute names.
_DTYPE_ALIASES = {"fp64": "float64", "fp32": "float32", "fp16": "float16", "bf16": "bfloat16",
                  "fp8": "float8_e4m3fn"}


class DeviceError(KVFuncError, RuntimeError):
    """A device, its backend package or its allocator cannot provide what was asked."""


def import_torch_npu() -> ModuleType:
    """Import ``torch_npu`` (Ascend's adapter) on first use and return it.

    Raises:
        DeviceError: ``torch_npu`` is not installed or fails to import.

    >>> try:
    ...     ok = import_torch_npu().__name__ == "torch_npu"
    ... except DeviceError as exc:
    ...     ok = "needs the torch_npu package" in str(exc)
    >>> ok
    True
    """
    try:
        return importlib.import_module(_NPU_PACKAGE)
    except (ImportError, OSError) as exc:  # OSError: CANN's shared libraries are missing
        msg = ("an NPU device needs the torch_npu package (Ascend's PyTorch adapter, installed "
               "with the CANN toolkit), but importing it failed: "
               f"{exc}; use 'cpu', 'cuda' or 'auto' on machines without an NPU")
        raise DeviceError(msg) from exc


def _npu_installed() -> bool:
    return getattr(torch, "npu", None) is not None or (
        importlib.util.find_spec(_NPU_PACKAGE) is not None)


def _check_index(kind: str, index: int | None, count: int) -> torch.device:
    device = torch.device(kind) if index is None else torch.device(kind, index)
    if device.index is not None and not 0 <= device.index < count:
        msg = f"device {str(device)!r} does not exist: {count} {device.type} device(s) visible"
        raise DeviceError(msg)
    return device


def _npu_device(index: int | None) -> torch.device:
    import_torch_npu()
    npu: Any = getattr(torch, "npu", None)
    if npu is None or not npu.is_available():
        raise DeviceError("torch_npu is installed but reports no available NPU")
    return _check_index("npu", index, npu.device_count())


def resolve_device(device: DeviceLike = "auto") -> torch.device:
    """The ``torch.device`` meant by ``device``, checked to be usable.

    ``"auto"`` (or ``None``) picks an NPU when ``torch_npu`` is installed and
    reports one, else CUDA when available, else the CPU.  ``"npu[:i]"``
    imports ``torch_npu`` on first use.

    Args:
        device: ``"auto"``, ``"cpu"``, ``"cuda[:i]"``, ``"npu[:i]"``, a
            ``torch.device`` or ``None``.

    Returns:
        The device, with the index given (``cuda`` stays index-less).

    Raises:
        InvalidTypeError: ``device`` is not a str, a ``torch.device`` or None.
        InvalidArgumentError: an unknown device kind.
        DeviceError: the kind is known but unusable here (no CUDA, no
            ``torch_npu``, an index past the device count).

    >>> resolve_device("cpu")
    device(type='cpu')
    >>> resolve_device("tpu")
    Traceback (most recent call last):
    ...
    kvfunc.core._errors.InvalidArgumentError: unknown device 'tpu'; expected one of ...
    """
    if device is None:
        device = "auto"
    if isinstance(device, torch.device):
        kind, index = device.type, device.index
    elif isinstance(device, str):
        kind, _, rest = device.strip().lower().partition(":")
        index = None
        if rest:
            if not rest.isdigit():
                msg = f"bad device index in {device!r}: expected '<kind>:<int>'"
                raise InvalidArgumentError(msg)
            index = int(rest)
    else:
        msg = f"device must be a str, a torch.device or None, but got {device!r}"
        raise InvalidTypeError(msg)
    if kind == "auto" and index is None:
        if _npu_installed():
            try:
                return _npu_device(None)
            except DeviceError:
                pass
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if kind == "cpu":
        return torch.device("cpu")
    if kind == "cuda":
        if not torch.cuda.is_available():
            msg = f"device {str(device)!r} asked for, but CUDA is not available in this torch"
            raise DeviceError(msg)
        return _check_index("cuda", index, torch.cuda.device_count())
    if kind == "npu":
        return _npu_device(index)
    msg = f"unknown device {str(device)!r}; expected one of {list(_KINDS)} (with ':<index>')"
    raise InvalidArgumentError(msg)


def is_accelerator(device: torch.device) -> bool:
    """True for devices whose memory is not the host's (anything but the CPU).

    >>> is_accelerator(torch.device("cpu")), is_accelerator(torch.device("cuda"))
    (False, True)
    """
    return device.type != "cpu"


def torch_dtype(dtype: object) -> torch.dtype:
    """The ``torch.dtype`` of a cache entry's dtype (a ``torch.dtype`` or a name).

    Names are torch's attribute names (``"bfloat16"``, ``"torch.float32"``) or
    the short config names ``fp32``, ``fp16``, ``bf16``, ``fp64``, ``fp8``.

    Raises:
        InvalidArgumentError: the name is not a torch dtype.

    >>> torch_dtype("bf16"), torch_dtype("torch.float32"), torch_dtype(torch.int8)
    (torch.bfloat16, torch.float32, torch.int8)
    >>> torch_dtype("float128")
    Traceback (most recent call last):
    ...
    kvfunc.core._errors.InvalidArgumentError: unknown dtype 'float128': ...
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        name = dtype.strip().lower().removeprefix("torch.")
        found = getattr(torch, _DTYPE_ALIASES.get(name, name), None)
        if isinstance(found, torch.dtype):
            return found
    msg = f"unknown dtype {dtype!r}: expected a torch.dtype or a name such as 'bfloat16' or 'fp16'"
    raise InvalidArgumentError(msg)
