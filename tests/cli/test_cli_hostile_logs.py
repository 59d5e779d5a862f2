"""``kvfunc replay`` and ``simulate --record`` under attack: one line, exit 1 or 2, never a trace.

A real log has every one of its JSON values replaced, one at a time, by
junk; the replay either still verifies (the value did not matter), reports
a mismatch (exit 1) or refuses the log (exit 2), always in one short line.
Writing a log or the output to a full disk is one line and exit 2 too.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))
from cli_run import run_captured, run_main  # the helpers beside this file

JSON_JUNK = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2 ** 70), 2 ** 70), st.floats(),
              st.text(max_size=6)),
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(st.text(max_size=4), inner, max_size=3)),
    max_leaves=5)


def run(argv: list[str]) -> tuple[int, str, str]:
    """``kvfunc argv`` in-process, its output captured; (exit code, stdout, stderr)."""
    return run_captured(*argv)


def record(path: Path, *extra: str) -> list[Any]:
    """Simulate a few requests with ``--record path``; the log's records."""
    code, _, err = run(["simulate", "--preset", "llama-3-8b", "--requests", "6", "--no-plot",
                        "--json", "--record", str(path), *extra])
    assert 0 == code, err
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def log_records(tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    """The records of one real log (header, deltas, final state)."""
    return record(tmp_path_factory.mktemp("log") / "run.jsonl")


def replay_records(records: list[Any]) -> tuple[int, str]:
    """Write ``records`` as a log and run ``kvfunc replay`` on it: (exit code, stderr)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "run.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        code, _, err = run(["replay", str(path)])
    return code, err


def paths(value: Any, at: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path to a value inside a JSON document (the document itself too)."""
    found = [at]
    if isinstance(value, dict):
        for k, v in value.items():
            found += paths(v, (*at, k))
    elif isinstance(value, list):
        for i, v in enumerate(value[:6]):  # the first few items of a long list are enough
            found += paths(v, (*at, i))
    return found


def replaced(doc: Any, path: tuple[Any, ...], value: Any) -> Any:
    """A copy of ``doc`` with the value at ``path`` replaced."""
    if not path:
        return value
    copy = dict(doc) if isinstance(doc, dict) else list(doc)
    copy[path[0]] = replaced(doc[path[0]], path[1:], value)
    return copy


def assert_one_line(code: int, err: str) -> None:
    """Exit 0, or 1 or 2 with one short line on stderr and no traceback."""
    lines = err.strip().splitlines()
    assert code in (0, 1, 2) and "Traceback" not in err, err
    if code:
        assert 1 == len(lines) and len(err) < 600, err


@given(data=st.data(), value=JSON_JUNK)
def test_any_value_of_a_log_replaced_by_junk_is_one_line(log_records: list[Any], data: Any,
                                                        value: Any) -> None:
    """Junk anywhere in a real log (header, a delta, the final state): one line, exit 0-2."""
    line = data.draw(st.integers(0, len(log_records) - 1))
    path = data.draw(st.sampled_from(paths(log_records[line])))
    attacked = [*log_records[:line], replaced(log_records[line], path, value),
                *log_records[line + 1:]]
    assert_one_line(*replay_records(attacked))


def test_the_log_replays_as_recorded(log_records: list[Any]) -> None:
    """The unattacked log verifies (so the attacks above start from a good log)."""
    assert (0, "") == replay_records(log_records)


@pytest.mark.parametrize(("where", "value", "code", "needle"), [
    ("kvfunc_delta_log", True, 2, "not a kvfunc delta log header"),
    ("kvfunc_delta_log", 2.0, 2, "not a kvfunc delta log header"),
    ("num_deltas", True, 2, "num_deltas is not an int"),
    ("num_deltas", "5", 2, "num_deltas is not an int"),
    ("num_deltas", -1, 1, "its final record says -1"),
    ("final", [1], 2, "the final record is not an object"),
    ("final", "done", 2, "the final record is not an object"),
    ("final", None, 2, "the final record is not an object"),
], ids=["bool version", "float version", "bool count", "str count", "wrong count",
        "final a list", "final a str", "final null"])
def test_the_issues_log_cases_are_one_line(log_records: list[Any], where: str, value: Any,
                                           code: int, needle: str) -> None:
    """A bool version or count is not a number; a final record that is not an object: one line."""
    records = [dict(r) for r in log_records]
    if where == "kvfunc_delta_log":
        records[0][where] = value
    elif where == "num_deltas":
        records[-1] = {"final": {**records[-1]["final"], where: value}}
    else:
        records[-1] = {"final": value}
    got, err = replay_records(records)
    assert (code, True) == (got, needle in err), err
    assert_one_line(got, err)


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_recording_to_a_full_disk_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """simulate --record /dev/full: the disk fills, one line and exit 2, no traceback."""
    code, _, err = run_main(capsys, "simulate", "--preset", "llama-3-8b", "--requests", "6",
                            "--no-plot", "--json", "--record", "/dev/full")
    assert (2, 1, True) == (code, len(err.strip().splitlines()),
                            "cannot write the log '/dev/full': No space left on device" in err)


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize("argv", [
    ["plan", "--preset", "llama-3-8b", "--memory", "16GiB"],
    ["plan", "--preset", "llama-3-8b", "--memory", "16GiB", "--json"],
])
def test_output_to_a_full_disk_is_one_line(argv: list[str]) -> None:
    """stdout on /dev/full: one line naming the failure and exit 2, nothing else."""
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", "kvfunc.cli", *argv], stdout=full,
                              stderr=subprocess.PIPE, text=True, timeout=120, check=False)
    assert (2, [f"kvfunc {argv[0]}: error: No space left on device"]) == (
        proc.returncode, proc.stderr.strip().splitlines())
