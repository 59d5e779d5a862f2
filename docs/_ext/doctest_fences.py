"""Griffe extension for the reference: docstring examples become code blocks.

kvfunc's docstrings are Google style with bare doctest examples (``>>>``
lines, checked by ``pytest --doctest-modules``) and the odd reStructuredText
role.  Markdown would read an example's output such as ``(1, 2)`` as text and
``[a][b]`` as a link, so before mkdocstrings renders a docstring this extension
wraps every run of example lines in a ``pycon`` fence and turns roles such as
``:func:`replay``` into inline code.  The docstrings themselves stay as they are.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj|const):`~?([^`]+)`")
_FENCE = "```"


def fence_examples(text: str) -> str:
    """Wrap each doctest example run (``>>>`` up to a blank line) in a pycon fence.

    Lines already inside a fenced block are left alone.
    """
    out: list[str] = []
    in_fence = in_example = False
    for line in text.splitlines():
        stripped = line.strip()
        if in_example and not stripped:
            out.append(_FENCE)
            in_example = False
        elif not in_example and not in_fence and stripped.startswith(">>>"):
            out.append(_FENCE + "pycon")
            in_example = True
        elif not in_example and stripped.startswith(_FENCE):
            in_fence = not in_fence
        out.append(line)
    if in_example:
        out.append(_FENCE)
    return "\n".join(out)


def rewrite(text: str) -> str:
    """``fence_examples`` plus reStructuredText roles as inline code."""
    return fence_examples(_ROLE.sub(lambda m: f"`{m.group(1)}`", text))


class DoctestFences(griffe.Extension):
    """Rewrite the docstring of every object of a package once it is loaded."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        seen: set[int] = set()
        stack: list[griffe.Object] = [pkg]
        while stack:
            obj = stack.pop()
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            if obj.docstring is not None:
                obj.docstring.value = rewrite(obj.docstring.value)
            stack.extend(member for member in obj.members.values() if not member.is_alias)
