"""The ``kvfunc`` commands end to end: plan, simulate, replay, and bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from cli_run import run_main  # the helper beside this file

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def simulate_json(capsys: pytest.CaptureFixture[str], tmp_path: Path, *argv: str
                  ) -> dict[str, object]:
    """``kvfunc simulate --json`` with a plot and a log under tmp_path."""
    code, out, err = run_main(capsys, "simulate", "--json", "--plot", str(tmp_path / "u.png"),
                              "--record", str(tmp_path / "run.jsonl"), *argv)
    assert (0, "") == (code, err)
    result: dict[str, object] = json.loads(out)
    return result


def test_plan_prints_a_row_per_manager_key(capsys: pytest.CaptureFixture[str]) -> None:
    """The table has a row for each key, the budget line and the source URL."""
    code, out, _ = run_main(capsys, "plan", "--preset", "gpt-oss-120b", "--memory", "80GiB")
    needles = ("SlidingWindow", "FullAttention", "72.00 GiB for KV caches",
               "https://huggingface.co/openai/gpt-oss-120b/blob/main/config.json")
    assert (0, True) == (code, all(n in out for n in needles))


def test_plan_json_is_machine_readable(capsys: pytest.CaptureFixture[str]) -> None:
    """--json gives blocks, tokens and bytes per key."""
    code, out, _ = run_main(capsys, "plan", "--preset", "llama-3-8b", "--memory", "64GiB",
                            "--json")
    data = json.loads(out)
    (group,) = data["groups"]
    assert (0, "FullAttention", 29491, 471840, 57) == (
        code, group["manager_key"], group["num_blocks"], group["tokens"],
        data["max_concurrency"])


def test_plan_counts_weights_only_when_told(capsys: pytest.CaptureFixture[str]) -> None:
    """--used-memory comes out of the budget."""
    _, out, _ = run_main(capsys, "plan", "--preset", "llama-3-8b", "--memory", "64GiB",
                         "--used-memory", "16GB", "--json")
    budget = json.loads(out)["budget"]
    assert int(64 * 2**30 * 0.9 - 16 * 10**9) == budget["cache_budget_bytes"]


def test_plan_custom_model_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """--model reads a JSON model file."""
    model = {"name": "tiny", "max_model_len": 4096, "layers": [{"repeat": 4, "caches": [
        {"name": "kv", "dim": 128, "num_head": 1, "dtype": "bf16", "block_size": 32}]}]}
    (tmp_path / "tiny.json").write_text(json.dumps(model))
    code, out, _ = run_main(capsys, "plan", "--model", str(tmp_path / "tiny.json"),
                            "--memory", "1GiB", "--json")
    # 0.9 GiB / (4 layers x 128 x 2 bytes) tokens, in blocks of 32.
    assert (0, int(0.9 * 2**30) // 1024 // 32) == (code, json.loads(out)["groups"][0]["num_blocks"])


@pytest.mark.parametrize(("argv", "needle"), [
    (["plan", "--preset", "llama-4", "--memory", "64GiB"], "unknown preset 'llama-4'"),
    (["plan", "--preset", "qwen3-next-80b", "--memory", "4GiB"],
     "window and state caches alone take 9.28 GiB at --concurrency 64"),
    (["plan", "--preset", "llama-3-8b", "--memory", "1GiB", "--max-prefill-tokens", "9000"],
     "lower --max-prefill-tokens"),
    (["plan", "--preset", "llama-3-8b", "--memory", "1GiB", "--offline-max-len", "99999"],
     "lower --offline-max-len"),
    (["plan", "--preset", "llama-3-8b", "--memory", "lots"], "is not a size"),
    (["plan", "--preset", "llama-3-8b", "--memory", "1GiB", "--used-memory", "2GiB"],
     "--used-memory"),
    (["plan", "--preset", "llama-3-8b", "--memory", "1GiB", "--mem-fraction", "1.5"],
     "--mem-fraction must lie in (0, 1]"),
    (["plan", "--preset", "llama-3-8b"], "the following arguments are required: --memory"),
    (["plan", "--preset", "llama-3-8b", "--memory", "1GiB", "--concurrency", "x"],
     "invalid int value: 'x'"),
    (["simulate", "--preset", "llama-3-8b", "--memory", "8MiB"], "raise --memory"),
    (["simulate", "--trace", "nope"], "unknown trace 'nope'"),
    (["simulate", "--requests", "0"], "--requests must be a positive integer"),
    (["replay", "missing.jsonl"], "cannot read log 'missing.jsonl'"),
])
def test_bad_input_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str],
                                          needle: str) -> None:
    """Bad input: exit code 2, one line on stderr naming the problem, no traceback."""
    code, out, err = run_main(capsys, *argv)
    assert (2, "", 1, True, False) == (code, out, len(err.strip().splitlines()), needle in err,
                                       "Traceback" in err)


@pytest.mark.parametrize(("rows", "needle"), [
    ("TIMESTAMP,ContextTokens\n2023-11-16 18:15:46,10\n", "lacks column(s) ['GeneratedTokens']"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,-10,5\n",
     "ContextTokens must be a positive integer, got '-10'"),
])
def test_malformed_trace_file_exits_2(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                      rows: str, needle: str) -> None:
    """A trace CSV with a missing column or a negative count is refused in one line."""
    path = tmp_path / "trace.csv"
    path.write_text(rows)
    code, _, err = run_main(capsys, "simulate", "--trace", str(path), "--no-plot")
    assert (2, 1, True) == (code, len(err.strip().splitlines()), needle in err)


def test_simulate_json_plot_and_log(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """simulate writes a PNG, a log, and a JSON summary with per-group usage."""
    data = simulate_json(capsys, tmp_path, "--requests", "300", "--memory", "1.5GiB")
    groups = data["groups"]
    assert isinstance(groups, list)
    assert (300, ["SlidingWindow", "FullAttention"], PNG_MAGIC, False) == (
        data["served"], [g["manager_key"] for g in groups],
        (tmp_path / "u.png").read_bytes()[:8], data["prefix_caching"])


def test_simulate_synthetic_trace_under_pressure(capsys: pytest.CaptureFixture[str],
                                                 tmp_path: Path) -> None:
    """A small cache and a fast synthetic trace force preemptions; all requests still finish."""
    data = simulate_json(capsys, tmp_path, "--preset", "llama-3-8b", "--trace", "synthetic",
                         "--requests", "120", "--memory", "3GiB", "--speedup", "4")
    assert (120, True) == (data["served"], int(str(data["preemptions"])) > 0)


def test_replay_verifies_a_recorded_log(capsys: pytest.CaptureFixture[str],
                                        tmp_path: Path) -> None:
    """kvfunc replay on an untouched log exits 0 and says OK."""
    simulate_json(capsys, tmp_path, "--preset", "deepseek-v3", "--memory", "4GiB",
                  "--requests", "100", "--no-plot")
    code, out, _ = run_main(capsys, "replay", str(tmp_path / "run.jsonl"))
    assert (0, True) == (code, out.startswith("kvfunc replay: OK:"))


def corrupt(path: Path, edit: str) -> None:
    """Change one thing in a recorded log."""
    lines = path.read_text().splitlines()
    if edit == "block":  # the first delta that takes blocks hands out a different one
        i = next(i for i, line in enumerate(lines) if '"appended_block_ids"' in line)
        record = json.loads(lines[i])
        record["delta"]["appended_block_ids"][-1] += 1
        lines[i] = json.dumps(record)
    elif edit == "final":  # the recorded free queue has two blocks swapped
        record = json.loads(lines[-1])
        free = record["final"]["groups"][-1]["free"]
        free[0], free[1] = free[1], free[0]
        lines[-1] = json.dumps(record)
    elif edit == "drop":  # a delta goes missing
        i = next(i for i, line in enumerate(lines) if '"freed_block_ids"' in line)
        del lines[i]
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize(("edit", "needle"), [
    ("block", "does not apply"),
    ("final", "the replayed free queue differs from the recorded final state at position 0"),
    ("drop", "does not apply"),
])
def test_replay_fails_on_a_corrupted_log(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                         edit: str, needle: str) -> None:
    """A changed block id, final state or missing delta makes replay exit 1 with the reason."""
    simulate_json(capsys, tmp_path, "--requests", "60", "--no-plot")
    corrupt(tmp_path / "run.jsonl", edit)
    code, out, err = run_main(capsys, "replay", str(tmp_path / "run.jsonl"))
    assert (1, "", True, True) == (code, out, err.startswith("kvfunc replay: FAILED:"),
                                   needle in err)


def test_replay_blames_the_line_where_the_log_and_the_state_part_ways(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A delta that frees one block twice fails at its own line, not at a later one."""
    simulate_json(capsys, tmp_path, "--requests", "60", "--no-plot")
    path = tmp_path / "run.jsonl"
    lines = path.read_text().splitlines()
    i = next(i for i, line in enumerate(lines) if '"freed_block_ids"' in line)
    record = json.loads(lines[i])
    delta = record["delta"]
    delta["freed_block_ids"].append(delta["freed_block_ids"][0])
    delta["freed_keys"].append(delta["freed_keys"][0])
    delta["order"] += "F"
    lines[i] = json.dumps(record)
    path.write_text("\n".join(lines) + "\n")
    code, _, err = run_main(capsys, "replay", str(path))
    assert (1, True) == (code, f"delta at line {i + 1} " in err), err


@pytest.mark.parametrize("step", [-1, "back", 2.5, "7", None, True, "9" * 100_000])
def test_replay_checks_the_step_numbers(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                        step: object) -> None:
    """A step number that goes back, or is not a non-negative int, is a malformed log."""
    simulate_json(capsys, tmp_path, "--requests", "60", "--no-plot")
    path = tmp_path / "run.jsonl"
    lines = path.read_text().splitlines()
    i = next(i for i in range(2, len(lines) - 1) if json.loads(lines[i - 1])["step"] > 0)
    record = json.loads(lines[i])
    record["step"] = json.loads(lines[i - 1])["step"] - 1 if step == "back" else step
    lines[i] = json.dumps(record)
    path.write_text("\n".join(lines) + "\n")
    code, _, err = run_main(capsys, "replay", str(path))
    assert (2, True, True, 1) == (code, f"line {i + 1}:" in err, "never decrease" in err,
                                  len(err.strip().splitlines())), err
    assert len(err) < 400, err


def test_replay_of_a_truncated_log_exits_2(capsys: pytest.CaptureFixture[str],
                                           tmp_path: Path) -> None:
    """A log cut short (no final record) is bad input, not a mismatch."""
    simulate_json(capsys, tmp_path, "--requests", "30", "--no-plot")
    path = tmp_path / "run.jsonl"
    path.write_text("\n".join(path.read_text().splitlines()[:-1]) + "\n")
    code, _, err = run_main(capsys, "replay", str(path))
    assert (2, True) == (code, "without its final-state record" in err)


def test_default_simulate_runs_as_a_program(tmp_path: Path) -> None:
    """`kvfunc simulate` with no arguments replays the packaged sample and writes its plot."""
    env = {**os.environ, "COLUMNS": "120"}
    proc = subprocess.run([sys.executable, "-m", "kvfunc.cli", "simulate"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, env=env, check=False)
    needles = ("gpt-oss-120b", "served 3,000", "SlidingWindow", "allocator time per step")
    assert (0, True, PNG_MAGIC) == (proc.returncode, all(n in proc.stdout for n in needles),
                                    (tmp_path / "kvfunc-simulate.png").read_bytes()[:8])
