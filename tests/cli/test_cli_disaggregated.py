"""``kvfunc simulate --disaggregated P:D``: the hand-over, its registries, its times, its report."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kvfunc.cli import (
    Budget,
    SimulationConfig,
    Trace,
    TraceRequest,
    build_preset,
    load_trace,
    run_simulation,
)
from kvfunc.cli._disagg import DisaggConfig, Quantiles, parse_bandwidth
from kvfunc.cli._disagg_run import _Run, run_disaggregated
from kvfunc.core import KVState, allocate_slots, check_invariants, get_block_ids

sys.path.insert(0, str(Path(__file__).parent))
from cli_run import run_main  # the helpers beside this file
from test_cli_hostile import assert_one_line_exit_2

GIB = 2**30


def base(trace: Trace, memory: int = 24 * GIB, preset: str = "deepseek-v3",
         **settings: object) -> SimulationConfig:
    """The colocated settings a disaggregated run starts from."""
    return SimulationConfig(build_preset(preset), trace, Budget(memory), **settings)  # type: ignore[arg-type]


def tiny(*requests: TraceRequest) -> Trace:
    """A trace of the given requests."""
    return Trace("tiny", f"{len(requests)} requests", tuple(requests))


def drive(config: DisaggConfig) -> _Run:
    """Run ``config`` event by event, checking registries against instances after each."""
    run = _Run(config)
    while run.advance():
        run.check()
    for inst in (*run.prefill, *run.decode):
        check_invariants(inst.state)
    run.ledger.check(set(), set())
    return run


def test_one_to_one_serves_what_the_colocated_run_serves() -> None:
    """On a conversation slice whose longest requests do not fit, 1:1 serves and rejects
    exactly the requests the colocated run does, under the same memory per instance."""
    cfg = base(load_trace("mooncake-conversation", limit=100), memory=4 * GIB)
    colocated = run_simulation(cfg)
    result = run_disaggregated(DisaggConfig(cfg, 1, 1))
    c = result.counters
    assert (colocated.counters["served"], colocated.counters["rejected"], True) == (
        c["served"], c["rejected"], c["rejected"] > 0), c


@pytest.mark.parametrize(("prefill", "decode"), [(1, 1), (2, 1), (1, 3)])
def test_registries_hold_what_the_instances_hold_after_every_event(prefill: int,
                                                                  decode: int) -> None:
    """Under pressure (small caches, a slow link), every key on a prefill instance is a
    request awaiting its pull whose blocks are still held there, every decode cache a request
    on that instance; the run waits for room and for the link, and ends with nothing held."""
    cfg = DisaggConfig(base(load_trace("mooncake-conversation", limit=90), memory=12 * GIB),
                       prefill, decode, link_bandwidth=3 * 10**9)
    run = drive(cfg)
    waits = run.waits
    assert (90, True, True, True) == (
        run.served, len(waits["link"]) == run.ledger.done,
        any(w > 0 for w in waits["link"]), decode > 1 or any(w > 0 for w in waits["room"]))


def test_bytes_moved_are_the_prompts_live_blocks() -> None:
    """A transfer moves the prompt's blocks that the decode side reads: on gpt-oss-120b every
    full-attention block and only the window's live ones, at each group's bytes per block."""
    prompt = 1000
    cfg = base(tiny(TraceRequest(0.0, prompt, 4)), memory=80 * GIB, preset="gpt-oss-120b")
    result = run_disaggregated(DisaggConfig(cfg, 1, 1))
    run = _Run(DisaggConfig(cfg, 1, 1))
    state: KVState = allocate_slots(run.prefill[0].state, 0, 0, prompt).state
    ids = get_block_ids(state, 0)
    expected = sum(run.block_bytes[key] * sum(1 for b in blocks if b) for key, blocks in
                   ids.items())
    window_live = sum(1 for b in ids["SlidingWindow"] if b)
    assert (expected, True) == (result.transfers.bytes_moved,
                                window_live < len(ids["FullAttention"])), ids


def test_a_transfer_takes_the_bytes_over_the_bandwidth_and_ends_the_first_token() -> None:
    """One request: the prefill takes one step, the pull bytes/bandwidth, and the time to
    first token is their sum; decode steps of 20 ms with MTP 1 space tokens 10 ms apart."""
    cfg = base(tiny(TraceRequest(0.0, 1000, 9)))
    rate = 10**9
    result = run_disaggregated(DisaggConfig(cfg, 1, 1, link_bandwidth=rate))
    took = result.transfers.bytes_moved / rate
    lat = result.latency
    assert (pytest.approx(0.02 + took), pytest.approx(took), 0.01, 0.0) == (
        lat.ttft.p50, result.transfers.transfer.p50, lat.tbt.p50, result.transfers.wait_link.max)


def test_a_decode_instance_without_room_makes_the_transfer_wait() -> None:
    """One decode seat: the second prefill is done after 40 ms but waits for the seat until the
    first request's last decode step ends; its blocks stay on the prefill side meanwhile."""
    reqs = (TraceRequest(0.0, 100, 50), TraceRequest(0.0, 100, 50))
    cfg = base(tiny(*reqs), preset="llama-3-8b", concurrency=1)
    run = drive(DisaggConfig(cfg, 1, 1))
    first_pull_end = 0.02 + run.waits["transfer"][0]
    first_done = first_pull_end + 49 * 0.02  # 49 tokens after the prefill's, one per step
    assert (pytest.approx(first_done - 0.04), 2, 0) == (
        run.waits["room"][1], run.served, sum(1 for w in run.waits["room"][:1] if w))


def test_the_router_sends_a_conversation_back_to_its_prefix() -> None:
    """With two prefill instances a later turn goes where its prefix is cached, even when that
    instance is the busier one; a request with no hit goes to the less loaded one.  The hit is
    the first turn's full 64-token blocks."""
    turn1 = TraceRequest(0.0, 1500, 2, (1, 2, 3))
    other = TraceRequest(0.0, 1500, 2, (7, 8, 9))
    busy = TraceRequest(4.0, 9000, 2, tuple(range(20, 38)))
    turn2 = TraceRequest(4.0, 2000, 2, (1, 2, 3, 4))
    run = drive(DisaggConfig(base(tiny(turn1, other, busy, turn2)), 2, 1))
    hits = run.prefix.hit_tokens if run.prefix else 0
    assert ([0, 1, 0, 0], 1500 // 64 * 64) == (run.origin, hits)


def test_one_output_token_is_served_by_the_prefill_side_alone() -> None:
    """A request of one output token finishes when its prefill does: nothing is transferred."""
    result = run_disaggregated(DisaggConfig(base(tiny(TraceRequest(0.0, 300, 1))), 1, 1))
    assert (1, 1, 0, 0) == (result.counters["served"], result.counters["finished_on_prefill"],
                            result.transfers.count, result.transfers.bytes_moved)


def test_quantiles_weigh_each_value_by_its_count() -> None:
    """p50 and p99 are the values at those ranks, duplicates counted, like the colocated ones."""
    assert (Quantiles(2.0, 1.0, 5.0, 5.0), Quantiles(0.0, 0.0, 0.0, 0.0)) == (
        Quantiles.of([1.0] * 3 + [5.0]), Quantiles.of([]))


@pytest.mark.parametrize(("text", "rate"), [
    ("25GB/s", 25 * 10**9), ("25 GB / s", 25 * 10**9), ("1.5TB/s", 15 * 10**11),
    ("200Gbit/s", 25 * 10**9), ("400Gbps", 5 * 10**10), ("1GiB/s", 2**30),
    ("5000000", 5 * 10**6), ("100TB/s", 10**14),
])
def test_bandwidths_read_in_bytes_or_bits(text: str, rate: int) -> None:
    """Decimal and binary byte units, bit units and plain numbers (bytes per second)."""
    assert rate == parse_bandwidth(text)


@pytest.mark.parametrize("trace", ["mooncake-conversation", "mooncake-synthetic"])
def test_the_command_reports_both_sides_in_json_and_writes_the_plot(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, trace: str) -> None:
    """On a slice of each Mooncake trace, --json carries per side usage, preemptions and hit
    rate, the transfers with their waits, TTFT and TBT, and the plot is a PNG."""
    plot = tmp_path / "d.png"
    code, out, err = run_main(capsys, "simulate", "--preset", "deepseek-v3", "--trace", trace,
                              "--requests", "40", "--disaggregated", "2:1", "--json",
                              "--plot", str(plot))
    data = json.loads(out)
    p, d, t, lat = data["prefill"], data["decode"], data["transfers"], data["latency"]
    assert (0, "", 2, 1, b"\x89PNG") == (code, err, p["instances"], d["instances"],
                                       plot.read_bytes()[:4])
    assert {"preemptions", "refused_allocations", "pools", "prefix_cache"} <= p.keys() & d.keys()
    assert (True, None, data["served"] - data["finished_on_prefill"]) == (
        0 <= p["prefix_cache"]["hit_rate"] <= 1, d["prefix_cache"], t["count"])
    assert {"bytes_moved", "wait_room_ms", "wait_link_ms", "transfer_ms"} <= t.keys()
    assert {"p50", "p99"} <= lat["ttft_ms"].keys() & lat["tbt_ms"].keys()


def test_the_command_prints_the_report(capsys: pytest.CaptureFixture[str],
                                       tmp_path: Path) -> None:
    """The text report names both sides, the bytes moved and the waits, and both latencies."""
    code, out, _ = run_main(capsys, "simulate", "--preset", "deepseek-v3", "--trace",
                            "mooncake-conversation", "--requests", "20", "--disaggregated",
                            "1:2", "--link-bandwidth", "200Gbit/s", "--no-plot")
    needles = ("prefill side:", "decode side:", "KV moved", "waiting for decode room",
               "waiting for the link", "time to first token", "time between tokens",
               "links 25 GB/s")
    assert (0, []) == (code, [n for n in needles if n not in out])


@pytest.mark.parametrize(("argv", "needle"), [
    (["--disaggregated", "1"], "--disaggregated takes P:D, prefill and decode instances"),
    (["--disaggregated", "1:1:1"], "--disaggregated takes P:D"),
    (["--disaggregated", "a:b"], "--disaggregated takes P:D"),
    (["--disaggregated", "1.5:1"], "--disaggregated takes P:D"),
    (["--disaggregated", "-1:1"], "got '-1:1'"),
    (["--disaggregated", "9" * 5000 + ":1"], "like 1:1 or 2:1; got '9999"),
    (["--disaggregated", "0:1"], "'0:1' needs at least one prefill and one decode instance"),
    (["--disaggregated", "1:0"], "'1:0' needs at least one prefill and one decode instance"),
    (["--disaggregated", "1000000:1"], "at most 32 instances on either side"),
    (["--disaggregated", "1:33"], "at most 32 instances on either side"),
    (["--disaggregated", "1:1", "--link-bandwidth", "0"], "is 0 bytes/s; it must lie between"),
    (["--disaggregated", "1:1", "--link-bandwidth", "-5GB/s"], "'-5GB/s' is negative"),
    (["--disaggregated", "1:1", "--link-bandwidth", "1B/s"], "is 1 bytes/s; it must lie"),
    (["--disaggregated", "1:1", "--link-bandwidth", "1000000TB/s"], "it must lie between"),
    (["--disaggregated", "1:1", "--link-bandwidth", "9" * 5000], "is not a bandwidth"),
    (["--disaggregated", "1:1", "--link-bandwidth", "nan"], "is not a bandwidth"),
    (["--disaggregated", "1:1", "--link-bandwidth", "inf"], "is not a bandwidth"),
    (["--disaggregated", "1:1", "--link-bandwidth", "fast"], "is not a bandwidth"),
    (["--disaggregated", "1:1", "--link-bandwidth", "1e9"], "is not a bandwidth"),
    (["--disaggregated", "1:1", "--link-bandwidth", "25Gb/s"], "bits or bytes?"),
    (["--link-bandwidth", "25GB/s"], "--link-bandwidth applies to --disaggregated runs"),
    (["--disaggregated", "1:1", "--capacity-sweep"], "--capacity-sweep runs one instance"),
    (["--disaggregated", "1:1", "--record", "x.jsonl"], "a --disaggregated run has many"),
    (["--disaggregated", "32:32", "--preset", "llama-3-8b", "--memory", "1TB"],
     "kvfunc simulates at most 4,194,304 in all"),
    (["--disaggregated", "1:1", "--memory", "80TB", "--block-size", "16"],
     "kvfunc simulates at most 2,097,152"),
])
def test_hostile_disaggregated_flags(capsys: pytest.CaptureFixture[str],
                                     monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                     argv: list[str], needle: str) -> None:
    """Bad P:D forms, zero, huge counts, negative, tiny, absurd or unreadable bandwidths, and
    flags that do not go together: one line, exit 2, before anything large is built."""
    monkeypatch.chdir(tmp_path)
    code, _, err = run_main(capsys, "simulate", "--no-plot", "--trace", "mooncake-conversation",
                            "--requests", "5", *argv)
    assert_one_line_exit_2(code, err, needle)
