"""``kvfunc`` run in-process, for the command-line tests."""

from __future__ import annotations

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
