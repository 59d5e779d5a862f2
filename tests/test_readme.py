"""The README's quick starts run as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
SNIPPETS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


@pytest.mark.parametrize("code", SNIPPETS, ids=[f"snippet{i}" for i in range(len(SNIPPETS))])
def test_readme_snippet_runs(code: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Each python block of the README executes without error."""
    exec(compile(code, str(README), "exec"), {})
    assert capsys.readouterr().out


def test_readme_names_the_ci_test_command() -> None:
    """The test command in the README (with vLLM's tests) is the one .ci/run executes."""
    ci = (README.parent / ".ci" / "run").read_text()
    for command in ("ruff check . && mypy && python -m pytest && bash .ci/vllm-suite.sh",
                    "bash .ci/vllm-env.sh", "bash .ci/vllm-tests.sh .vllm-tests",
                    'KVFUNC_VLLM_TESTS="$PWD/.vllm-tests"'):
        assert (command, True, True) == (command, command in README.read_text(),
                                         command in ci)
