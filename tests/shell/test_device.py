"""Device and dtype resolution; torch_npu is imported only when an NPU is asked for."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kvfunc import InvalidArgumentError, InvalidTypeError, KVFuncError
from kvfunc.shell import DeviceError, resolve_device, torch_dtype

# A stand-in for Ascend's adapter: it registers "npu" with torch the way torch_npu does
# (renaming the private-use backend) and records what kvfunc asks of it.
FAKE_TORCH_NPU = '''
import sys, types, torch
torch.utils.rename_privateuse1_backend("npu")
npu = types.ModuleType("torch_npu.npu")
npu.is_available = lambda: True
npu.device_count = lambda: 2
npu.current_device = lambda: 0
torch._register_device_module("npu", npu)
calls = []
def empty_with_swapped_memory(size, dtype=None, device=None):
    calls.append((tuple(size), dtype, str(device)))
    return torch.empty(size, dtype=dtype)
'''


def run_python(code: str, tmp_path: Path, with_fake_npu: bool) -> str:
    """Run ``code`` in a fresh interpreter, optionally with the fake torch_npu importable."""
    paths = [str(tmp_path)] if with_fake_npu else []
    if with_fake_npu:
        (tmp_path / "torch_npu.py").write_text(FAKE_TORCH_NPU)
    prelude = f"import sys; sys.path[:0] = {paths!r}\n"
    proc = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert 0 == proc.returncode, proc.stderr
    return proc.stdout.strip()


def test_cpu_and_torch_device_resolve_to_cpu() -> None:
    """"cpu", " CPU ", a torch.device and None/"auto" (no accelerator here) give the CPU."""
    cpu = torch.device("cpu")
    assert [cpu] * 4 == [resolve_device("cpu"), resolve_device(" CPU "), resolve_device(cpu),
                         resolve_device("auto")]
    assert cpu == resolve_device(None)


def test_cuda_without_cuda_is_a_device_error() -> None:
    """Asking for CUDA where torch has none raises DeviceError (a RuntimeError)."""
    with pytest.raises(DeviceError, match="CUDA is not available") as info:
        resolve_device("cuda:0")
    assert isinstance(info.value, RuntimeError) and isinstance(info.value, KVFuncError)


def test_npu_without_torch_npu_names_the_missing_package(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """"npu" with torch_npu absent raises DeviceError naming torch_npu."""
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # makes the import fail
    with pytest.raises(DeviceError, match="needs the torch_npu package"):
        resolve_device("npu:1")


@pytest.mark.parametrize(("device", "error", "match"), [
    ("tpu", InvalidArgumentError, "unknown device 'tpu'"),
    ("cuda:x", InvalidArgumentError, "bad device index in 'cuda:x'"),
    ("auto:1", InvalidArgumentError, "unknown device 'auto:1'"),
    (3, InvalidTypeError, "must be a str, a torch.device or None, but got 3"),
])
def test_bad_devices_raise_typed_errors(device: object, error: type[Exception],
                                        match: str) -> None:
    """Unknown kinds, bad indices and non-device values are typed errors showing the value."""
    with pytest.raises(error, match=match):
        resolve_device(device)  # type: ignore[arg-type]


def test_torch_npu_is_imported_only_when_an_npu_is_asked_for(tmp_path: Path) -> None:
    """torch_npu loads on "npu"/"auto" only (not on import) and backs NPU swapped memory."""
    out = run_python("""
        import kvfunc, kvfunc.shell, kvfunc.compat
        print("torch_npu" in sys.modules)
        from kvfunc.shell import resolve_device
        print(resolve_device("npu:1"), "torch_npu" in sys.modules, resolve_device("auto"))
        try:
            resolve_device("npu:2")
        except RuntimeError as exc:
            print(type(exc).__name__, exc)
        import torch, torch_npu
        from kvfunc import CacheEntry, LayerCacheInfo, ModelCacheInfo
        from kvfunc.shell import with_cache_tensors
        e = CacheEntry("k", "FullAttention", 8, 2, "fp16", True, block_size=4,
                       allocator="swapped_memory")
        with_cache_tensors(ModelCacheInfo(1, [LayerCacheInfo(0, [e])]), {"FullAttention": 3},
                           "npu")
        print(torch_npu.calls)
    """, tmp_path, with_fake_npu=True)
    assert ["False", "npu:1 True npu",
            "DeviceError device 'npu:2' does not exist: 2 npu device(s) visible",
            "[((3, 4, 2, 8), torch.float16, 'npu')]"] == out.splitlines()


@pytest.mark.parametrize(("name", "dtype"), [
    ("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16), ("torch.float32", torch.float32),
    ("FP16", torch.float16), ("fp8", torch.float8_e4m3fn), ("int8", torch.int8),
    (torch.float64, torch.float64),
])
def test_dtype_names_resolve(name: object, dtype: torch.dtype) -> None:
    """Torch names, 'torch.'-prefixed names, config short names and dtypes all resolve."""
    assert dtype == torch_dtype(name)


@pytest.mark.parametrize("name", ["float128", "Tensor", "nn", 3])
def test_unknown_dtypes_raise(name: object) -> None:
    """Names that are not torch dtypes (even torch attributes) raise InvalidArgumentError."""
    with pytest.raises(InvalidArgumentError, match="unknown dtype"):
        torch_dtype(name)
