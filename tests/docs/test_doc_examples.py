"""Every code example of the documentation runs and prints what the page says.

Each page runs in its own interpreter (``run_doc_examples.py``), with warnings
as errors and an empty working directory: ``pycon`` blocks are doctests,
``python`` blocks are executed, in order, in one namespace per page.  Pages
that other parts of the project write are held to their ``pycon`` blocks only.
The interpreters run side by side, one per CPU, and each page is reported as
its own test.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from run_doc_examples import code_blocks  # the runner script beside this file

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
RUNNER = Path(__file__).with_name("run_doc_examples.py")
PAGES = sorted(path for path in DOCS.rglob("*.md") if "_ext" not in path.parts)
DOCTESTS_ONLY = {"compat.md", "shell.md", "datadist.md"}  # pages written elsewhere
NEEDS_VLLM = {"how-to/vllm.md"}  # run where vLLM is installed (CI); skipped elsewhere
HAS_VLLM = importlib.util.find_spec("vllm") is not None
PAGE_TIMEOUT_S = 180


def _doctests_only(page: Path) -> bool:
    return page.relative_to(DOCS).as_posix() in DOCTESTS_ONLY


def _needs_missing_vllm(page: Path) -> bool:
    return page.relative_to(DOCS).as_posix() in NEEDS_VLLM and not HAS_VLLM


def _runnable(page: Path) -> bool:
    if _needs_missing_vllm(page):
        return False
    langs = {lang for lang, _, _ in code_blocks(page.read_text(encoding="utf-8"))}
    return "pycon" in langs or ("python" in langs and not _doctests_only(page))


def _run_page(page: Path) -> tuple[int, str, list[str]]:
    """``(exit status, output, files left behind)`` of one page's examples."""
    if not _runnable(page):
        return 0, "", []  # nothing to run: no interpreter to start
    args = [sys.executable, "-W", "error", str(RUNNER), str(page)]
    if _doctests_only(page):
        args.append("--doctests-only")
    with tempfile.TemporaryDirectory() as cwd:
        proc = subprocess.run(args, cwd=cwd, capture_output=True, text=True,
                              timeout=PAGE_TIMEOUT_S, check=False)
        left = sorted(os.listdir(cwd))
    return proc.returncode, proc.stdout + proc.stderr, left


@pytest.fixture(scope="module")
def outcomes() -> dict[Path, tuple[int, str, list[str]]]:
    """Every page's outcome, the pages run in parallel."""
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        return dict(zip(PAGES, pool.map(_run_page, PAGES), strict=True))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(DOCS).as_posix())
def test_page_examples_run(page: Path, outcomes: dict[Path, tuple[int, str, list[str]]]
                           ) -> None:
    """The page's examples pass, and they write no files."""
    if _needs_missing_vllm(page):
        pytest.skip("the page's examples need vLLM (bash .ci/vllm-env.sh)")
    status, output, left = outcomes[page]
    assert 0 == status, output
    assert [] == left


def test_examples_are_found() -> None:
    """The runner sees the tutorial's doctests (a guard against a broken fence pattern)."""
    blocks = code_blocks((DOCS / "tutorial" / "first-cache.md").read_text(encoding="utf-8"))
    assert len([lang for lang, _, _ in blocks if lang == "pycon"]) >= 8
