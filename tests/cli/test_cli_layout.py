"""``kvfunc simulate --layout shared|per-type``: sizing, admission, usage per pool, sweeps."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import attrs
import pytest

from kvfunc.cli import (
    Budget,
    CLIError,
    Scheduler,
    SchedulerConfig,
    SimulationConfig,
    TraceRequest,
    build_preset,
    build_state,
    default_layout,
    load_trace,
    preset_names,
    run_simulation,
    run_sweep,
)
from kvfunc.core import FullAttention, KVState, SlidingWindow, check_invariants

sys.path.insert(0, str(Path(__file__).parent))
from cli_run import run_main  # the helpers beside this file
from test_cli_hostile import assert_one_line_exit_2

GIB = 2**30
DEFAULTS = {"deepseek-v3": "per-type", "gpt-oss-120b": "shared", "llama-3-8b": "per-type",
            "qwen3-next-80b": "per-type"}


def hybrid(layout: str, requests: int = 20, memory: float = 8) -> SimulationConfig:
    """gpt-oss-120b (window + full attention) on the first conversation requests, 8 running
    at once in chunks of 512 tokens (a per-type window pool of 8 requests' windows)."""
    return SimulationConfig(build_preset("gpt-oss-120b"),
                            load_trace("mooncake-conversation", limit=requests),
                            Budget(int(memory * GIB)), concurrency=8, max_batched_tokens=512,
                            layout=layout)


def test_every_preset_has_its_default_layout() -> None:
    """shared for a model of several groups, per-type for one group, and per-type for
    qwen3-next-80b, whose recurrent state would leave most of a shared page unused."""
    assert DEFAULTS == {name: default_layout(build_preset(name)) for name in preset_names()}


@pytest.mark.parametrize(("preset", "memory"), [("gpt-oss-120b", "4GiB"),
                                                ("llama-3-8b", "4GiB")])
def test_the_command_runs_the_default_layout_and_says_so(
        capsys: pytest.CaptureFixture[str], preset: str, memory: str) -> None:
    """Without --layout, --json names the preset's default layout and has one pool per pool."""
    code, out, err = run_main(capsys, "simulate", "--preset", preset, "--memory", memory,
                              "--requests", "20", "--no-plot", "--json")
    data = json.loads(out)
    pools = 1 if DEFAULTS[preset] == "shared" else len(data["groups"])
    assert (0, "", DEFAULTS[preset], pools) == (code, err, data["layout"], len(data["pools"]))


def test_both_layouts_are_accepted_for_a_one_group_model(
        capsys: pytest.CaptureFixture[str]) -> None:
    """--layout shared and --layout per-type both run llama-3-8b, to the same counters."""
    runs = [json.loads(run_main(capsys, "simulate", "--preset", "llama-3-8b", "--memory",
                                "4GiB", "--requests", "20", "--no-plot", "--json",
                                "--layout", layout)[1]) for layout in ("shared", "per-type")]
    assert (["shared", "per-type"], runs[1]["served"], runs[1]["steps"]) == (
        [r["layout"] for r in runs], runs[0]["served"], runs[0]["steps"])


@pytest.mark.parametrize(("argv", "needle"), [
    (("--layout", "bogus"), "argument --layout: invalid choice: 'bogus'"),
    (("--layout",), "argument --layout: expected one argument"),
    (("--layout", "both"), "--layout both applies to --capacity-sweep"),
])
def test_a_bad_layout_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str],
                                              argv: tuple[str, ...], needle: str) -> None:
    """A layout that is not one, or both without a sweep: one line, exit 2, nothing run."""
    code, _, err = run_main(capsys, "simulate", "--requests", "5", "--no-plot", *argv)
    assert_one_line_exit_2(code, err, needle)


@pytest.mark.parametrize("layout", ["both", "", None, 1, "Shared"])
def test_simulation_config_refuses_a_bad_layout(layout: object) -> None:
    """The library's check: a CLIError that shows the bad value."""
    with pytest.raises(CLIError, match="--layout must be one of shared, per-type, got"):
        hybrid(layout)  # type: ignore[arg-type]


def test_a_shared_pool_that_does_not_fit_says_what_to_change(
        capsys: pytest.CaptureFixture[str]) -> None:
    """qwen3-next-80b's page is 181 of its attention blocks: at 12 GiB a shared pool cannot
    hold the states and a prefill, and the error says so and names the way out."""
    code, _, err = run_main(capsys, "simulate", "--preset", "qwen3-next-80b", "--layout",
                            "shared", "--requests", "5", "--no-plot")
    assert (2, 1, True) == (code, len(err.strip().splitlines()), "--layout per-type" in err)


def test_build_state_sizes_one_pool_for_every_group() -> None:
    """shared: one pool of calculate_shared_block_num's blocks, every group in it; per-type:
    a pool per group; the shared pool's blocks cost the same memory as the per-type pools."""
    shared, per_type = build_state(hybrid("shared")), build_state(hybrid("per-type"))
    assert ([("shared", ("SlidingWindow", "FullAttention"))], ["SlidingWindow", "FullAttention"],
            True) == ([(p.name, p.members) for p in shared.pools],
                      [p.name for p in per_type.pools],
                      abs(shared.pools[0].num_blocks - sum(p.num_blocks
                                                           for p in per_type.pools)) <= 2)


def test_shared_hits_at_least_as_much_as_per_type_on_a_hybrid_model() -> None:
    """On the same requests and memory, the shared pool keeps the windows' cached blocks that
    the per-type window pool (sized for --concurrency requests) hands out again at once."""
    shared, per_type = (run_simulation(hybrid(layout)) for layout in ("shared", "per-type"))
    assert shared.prefix is not None and per_type.prefix is not None
    assert (20, 20, True, True) == (
        shared.counters["served"], per_type.counters["served"],
        shared.prefix.hit_tokens > per_type.prefix.hit_tokens > 0,
        shared.prefix.hit_rate <= shared.prefix.bound.hit_rate)


@pytest.mark.parametrize("layout", ["shared", "per-type"])
def test_usage_is_per_pool_and_never_over_capacity(monkeypatch: pytest.MonkeyPatch,
                                                   layout: str) -> None:
    """Usage has one series per pool, within its usable blocks at every step; the pool's
    blocks in use are what the groups hold, counted once; invariants hold (checked every
    tenth step: the run takes thousands)."""
    step, held = Scheduler.step, []

    def checked_step(sched: Scheduler) -> bool:
        more = step(sched)
        if sched.steps % 10:
            return more
        check_invariants(sched.state)
        for pool in sched.state.pools:
            blocks = {b for g in sched.state.groups if sched.state.pools[g.pool] is pool
                      for t in g.tables.values() for b in t if b}
            held.append(len(blocks) == pool.num_blocks - 1 - pool.num_free)
        return more

    monkeypatch.setattr(Scheduler, "step", checked_step)
    result = run_simulation(hybrid(layout, requests=12, memory=3))
    capacity = [u.num_blocks - 1 for u in result.pools]
    assert (len(result.final_state.pools), True, True, True) == (
        len(result.usage), bool(held) and all(held),
        all(0 <= n <= c for used, c in zip(result.usage, capacity, strict=True) for n in used),
        all(u.peak_blocks > 0 for u in result.pools)), result.counters


def test_a_one_group_model_runs_alike_in_both_layouts() -> None:
    """deepseek-v3 has one group: the same blocks, hits, counters and usage either way."""
    def run(layout: str) -> tuple[object, ...]:
        r = run_simulation(SimulationConfig(
            build_preset("deepseek-v3"), load_trace("mooncake-conversation", limit=40),
            Budget(12 * GIB), layout=layout))
        assert r.prefix is not None
        return (list(r.num_blocks.values()), r.counters, r.prefix.hit_tokens, r.usage,
                r.steps, [u.num_blocks for u in r.pools])

    assert run("per-type") == run("shared")


def test_a_request_longer_than_the_window_pool_is_served_in_chunks() -> None:
    """A window pool smaller than a request's blocks still serves it: prefilled chunk by
    chunk, a window group holds its window and a chunk at a time (the check on arrival
    folds the request in chunks too, instead of taking it whole)."""
    state = KVState.create({"full": FullAttention(num_blocks=200, block_size=16),
                            "swa": SlidingWindow(num_blocks=20, block_size=16,
                                                 sliding_window=32)}, 4096,
                           enable_prefix_caching=True)
    sched = Scheduler(state, [TraceRequest(0.0, 1500, 20), TraceRequest(0.0, 2800, 5)],
                      SchedulerConfig(max_batched_tokens=128))
    while sched.step():
        check_invariants(sched.state)
    assert (2, 0) == (sched.finished, sched.rejected)


def test_a_shared_run_records_a_log_that_replays(capsys: pytest.CaptureFixture[str],
                                                 tmp_path: Path) -> None:
    """--record on a shared pool: the header names the pool, and kvfunc replay verifies it."""
    log = tmp_path / "run.jsonl"
    code, _, _ = run_main(capsys, "simulate", "--trace", "mooncake-conversation",
                          "--requests", "15", "--memory", "3GiB", "--no-plot",
                          "--record", str(log))
    header = json.loads(log.read_text().splitlines()[0])
    rc, out, _ = run_main(capsys, "replay", str(log), "--json")
    assert (0, [["SlidingWindow", "FullAttention"]], 0, ["shared"]) == (
        code, [p["members"] for p in header["pools"]], rc, list(json.loads(out)["usage"]))


def test_a_sweep_of_both_layouts_has_a_curve_each(tmp_path: Path) -> None:
    """run_sweep(layouts=both): every memory in each layout, grouped by layout; the JSON
    carries both, and the plot draws both curves."""
    from kvfunc.cli import plot_sweep

    sweep = run_sweep(hybrid("shared", requests=12), points=2, jobs=1,
                      layouts=("shared", "per-type"))
    data = sweep.to_json()
    memory = [p.memory_bytes for p in sweep.curve("shared")]
    assert (["shared", "per-type"], ["shared"] * 2 + ["per-type"] * 2, True) == (
        data["layouts"], [p["layout"] for p in data["points"]],
        memory == [p.memory_bytes for p in sweep.curve("per-type")])
    assert b"\x89PNG" == plot_sweep(sweep, tmp_path / "s.png").read_bytes()[:4]


def test_the_command_sweeps_both_layouts(capsys: pytest.CaptureFixture[str]) -> None:
    """--capacity-sweep 2 --layout both: four points, two per layout, in --json."""
    code, out, err = run_main(capsys, "simulate", "--trace", "mooncake-conversation",
                              "--requests", "10", "--capacity-sweep", "2", "--layout", "both",
                              "--jobs", "1", "--no-plot", "--json")
    data = json.loads(out)
    assert (0, "", ["shared", "per-type"], 4) == (code, err, data["layouts"],
                                                  len(data["points"]))


@pytest.mark.parametrize("layout", ["shared", "per-type"])
def test_disaggregated_runs_take_a_layout(capsys: pytest.CaptureFixture[str],
                                          layout: str) -> None:
    """--disaggregated 1:1 --layout L: both sides run L, usage per pool on each instance."""
    code, out, err = run_main(capsys, "simulate", "--trace", "mooncake-conversation",
                              "--requests", "12", "--memory", "6GiB", "--disaggregated", "1:1",
                              "--layout", layout, "--no-plot", "--json")
    data = json.loads(out)
    pools = 1 if layout == "shared" else 2
    assert (0, "", layout, 12, [pools], [pools]) == (
        code, err, data["layout"], data["served"],
        [len(i) for i in data["prefill"]["pools"]], [len(i) for i in data["decode"]["pools"]])


def test_a_layout_is_part_of_the_config() -> None:
    """attrs.evolve can switch a config's layout; a bad one is refused there too."""
    cfg = hybrid("shared")
    with pytest.raises(CLIError):
        attrs.evolve(cfg, layout="pooled")
    assert "per-type" == attrs.evolve(cfg, layout="per-type").layout
