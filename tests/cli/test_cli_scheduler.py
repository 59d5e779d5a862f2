"""Traces and the continuous-batching scheduler on the pure allocator."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from kvfunc.cli import (
    Budget,
    CLIError,
    DeltaLogWriter,
    Scheduler,
    SchedulerConfig,
    SimulationConfig,
    TraceRequest,
    build_preset,
    load_trace,
    parse_trace_csv,
    run_simulation,
    state_content,
    verify_log,
)
from kvfunc.core import FullAttention, KVState, SlidingWindow, check_invariants, replay
from kvfunc.data import attribution, trace_sample

HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def small_state(num_blocks: int = 40) -> KVState:
    """A full-attention and a sliding-window group of 16-token blocks."""
    return KVState.create({"full": FullAttention(num_blocks=num_blocks, block_size=16),
                           "swa": SlidingWindow(num_blocks=200, block_size=16,
                                                sliding_window=32)}, max_model_len=1024)


def run(sched: Scheduler) -> list[KVState]:
    """Step to the end, checking the invariants after every step."""
    states = [sched.state]
    while sched.step():
        check_invariants(sched.state)
        states.append(sched.state)
    return states


def test_packaged_samples_are_3000_rows_with_attribution() -> None:
    """Both samples ship 3,000 rows and the CC-BY-4.0 attribution ships beside them."""
    rows = [len(trace_sample(k).read_text().splitlines()) for k in ("code", "conv")]
    assert ([3001, 3001], True, True) == (rows, "CC-BY-4.0" in attribution(),
                                          "Splitwise" in attribution())


def test_load_trace_keeps_the_first_rows_in_order() -> None:
    """--requests N keeps the first N rows; times start at 0 and never decrease."""
    trace = load_trace("code", limit=50)
    times = [r.arrival_s for r in trace.requests]
    assert (50, 0.0, True) == (len(times), times[0], times == sorted(times))


@pytest.mark.parametrize(("text", "needle"), [
    ("TIMESTAMP,ContextTokens\n1,2\n", "lacks column(s) ['GeneratedTokens']"),
    (HEADER + "1,-5,3\n", "line 2: ContextTokens must be a positive integer, got '-5'"),
    (HEADER + "1,5,0\n", "line 2: GeneratedTokens must be a positive integer, got '0'"),
    (HEADER + "yesterday,5,3\n", "TIMESTAMP 'yesterday' is neither"),
    (HEADER, "has no requests"),
])
def test_malformed_traces_are_one_line_errors(text: str, needle: str) -> None:
    """Missing columns, bad counts and bad times name the line and the value."""
    with pytest.raises(CLIError) as info:
        parse_trace_csv(text, name="t.csv")
    assert (True, 1) == (needle in str(info.value), len(str(info.value).splitlines()))


def test_unknown_trace_name_lists_the_choices(tmp_path: Path) -> None:
    """A name that is neither a trace nor a CSV path says what is accepted."""
    with pytest.raises(CLIError) as info:
        load_trace("chat")
    assert ("use code, conv, mooncake-conversation, mooncake-synthetic, synthetic, or the path "
            "of a .csv or .jsonl file") in str(info.value)


def test_two_requests_prefill_then_decode() -> None:
    """Prefill samples the first token; each decode step one more; then both are freed."""
    sched = Scheduler(small_state(), [TraceRequest(0.0, 40, 3), TraceRequest(0.0, 20, 2)],
                      SchedulerConfig(max_batched_tokens=256))
    states = run(sched)
    first = states[1]
    assert ((1, 2, 3), (4, 5), 3, 5, 39) == (
        first.group("full").tables[0], first.group("full").tables[1], sched.steps,
        sched.generated_tokens, states[-1].pool_of("full").num_free)


def test_admission_is_fifo_and_waits_for_memory() -> None:
    """A head that does not fit blocks the requests behind it, even small ones."""
    reqs = [TraceRequest(0.0, 400, 50), TraceRequest(0.0, 300, 5), TraceRequest(0.0, 16, 1)]
    sched = Scheduler(small_state(40), reqs, SchedulerConfig(max_batched_tokens=1024))
    sched.step()
    assert ([0], [1, 2], 0) == (sched.running, list(sched.waiting), sched.preemptions)


def test_growth_preempts_the_youngest_and_everything_is_served() -> None:
    """When a running request cannot grow, the youngest is preempted and recomputed later."""
    reqs = [TraceRequest(0.0, 200, 200), TraceRequest(0.0, 200, 200), TraceRequest(0.0, 100, 50)]
    sched = Scheduler(small_state(40), reqs, SchedulerConfig(max_batched_tokens=1024))
    run(sched)
    assert (3, 0, True, True) == (sched.finished, sched.rejected, sched.preemptions > 0,
                                  sched.recomputed_tokens > 0)


def test_too_long_requests_are_rejected() -> None:
    """Longer than max_model_len, or larger than the whole cache: rejected, never run."""
    reqs = [TraceRequest(0.0, 1000, 100), TraceRequest(0.0, 700, 1), TraceRequest(0.1, 10, 2)]
    sched = Scheduler(small_state(40), reqs, SchedulerConfig())
    run(sched)
    assert (2, 1) == (sched.rejected, sched.finished)


def test_deltas_replay_to_every_final_state() -> None:
    """The deltas the scheduler emits replay to its final state (preemptions included)."""
    deltas = []
    reqs = [TraceRequest(i * 0.01, 60 + 37 * i, 20 + 11 * i) for i in range(12)]
    sched = Scheduler(small_state(30), reqs, SchedulerConfig(max_batched_tokens=128),
                      on_delta=lambda step, d: deltas.append(d))
    states = run(sched)
    assert (True, states[-1]) == (sched.preemptions > 0, replay(states[0], deltas))


def test_simulation_is_deterministic() -> None:
    """Two runs of one configuration give the same counters and usage."""
    cfg = SimulationConfig(build_preset("gpt-oss-120b"), load_trace("conv", limit=150),
                           Budget(2**30), speedup=4.0)
    a, b = run_simulation(cfg), run_simulation(cfg)
    assert (a.counters, a.usage) == (b.counters, b.usage)


def test_recorded_log_verifies(tmp_path: Path) -> None:
    """A log written during a run replays to its recorded final state."""
    cfg = SimulationConfig(build_preset("qwen3-next-80b"), load_trace("synthetic", limit=60),
                           Budget(16 * 2**30), concurrency=8, speedup=8.0)
    path = tmp_path / "run.jsonl"
    with path.open("w") as out:
        result = run_simulation(cfg, record=out)
    final, count = verify_log(path)
    assert (state_content(result.final_state), True) == (state_content(final), count > 0)


def test_writer_skips_nothing_it_is_given() -> None:
    """Each written delta is one line between the header and the final record."""
    out = io.StringIO()
    writer = DeltaLogWriter(out, small_state())
    writer.close(small_state())
    assert (2, 0) == (len(out.getvalue().splitlines()), writer.num_deltas)
