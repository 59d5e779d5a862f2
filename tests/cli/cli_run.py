"""``kvfunc`` run in-process, for the command-line tests."""

from __future__ import annotations

import contextlib
import io

import pytest

from kvfunc.cli import main


def run_main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Run ``kvfunc argv`` in-process; returns (exit code, stdout, stderr)."""
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse: usage errors, --help, --version
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def run_captured(*argv: str) -> tuple[int, str, str]:
    """:func:`run_main` without a pytest fixture (for Hypothesis tests, which run many
    examples per test): the output is captured by redirecting the streams."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as exc:
            code = int(exc.code or 0)
    return code, out.getvalue(), err.getvalue()
