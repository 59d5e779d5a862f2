"""Inputs a hostile user would try: each ends in one line and exit 2, in bounded time and memory."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvfunc import DELTA_VERSION
from kvfunc.cli._log import LOG_VERSION

sys.path.insert(0, str(Path(__file__).parent))
from cli_run import run_main  # the helper beside this file

NEST = 100_000
MAMBA_ONLY = """
name = "states"
max_model_len = 4096
[[layers]]
repeat = 8
caches = [{ name = "state", attn_type = "Mamba", shape = [4096, 4096], dtype = "float32" }]
"""


def model_toml(**overrides: str) -> str:
    """A one-group model file; ``overrides`` replace parts of its text."""
    text = """
name = "toy"
max_model_len = 4096
[[layers]]
repeat = REPEAT
caches = [
  { name = "k", attn_type = "FullAttention", dim = DIM, num_head = 8, dtype = "bfloat16", \
block_size = BLOCK },
]
"""
    values = {"REPEAT": "2", "DIM": "128", "BLOCK": "16", **overrides}
    for key, value in values.items():
        text = text.replace(key, value)
    return text


def assert_one_line_exit_2(code: int, err: str, needle: str) -> None:
    """Exit 2, one short line on stderr that names the problem, no traceback."""
    lines = err.strip().splitlines()
    assert (2, 1, True, True) == (code, len(lines), needle in err, len(err) < 400), err


def write(tmp_path: Path, name: str, content: str | bytes) -> str:
    """A file under tmp_path; returns its path."""
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return str(path)


@pytest.mark.parametrize(("name", "content", "needle"), [
    ("nested.toml", 'name = "x"\nmax_model_len = 8\nlayers = ' + "[" * NEST + "]" * NEST,
     "nests too deeply"),
    ("nested.json", "[" * NEST + "]" * NEST, "nests too deeply"),
    ("latin1.toml", b'name = "\xff\xfe"\n', "is not UTF-8 text (byte 0xff at offset 8)"),
    ("huge-repeat.toml", model_toml(REPEAT=str(2**63 - 1)),
     "repeat must be an integer from 1 to 4,096, got 9223372036854775807"),
    ("many-layers.toml", model_toml(REPEAT="10000000"),
     "repeat must be an integer from 1 to 4,096, got 10000000"),
    ("empty-dim.toml", model_toml(DIM="[]"), "dim must be an integer or a list of 1 to 8"),
    ("huge-dim.toml", model_toml(DIM=str(10**30)), "dim must be an integer from 1 to"),
    ("float-block.toml", model_toml(BLOCK="16.0"), "block_size must be an integer from 1 to"),
    ("long-name.toml", 'name = "' + "n" * 100_000 + '"\nmax_model_len = 8\n[[layers]]\n'
     'caches = [{ name = "k", dim = 1, num_head = 1, dtype = "fp8", block_size = 1 }]\n',
     "name must be a string of 1 to 200 characters"),
    ("big.toml", "# " + "x" * 2**21, "is larger than 1 MiB, the most kvfunc reads"),
])
def test_hostile_model_files(capsys: pytest.CaptureFixture[str], tmp_path: Path, name: str,
                             content: str | bytes, needle: str) -> None:
    """Nesting, encodings, huge counts and sizes, empty dims, long fields: one line, exit 2."""
    code, _, err = run_main(capsys, "plan", "--model", write(tmp_path, name, content),
                            "--memory", "1GiB")
    assert_one_line_exit_2(code, err, needle)


def test_a_model_of_states_alone_is_checked_against_the_budget(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Only Mamba caches, more than the budget: the plan says so (the sizing alone does not)."""
    code, _, err = run_main(capsys, "plan", "--model", write(tmp_path, "m.toml", MAMBA_ONLY),
                            "--memory", "1GiB")
    assert_one_line_exit_2(code, err, "states's window and state caches alone take 32.50 GiB")


@pytest.mark.parametrize(("argv", "needle"), [
    (["--memory", "1000TB"], "the cache would hold 1,525,878,906 blocks; kvfunc simulates at"),
    (["--memory", "80TB"], "kvfunc simulates at most 2,097,152"),
    (["--memory", "99999999999999999999TB"], "is more than 1 EiB"),
    (["--memory", "-5GiB"], "--memory '-5GiB' is negative"),
    (["--memory", "9" * 5000], "is not a size"),
    (["--used-memory", "-1GB"], "--used-memory '-1GB' is negative"),
    (["--mem-fraction", "nan"], "--mem-fraction must lie in (0, 1]"),
    (["--speedup", "inf"], "--speedup must be a number from 1e-06 to 1e+06"),
    (["--step-ms", "-1e3"], "--step-ms must be a number from 1e-06 to 1e+06"),
    (["--concurrency", str(10**400)], "--concurrency must be an integer from 1 to 1,048,576"),
    (["--max-model-len", str(2**40)], "--max-model-len must be at most 16,777,216"),
    (["--mtp", "1000000"], "--mtp must be an integer from 0 to 16"),
    (["--block-size", "-16"], "--block-size must be an integer from 1 to 16,777,216"),
    (["--preset", "x" * 100_000], "unknown preset 'xxxxxxxx"),
    (["--trace", "synthetic", "--requests", str(10**9)], "more than the synthetic trace makes"),
    (["--trace", "mooncake-conversation", "--requests", "5", "--capacity-sweep", "1"],
     "--capacity-sweep takes 2 to 64 points, got 1"),
    (["--capacity-sweep", "3"], "--capacity-sweep needs prefix caching on a trace that names"),
    (["--capacity-sweep", "--record", "x.jsonl"], "--record logs one run"),
])
def test_hostile_flags(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                       tmp_path: Path, argv: list[str], needle: str) -> None:
    """Budgets past the block bound, absurd sizes and counts, negatives, long values: exit 2."""
    monkeypatch.chdir(tmp_path)
    code, _, err = run_main(capsys, "simulate", "--no-plot", *argv)
    assert_one_line_exit_2(code, err, needle)


def test_a_tiny_block_with_gigabytes_hits_the_block_bound(capsys: pytest.CaptureFixture[str],
                                                          tmp_path: Path) -> None:
    """One byte a token in blocks of one token: 10 GB would be 9e9 blocks; refused at once."""
    tiny = model_toml(DIM="1", BLOCK="1", REPEAT="1").replace("num_head = 8", "num_head = 1")
    tiny = tiny.replace("bfloat16", "fp8")
    code, _, err = run_main(capsys, "simulate", "--model", write(tmp_path, "t.toml", tiny),
                            "--memory", "10GB", "--no-plot")
    assert_one_line_exit_2(code, err, "the cache would hold 9,000,000,000 blocks")


@pytest.mark.parametrize(("name", "content", "needle"), [
    ("wide.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n1," + "9" * 200_000 + ",3\n",
     "near line 2: not a CSV row (field larger than field limit (131072))"),
    ("nul.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n1,2\x00,3\n",
     "ContextTokens must be a positive integer"),
    ("latin1.csv", b"TIMESTAMP,ContextTokens,GeneratedTokens\n\xff,1,1\n",
     "is not UTF-8 text (byte 0xff at offset 40)"),
    ("long.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n1,2,3\n" + "1,2,3\n" * 12_000_000,
     "is larger than 64 MiB"),
    ("broken.jsonl.gz", b"\x1f\x8b\x08\x00garbage", "is a broken gzip file"),
    ("deep.jsonl", "[" * NEST + "]" * NEST, "the JSON is nested too deeply"),
])
def test_hostile_trace_files(capsys: pytest.CaptureFixture[str], tmp_path: Path, name: str,
                             content: str | bytes, needle: str) -> None:
    """Long fields, NUL bytes, non-UTF-8, oversize files, broken gzip, nesting: exit 2."""
    code, _, err = run_main(capsys, "simulate", "--trace", write(tmp_path, name, content),
                            "--no-plot")
    assert_one_line_exit_2(code, err, needle)


@pytest.mark.skipif(not Path("/dev/zero").exists(), reason="needs /dev/zero")
@pytest.mark.parametrize("argv", [
    ["simulate", "--trace", "/dev/zero", "--no-plot"],
    ["plan", "--model", "/dev/zero", "--memory", "1GiB"],
    ["replay", "/dev/zero"],
])
def test_endless_files_are_refused_within_a_memory_limit(argv: list[str]) -> None:
    """/dev/zero as a trace, a model or a log: one line and exit 2 under a 1.5 GiB address cap."""
    capped = ("import resource, runpy, sys; limit = 3 * 2**29; "
              "resource.setrlimit(resource.RLIMIT_AS, (limit, limit)); "
              "sys.argv = ['kvfunc', *sys.argv[1:]]; "
              "runpy.run_module('kvfunc.cli', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", capped, *argv], capture_output=True, text=True,
                          timeout=120, check=False)
    needle = "a line longer than 32 MiB" if argv[0] == "replay" else "the most kvfunc reads"
    assert_one_line_exit_2(proc.returncode, proc.stderr, needle)


HUGE_HEADER = json.dumps({"kvfunc_delta_log": LOG_VERSION, "delta_version": DELTA_VERSION,
                          "max_model_len": 64, "groups": [
                              {"key": "f", "policy": "FullAttention",
                               "params": {"num_blocks": 2**40, "block_size": 16}}]})


@pytest.mark.parametrize(("content", "needle"), [
    ("[" * NEST + "]" * NEST + "\n", "line 1: not valid JSON"),
    (b'{"kvfunc_delta_log": "\xff"}\n', "is not UTF-8 text"),
    (HUGE_HEADER + "\n", "the cache would hold 1,099,511,627,776 blocks"),
])
def test_hostile_logs(capsys: pytest.CaptureFixture[str], tmp_path: Path, content: str | bytes,
                      needle: str) -> None:
    """A nested, undecodable or impossibly large log header: one line, exit 2."""
    code, _, err = run_main(capsys, "replay", write(tmp_path, "run.jsonl", content))
    assert_one_line_exit_2(code, err, needle)


def test_an_unwritable_plot_fails_before_the_simulation(capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """--plot into a missing folder is refused before any work is done."""
    def never(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("the simulation ran")

    monkeypatch.setattr("kvfunc.cli._main.run_simulation", never)
    monkeypatch.setattr("kvfunc.cli._main.load_trace", never)
    code, _, err = run_main(capsys, "simulate", "--plot", "/nonexistent/dir/x.png")
    assert_one_line_exit_2(code, err, "cannot write --plot '/nonexistent/dir/x.png'")


def test_a_plot_path_that_is_a_folder_is_refused(capsys: pytest.CaptureFixture[str],
                                                 tmp_path: Path) -> None:
    """--plot naming a directory is refused up front, and the folder is left alone."""
    code, _, err = run_main(capsys, "simulate", "--plot", str(tmp_path))
    assert_one_line_exit_2(code, err, "it is a directory")


def test_more_requests_than_the_trace_has_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    """--requests 10000 on the 3,000-row sample runs 3,000 and says so on stderr."""
    code, out, err = run_main(capsys, "simulate", "--requests", "10000", "--no-plot", "--json")
    data = json.loads(out)
    assert (0, 3000, True, True) == (
        code, data["requests"], "--requests 10,000 asked for more than the trace has" in err,
        "the trace has 3,000" in data["trace"])


@pytest.mark.parametrize("extra", [["--json"], []])
def test_a_closed_pipe_ends_quietly(extra: list[str]) -> None:
    """The reader going away (| head) ends the command with 141 and nothing on stderr."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvfunc.cli", "plan", "--preset", "llama-3-8b", "--memory",
         "64GiB", *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader is gone before the command writes anything
    err = proc.stderr.read()
    proc.stderr.close()
    assert (141, b"") == (proc.wait(timeout=120), err)
