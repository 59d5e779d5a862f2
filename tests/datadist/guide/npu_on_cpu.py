"""What the guide's samples import for the NPU (``torch``, ``torchair``, ``torch_npu``), on
the CPU.

A test stand-in, imported in place of those modules, with no effect on
anything else: ``torch`` is torch with a ``npu.Event`` (an event the model
records and the layer synchronizer waits for), and
``torchair.llm_datadist.create_npu_tensors`` wraps the addresses a cache
reports (``per_device_tensor_addrs[0]``) as CPU tensors.
"""

from __future__ import annotations

import ctypes
import threading
import types

import torch as _torch


class Event:
    """``torch.npu.Event`` on the CPU: ``record()`` marks the work done, ``wait()`` waits."""

    def __init__(self) -> None:
        self._done = threading.Event()

    def record(self) -> None:
        """Mark the work before this point done."""
        self._done.set()

    def wait(self) -> None:
        """Wait (at most a minute) for :meth:`record`."""
        assert self._done.wait(60), "the event was never recorded"


def create_npu_tensors(shape: list[int], dtype: _torch.dtype, addrs: list[int]
                       ) -> list[_torch.Tensor]:
    """Tensors of ``shape`` and ``dtype`` over the memory at ``addrs`` (the cache's own)."""
    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel * _torch.empty((), dtype=dtype).element_size()
    return [_torch.frombuffer((ctypes.c_char * nbytes).from_address(a), dtype=dtype)
            .view(shape) for a in addrs]


class _TorchWithNpu:
    """``torch``, plus ``torch.npu.Event`` as :class:`Event`."""

    npu = types.SimpleNamespace(Event=Event)

    def __getattr__(self, name: str) -> object:
        return getattr(_torch, name)


torch = _TorchWithNpu()
torch_npu = types.SimpleNamespace()
torchair = types.SimpleNamespace(
    llm_datadist=types.SimpleNamespace(create_npu_tensors=create_npu_tensors))
