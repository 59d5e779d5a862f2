"""What a new user meets first: --version, defaults that work, one block convention, docs."""

from __future__ import annotations

import importlib.metadata
import json
import re
import sys
import tomllib
from pathlib import Path

import pytest

import kvfunc
from kvfunc.cli import (
    Budget,
    PlanConfig,
    model_from_mapping,
    plan_model,
    preset_names,
)

sys.path.insert(0, str(Path(__file__).parent))
from cli_run import run_main  # the helper beside this file

ROOT = Path(__file__).resolve().parents[2]


def test_version_is_the_packages(capsys: pytest.CaptureFixture[str]) -> None:
    """kvfunc --version prints the installed version, which is kvfunc.__version__."""
    code, out, _ = run_main(capsys, "--version")
    expected = f"kvfunc {importlib.metadata.version('kvfunc')}\n"
    assert (0, expected, kvfunc.__version__) == (code, out, importlib.metadata.version("kvfunc"))


@pytest.mark.parametrize("preset", preset_names())
def test_every_preset_simulates_at_its_default_memory(capsys: pytest.CaptureFixture[str],
                                                      preset: str) -> None:
    """simulate --preset NAME without --memory runs (qwen3-next-80b gets 12 GiB)."""
    code, out, err = run_main(capsys, "simulate", "--preset", preset, "--requests", "30",
                              "--no-plot", "--json")
    assert (0, "") == (code, err)
    assert json.loads(out)["served"] + json.loads(out)["rejected"] == 30


@pytest.mark.parametrize(("argv", "gib"), [
    (("--trace", "conv"), 2.5),
    (("--trace", "mooncake-conversation"), 24),
    (("--trace", "mooncake-synthetic", "--preset", "qwen3-next-80b"), 24),
    (("--trace", "synthetic", "--preset", "qwen3-next-80b"), 12),
    (("--trace", "mooncake-conversation", "--memory", "3GiB"), 3),
])
def test_default_memory_is_the_largest_that_applies(capsys: pytest.CaptureFixture[str],
                                                    argv: tuple[str, ...], gib: float) -> None:
    """Without --memory a Mooncake trace gets 24 GiB (its prompts are long), a preset that
    needs more gets its own, the larger wins; --memory always wins."""
    code, out, err = run_main(capsys, "simulate", *argv, "--requests", "2", "--no-plot",
                              "--json")
    assert (0, "", int(gib * 2**30)) == (code, err, json.loads(out)["memory_bytes"])


def test_help_says_what_memory_a_preset_needs(capsys: pytest.CaptureFixture[str]) -> None:
    """simulate --help names the larger defaults and the models and traces that need them."""
    code, out, _ = run_main(capsys, "simulate", "--help")
    text = " ".join(out.split())
    assert (0, True, True, True) == (code, "12GiB for qwen3-next-80b" in text,
                                     "24GiB on --trace mooncake-conversation" in text,
                                     "24GiB on --trace mooncake-synthetic" in text)


def test_plan_counts_usable_blocks(capsys: pytest.CaptureFixture[str]) -> None:
    """The table says 'usable blocks'; JSON keeps num_blocks and adds usable_blocks."""
    argv = ("plan", "--preset", "llama-3-8b", "--memory", "64GiB")
    _, table, _ = run_main(capsys, *argv)
    _, out, _ = run_main(capsys, *argv, "--json")
    (group,) = json.loads(out)["groups"]
    assert (True, 29490, 29491) == ("usable" in table and "29,490" in table,
                                    group["usable_blocks"], group["num_blocks"])


def test_replay_reports_usable_blocks(capsys: pytest.CaptureFixture[str],
                                      tmp_path: Path) -> None:
    """An empty final cache is '0 of N usable blocks', not '1/N+1'."""
    log = str(tmp_path / "run.jsonl")
    run_main(capsys, "simulate", "--preset", "llama-3-8b", "--memory", "8GiB", "--requests",
             "20", "--no-plot", "--record", log)
    code, out, _ = run_main(capsys, "replay", log, "--json")
    assert (0, {"FullAttention": {"used": 0, "usable": 3685}}) == (code, json.loads(out)["usage"])


def test_the_documented_model_file_plans_as_the_page_says() -> None:
    """The TOML example of docs/reference/model-file.md gives the table printed below it."""
    page = (ROOT / "docs" / "reference" / "model-file.md").read_text(encoding="utf-8")
    toml = re.search(r"```toml\n(.*?)```", page, re.S)
    assert toml is not None
    model = model_from_mapping(tomllib.loads(toml.group(1)), source="toy-hybrid.toml")
    report = plan_model(model, PlanConfig(Budget(8 * 2**30), concurrency=16))
    rows = [(g.manager_key, f"{g.num_blocks - 1:,}") for g in report.groups]
    assert [("FullAttention", "25,309"), ("SlidingWindow", "4,112"), ("Mamba", "16")] == rows
    assert all(re.search(rf"{key} .*│ +{blocks} │", page) for key, blocks in rows)


def test_the_notebooks_extra_installs_a_front_end() -> None:
    """pyproject's notebooks extra has JupyterLab and a kernel; the notebooks README names it."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extra = project["optional-dependencies"]["notebooks"]
    readme = (ROOT / "notebooks" / "README.md").read_text()
    assert (True, True, True) == (any(r.startswith("jupyterlab") for r in extra),
                                  any(r.startswith("ipykernel") for r in extra),
                                  'pip install -e ".[notebooks]"' in readme)
