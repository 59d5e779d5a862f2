"""The documentation site builds with ``mkdocs build --strict``.

Strict mode turns every warning into a failure: a broken link or anchor, a page
missing from the navigation, a reference entry that does not resolve, or a
docstring the reference cannot render.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BUILD_TIMEOUT_S = 300


def _load_fences():  # the griffe extension lives with the docs, not in a package
    spec = importlib.util.spec_from_file_location(
        "doctest_fences", ROOT / "docs" / "_ext" / "doctest_fences.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    """The site builds without a single warning, every section present."""
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                           str(site)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=BUILD_TIMEOUT_S, check=False)
    assert 0 == proc.returncode, proc.stdout + proc.stderr
    pages = ["tutorial/first-cache", "how-to/scheduler", "how-to/attention-type",
             "how-to/prefill-decode", "explanation/why-pure", "explanation/atomicity",
             "explanation/null-block", "explanation/performance", "reference/transitions"]
    assert [] == [page for page in pages if not (site / page / "index.html").is_file()]
    transitions = (site / "reference" / "transitions" / "index.html").read_text()
    assert 'id="kvfunc.allocate_slots"' in transitions


def test_docstring_examples_become_pycon_fences() -> None:
    """The reference's griffe extension fences doctest runs and turns roles into code."""
    fences = _load_fences()
    text = "Frees it (see :func:`~kvfunc.replay`).\n\n>>> f(1)\n(1, [2])\n\nAfter."
    expected = ("Frees it (see `kvfunc.replay`).\n\n```pycon\n>>> f(1)\n(1, [2])\n```\n\n"
                "After.")
    assert expected == fences.rewrite(text)


def test_fenced_blocks_are_left_alone() -> None:
    """Examples already inside a fenced block are not fenced twice."""
    fences = _load_fences()
    text = "```python\n>>> f(1)\n1\n```"
    assert text == fences.fence_examples(text)
