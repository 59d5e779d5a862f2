"""The API reference documents every public name, and nothing that is not public."""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "docs" / "reference"
PACKAGES = ["kvfunc", "kvfunc.compat", "kvfunc.shell", "kvfunc.cli", "kvfunc.testing",
            "kvfunc.events", "kvfunc.vllm", "kvfunc.vllm.harness"]
if importlib.util.find_spec("kvfunc.datadist") is not None:
    PACKAGES.append("kvfunc.datadist")

# "::: target" starts an entry; an indented "heading: name" in its options names it
# (used where the object lives under a private path, such as a lazily imported one).
DIRECTIVE = re.compile(r"^::: (?P<target>\S+)[ \t]*\n(?P<options>(?:[ ]{4}.*\n?)*)", re.M)
HEADING = re.compile(r"^\s+heading:\s*(?P<name>\S+)\s*$", re.M)


def documented_names() -> dict[str, str]:
    """``{public dotted name: page}`` of every entry of the reference pages."""
    names = {}
    for page in sorted(REFERENCE.glob("*.md")):
        for match in DIRECTIVE.finditer(page.read_text(encoding="utf-8")):
            heading = HEADING.search(match.group("options"))
            names[heading.group("name") if heading else match.group("target")] = page.name
    return names


@pytest.mark.parametrize("package", PACKAGES)
def test_every_public_name_has_an_entry(package: str) -> None:
    """Each name in the package's ``__all__`` has a ``:::`` entry on a reference page."""
    public = importlib.import_module(package).__all__
    documented = documented_names()
    assert [] == [name for name in public if f"{package}.{name}" not in documented]


def test_every_entry_names_a_public_name() -> None:
    """No entry documents a name that its package does not export (a stale entry)."""
    stale = []
    for name, page in documented_names().items():
        package, _, attr = name.rpartition(".")
        if package not in PACKAGES or attr not in importlib.import_module(package).__all__:
            stale.append(f"{page}: {name}")
    assert [] == stale
