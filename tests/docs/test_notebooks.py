"""The notebooks: committed without outputs, public API only, and they run top to bottom.

Each notebook is executed with nbclient in a fresh kernel, with the working
directory set to an empty temporary folder; a cell that raises, prints to
stderr (a warning, say) or runs past the timeout fails the test.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_S = 60
MAGIC = re.compile(r"^\s*[%!].*$", re.M)


def _read(path: Path) -> nbformat.NotebookNode:
    return nbformat.read(path, as_version=nbformat.NO_CONVERT)


def _code_cells(nb: nbformat.NotebookNode) -> list[nbformat.NotebookNode]:
    return [cell for cell in nb.cells if cell.cell_type == "code"]


def test_the_four_notebooks_are_there() -> None:
    """The walkthrough, capacity-planning, what-if and tiers notebooks exist, in order."""
    expected = ["01-allocation-walkthrough", "02-capacity-planning", "03-snapshots-and-what-if",
                "04-tiers"]
    assert expected == [path.stem for path in NOTEBOOKS]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_without_outputs(path: Path) -> None:
    """A committed notebook is valid and carries no outputs or execution counts."""
    nb = _read(path)
    nbformat.validate(nb)
    dirty = [i for i, cell in enumerate(nb.cells) if cell.cell_type == "code"
             and (cell.outputs or cell.execution_count is not None)]
    assert [] == dirty


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_imports_only_the_public_api(path: Path) -> None:
    """Every kvfunc name a notebook uses is in the ``__all__`` of a public package."""
    tree = ast.parse("\n".join(MAGIC.sub("", cell.source) for cell in _code_cells(_read(path))))
    aliases: dict[str, str] = {}
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "kvfunc":
                    if any(part.startswith("_") for part in alias.name.split(".")):
                        bad.append(alias.name)
                    aliases[alias.asname or alias.name] = alias.name
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "kvfunc":
            module = importlib.import_module(node.module or "")
            bad += [f"{node.module}.{a.name}" for a in node.names
                    if a.name not in module.__all__ or "._" in f".{node.module}"]
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in aliases):
            module = importlib.import_module(aliases[node.value.id])
            if node.attr not in module.__all__:
                bad.append(f"{aliases[node.value.id]}.{node.attr}")
    assert [] == sorted(set(bad))


@pytest.fixture(scope="module")
def font_cache() -> None:
    """Build matplotlib's font cache here first: its one-time notice goes to stderr."""
    from matplotlib import font_manager

    assert font_manager.fontManager.ttflist


@pytest.mark.usefixtures("font_cache")
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_runs_in_a_fresh_kernel(path: Path, tmp_path: Path) -> None:
    """Every cell runs without error or stderr output, and the notebook leaves no files."""
    nb = _read(path)
    client = NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError at the first failing cell
    problems = [(i, out.get("name", out.output_type), out.get("text", out.get("evalue", "")))
                for i, cell in enumerate(nb.cells) if cell.cell_type == "code"
                for out in cell.outputs
                if out.output_type == "error" or out.get("name") == "stderr"]
    assert [] == problems
    figures = sum("image/png" in out.get("data", {})
                  for cell in _code_cells(nb) for out in cell.outputs)
    assert figures >= 2
    assert [] == list(tmp_path.iterdir())
