"""Run the code examples of one documentation page, in order, in one namespace.

Usage: ``python tests/docs/run_doc_examples.py docs/PAGE.md [--doctests-only]``.

* A fenced ``pycon`` block is a doctest (``>>>`` prompts and expected output),
  checked with ``ELLIPSIS`` and ``NORMALIZE_WHITESPACE``.
* A fenced ``python`` block is executed as a script, unless ``--doctests-only``.
* Any other block (``console``, ``text``, ``toml``...) is not run.

Later blocks see the names earlier blocks defined, as a reader following the
page would.  Exit status 0 when every example passed, 1 otherwise; failures are
printed with the page and line.  The test suite runs each page in its own
interpreter, so that a page which registers a policy cannot affect another.
"""

from __future__ import annotations

import doctest
import re
import sys
import traceback
from pathlib import Path

FENCE = re.compile(r"^(?P<indent>[ ]*)```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ ]*$",
                   re.S | re.M)
RUN_LANGS = ("python", "pycon")


def code_blocks(text: str) -> list[tuple[str, int, str]]:
    """``(language, first line number of the code, code)`` of every fenced block."""
    blocks = []
    for match in FENCE.finditer(text):
        indent = len(match.group("indent"))
        body = "".join(line[indent:] + "\n" for line in match.group("body").splitlines())
        line = text.count("\n", 0, match.start("body")) + 1
        blocks.append((match.group("lang"), line, body))
    return blocks


def run_page(path: Path, *, doctests_only: bool = False) -> int:
    """Run the page's examples; returns the number of failures (printed to stdout)."""
    globs: dict[str, object] = {"__name__": f"docs:{path.name}"}
    parser = doctest.DocTestParser()
    runner = doctest.DocTestRunner(
        optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    failures = 0
    for lang, line, code in code_blocks(path.read_text(encoding="utf-8")):
        if lang == "pycon":
            test = parser.get_doctest(code, globs, f"{path}:{line}", str(path), line - 1)
            failures += runner.run(test, clear_globs=False).failed
            globs.update(test.globs)  # a DocTest runs on a copy of the namespace
        elif lang == "python" and not doctests_only:
            try:
                exec(compile(code, f"{path}:{line}", "exec"), globs)
            except Exception:
                failures += 1
                print(f"{path}:{line}: the python block raised")
                traceback.print_exc(file=sys.stdout)
    return failures


def main(argv: list[str]) -> int:
    """Command-line entry point (see the module docstring)."""
    path = Path(argv[0])
    failures = run_page(path, doctests_only="--doctests-only" in argv[1:])
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
