"""Layering rules: the core stays pure and runs on pyrsistent's C extension."""

from __future__ import annotations

import subprocess
import sys


def _modules_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    return set(out.stdout.split())


def test_core_never_imports_torch() -> None:
    """Importing kvfunc.core (and the top-level package) loads no torch module."""
    loaded = _modules_after("import kvfunc.core, kvfunc")
    assert set() == {m for m in loaded if m == "torch" or m.startswith("torch.")}
    assert "kvfunc.core" in loaded


def test_pyrsistent_runs_with_its_c_extension() -> None:
    """pvector is the C implementation (pvectorc): the hot path is 2-6x slower without it."""
    import pvectorc  # noqa: F401  (an ImportError here is the failure)
    from pyrsistent import pvector

    assert "pvectorc" == type(pvector([1])).__module__
