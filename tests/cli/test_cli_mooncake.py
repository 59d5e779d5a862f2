"""The Mooncake traces, made-up token ids, and prefix caching in the simulator."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
from pathlib import Path

import pytest

from kvfunc.cli import (
    Budget,
    CLIError,
    Scheduler,
    SimulationConfig,
    TraceRequest,
    build_preset,
    load_trace,
    run_simulation,
    verify_log,
)
from kvfunc.cli._mooncake import parse_trace_jsonl, upper_bound
from kvfunc.cli._prefix import SyntheticTokens
from kvfunc.core import BlockHashes, check_invariants
from kvfunc.data import MOONCAKE_TRACES, attribution, mooncake_license, mooncake_trace

GIB = 2**30


def line(**fields: object) -> str:
    """One Mooncake JSON line, with defaults for the fields not given."""
    record: dict[str, object] = {"timestamp": 0, "input_length": 600, "output_length": 3,
                                 "hash_ids": [1, 2]}
    record.update(fields)
    return json.dumps(record)


@pytest.mark.parametrize(("name", "count", "sha256"), [
    ("mooncake-conversation", 12031,
     "b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df"),
    ("mooncake-synthetic", 3993,
     "bd070915a98fc0ed264d7cfef2ce746002eb3076a695ec31ba2674c0111ec131"),
])
def test_packaged_traces_are_the_upstream_bytes(name: str, count: int, sha256: str) -> None:
    """Each gzip holds the upstream file byte for byte; the attribution names its digest."""
    data = gzip.decompress(mooncake_trace(name).read_bytes())
    assert (sha256, True, count) == (hashlib.sha256(data).hexdigest(), sha256 in attribution(),
                                     len(data.splitlines()))


def test_license_and_attribution_ship_with_the_traces() -> None:
    """The Apache-2.0 text and the Mooncake attribution are package data."""
    assert (True, True, ["mooncake-conversation", "mooncake-synthetic"]) == (
        mooncake_license().lstrip().startswith("Apache License"),
        "Mooncake" in attribution(), sorted(MOONCAKE_TRACES))


@pytest.mark.parametrize(("name", "rate"), [("mooncake-conversation", 0.374),
                                            ("mooncake-synthetic", 0.651)])
def test_upper_bound_of_each_trace(name: str, rate: float) -> None:
    """An infinite cache hits 37.4 % and 65.1 % of prompt tokens (the traces' README figures)."""
    assert rate == round(upper_bound(load_trace(name).requests).hit_rate, 3)


def test_same_id_same_tokens_and_a_partial_block_takes_a_prefix() -> None:
    """Id 7 gives the same 512 tokens in two prompts; a 100-token last block is their start."""
    a = SyntheticTokens((7, 8), 1024, 0, 1024)
    b = SyntheticTokens((7, 9, 8), 1124, 1, 1124)
    assert (a[:512], a[512:612]) == (b[:512], b[1024:1124])


def test_generated_tokens_are_each_requests_own() -> None:
    """Tokens after the prompt differ between requests and from every prompt token."""
    a = SyntheticTokens((7,), 10, 0, 20)[10:]
    b = SyntheticTokens((7,), 10, 1, 20)[10:]
    assert (True, True) == (not set(a) & set(b), all(t < 0 for t in a + b))


@pytest.mark.parametrize("block_size", [1, 16, 48, 64, 512, 1000])
def test_sharing_is_exact_at_any_block_size(block_size: int) -> None:
    """Prompts that share two ids share exactly their first 1,024 tokens' full blocks."""
    a = SyntheticTokens((3, 4, 5), 1400, 0, 1400)
    b = SyntheticTokens((3, 4, 6), 1400, 1, 1400)
    ha, hb = BlockHashes.of(a, block_size), BlockHashes.of(b, block_size)
    shared = sum(1 for x, y in zip(ha.hashes, hb.hashes, strict=True) if x == y)
    assert 1024 // block_size == shared


@pytest.mark.parametrize(("text", "needle"), [
    ("nope", "line 1: not valid JSON"),
    ("[1, 2]", "line 1: expected a JSON object"),
    ('{"timestamp": 0}', "line 1: missing key(s) ['input_length', 'output_length', 'hash_ids']"),
    (line(timestamp=-1), "timestamp must be a non-negative number of ms, got -1"),
    (line(timestamp=True), "timestamp must be a non-negative number of ms, got True"),
    (line(input_length=0), "input_length must be a positive integer, got 0"),
    (line(output_length="3"), "output_length must be a positive integer, got '3'"),
    (line(hash_ids=[1, -2]), "hash_ids must be a list of integers in [0, 2**53)"),
    (line(hash_ids=[1, 2**60]), "hash_ids must be a list of integers in [0, 2**53)"),
    (line(hash_ids=[1]), "input_length 600 needs 2 hash ids of 512 tokens, the line has 1"),
    (line(input_length=10**15), "input_length 1000000000000000 needs 1953125000000 hash ids"),
    ("[" * 100_000 + "]" * 100_000, "line 1: the JSON is nested too deeply"),
    (line(pad="x" * 2**20), "line 1: the line is longer than 1 MiB"),
    ("", "has no requests"),
])
def test_malformed_mooncake_lines_are_one_line_errors(text: str, needle: str) -> None:
    """Bad types, ranges, lying lengths and deep nesting name the line, in one short line."""
    with pytest.raises(CLIError) as info:
        parse_trace_jsonl(text, name="t.jsonl")
    message = str(info.value)
    assert (True, 1, True) == (needle in message, len(message.splitlines()), len(message) < 300)


def test_a_jsonl_path_is_read_as_mooncake(tmp_path: Path) -> None:
    """A .jsonl or .jsonl.gz file gives requests with their hash ids, sorted by arrival."""
    text = line(timestamp=2500) + "\n" + line(timestamp=500, hash_ids=[1, 3]) + "\n"
    (tmp_path / "t.jsonl").write_text(text)
    (tmp_path / "t.jsonl.gz").write_bytes(gzip.compress(text.encode()))
    plain, packed = load_trace(str(tmp_path / "t.jsonl")), load_trace(str(tmp_path / "t.jsonl.gz"))
    expected = (TraceRequest(0.0, 600, 3, (1, 3)), TraceRequest(2.0, 600, 3, (1, 2)))
    assert (expected, expected) == (plain.requests, packed.requests)


def mooncake_run(requests: int, memory: int, **options: object) -> object:
    """deepseek-v3 on the first requests of the conversation trace."""
    config = SimulationConfig(build_preset("deepseek-v3"),
                              load_trace("mooncake-conversation", limit=requests),
                              Budget(memory), **options)  # type: ignore[arg-type]
    return run_simulation(config)


def test_a_cache_that_evicts_nothing_reaches_the_upper_bound() -> None:
    """With room for every block, the hit rate is the trace's bound within a point, never above."""
    result = mooncake_run(400, 512 * GIB)
    p = result.prefix  # type: ignore[attr-defined]
    assert (0, True, True) == (p.evicted_blocks, p.hit_tokens <= p.bound.hit_tokens,
                               p.bound.hit_rate - p.hit_rate < 0.01)


def test_hits_and_prefill_add_up_to_the_prompts() -> None:
    """Without preemption, every prompt token is either a hit or prefilled, and deltas agree."""
    result = mooncake_run(300, 40 * GIB)
    p, c = result.prefix, result.counters  # type: ignore[attr-defined]
    assert (0, p.prompt_tokens, True) == (
        c["preemptions"], p.hit_tokens + c["prefill_tokens"], 0 < p.hit_tokens)


def test_a_preempted_request_finds_its_own_blocks_and_the_log_replays(tmp_path: Path) -> None:
    """Under pressure, recomputation hits the request's cached blocks; the log verifies."""
    config = SimulationConfig(build_preset("deepseek-v3"),
                              load_trace("mooncake-conversation", limit=80), Budget(8 * GIB))
    path = tmp_path / "run.jsonl"
    with path.open("w") as out:
        result = run_simulation(config, record=out)
    final, _ = verify_log(path)
    check_invariants(final)
    p = result.prefix
    assert p is not None
    assert (True, True, final) == (result.counters["preemptions"] > 0,
                                   p.recompute_hit_tokens > 0, result.final_state)


def test_the_deltas_count_every_hit_and_store() -> None:
    """The deltas' hit and store rows add up to the report: first admissions plus recomputes."""
    config = SimulationConfig(build_preset("deepseek-v3"),
                              load_trace("mooncake-conversation", limit=80), Budget(8 * GIB))
    out = io.StringIO()
    result = run_simulation(config, record=out)
    columns = [json.loads(text)["delta"] for text in out.getvalue().splitlines()[1:-1]]
    p = result.prefix
    assert p is not None
    assert (p.hit_tokens + p.recompute_hit_tokens, p.stored_blocks, p.evicted_blocks) == (
        sum(sum(c.get("hit_tokens", [])) for c in columns),
        sum(len(c.get("stored_keys", [])) for c in columns),
        sum(len(c.get("evicted_keys", [])) for c in columns))


def test_no_prefix_caching_prefills_everything() -> None:
    """--no-prefix-caching: no hits, nothing stored, the whole prompt prefilled."""
    result = mooncake_run(100, 40 * GIB, prefix_caching=False)
    p, c = result.prefix, result.counters  # type: ignore[attr-defined]
    assert (False, 0, 0, p.prompt_tokens) == (p.enabled, p.hit_tokens, p.stored_blocks,
                                              c["prefill_tokens"])


def test_a_rejected_request_leaves_the_bound() -> None:
    """The bound counts only admitted requests, so the run never beats it."""
    result = mooncake_run(100, 8 * GIB)
    p, c = result.prefix, result.counters  # type: ignore[attr-defined]
    everything = upper_bound(load_trace("mooncake-conversation", limit=100).requests)
    assert (1, True, True) == (c["rejected"], p.bound.prompt_tokens < everything.prompt_tokens,
                               p.hit_rate <= p.bound.hit_rate)


def test_every_step_keeps_the_invariants_with_caching(monkeypatch: pytest.MonkeyPatch) -> None:
    """A caching run under pressure passes check_invariants after every step; every block back."""
    step, checked = Scheduler.step, []

    def checked_step(sched: Scheduler) -> bool:
        more = step(sched)
        check_invariants(sched.state)
        checked.append(sched.steps)
        return more

    monkeypatch.setattr(Scheduler, "step", checked_step)
    result = mooncake_run(60, 8 * GIB)
    final, c = result.final_state, result.counters  # type: ignore[attr-defined]
    check_invariants(final)
    assert [p.num_blocks - 1 for p in final.pools] == [p.num_free for p in final.pools]
    steps = result.steps  # type: ignore[attr-defined]
    assert (True, True) == (c["preemptions"] > 0, set(range(1, steps + 1)) <= set(checked))


def test_a_caching_run_is_deterministic() -> None:
    """Two runs of one configuration give the same counters, hits and usage."""
    a, b = mooncake_run(120, 8 * GIB), mooncake_run(120, 8 * GIB)
    assert (a.counters, a.prefix, a.usage) == (  # type: ignore[attr-defined]
        b.counters, b.prefix, b.usage)  # type: ignore[attr-defined]
