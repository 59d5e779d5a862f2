"""``--cache-outputs as-filled|at-release``: when a request's output blocks are cached."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvfunc.cli import Scheduler, SchedulerConfig, TraceRequest
from kvfunc.cli._prefix import PrefixCacher
from kvfunc.core import BlocksChanged, FullAttention, KVState, check_invariants
from kvfunc.events import BlockStored, CachedBlocksView, events_from_delta

sys.path.insert(0, str(Path(__file__).parent))
from cli_run import run_main  # the helpers beside this file
from test_cli_hostile import assert_one_line_exit_2

BS = 16


def one_request(mode: str) -> tuple[Scheduler, list[tuple[int, BlocksChanged]]]:
    """A 32-token prompt (two hashed blocks) decoding 40 tokens, alone; every delta kept."""
    state = KVState.create({"full": FullAttention(num_blocks=64, block_size=BS)}, 4096,
                           enable_prefix_caching=True)
    requests = [TraceRequest(0.0, 32, 40, (7,))]
    deltas: list[tuple[int, BlocksChanged]] = []
    sched = Scheduler(state, requests, SchedulerConfig(cache_outputs=mode),
                      on_delta=lambda step, d: deltas.append((step, d)),
                      prefix=PrefixCacher(requests, BS))
    while sched.step():
        pass
    return sched, deltas


def test_at_release_caches_the_output_blocks_when_the_request_is_freed() -> None:
    """As filled: every block is stored before the free; at release: the output blocks by the
    free.  Both end with the same cached blocks, and their KV events mirror the cache."""
    ends, stores = {}, {}
    for mode in ("as-filled", "at-release"):
        sched, deltas = one_request(mode)
        stores[mode] = [len(d.stored_keys) for _, d in deltas]
        view = CachedBlocksView()
        for _, d in deltas:
            view = view.apply(events_from_delta(d, sched.state))
        assert view == CachedBlocksView.of_state(sched.state)
        assert sum(stores[mode]) == sum(len(e.block_hashes) for _, d in deltas
                                        for e in events_from_delta(d, sched.state)
                                        if type(e) is BlockStored)
        check_invariants(sched.state)
        ends[mode] = CachedBlocksView.of_state(sched.state)
    # the prompt's two blocks, then (32 + 39 computed tokens) // 16 - 2 = 2 output blocks
    assert (4, 0) == (sum(stores["as-filled"]), stores["as-filled"][-1]), stores
    assert (2, 2) == (stores["at-release"][0], stores["at-release"][-1]), stores
    assert not any(stores["at-release"][1:-1]), stores  # nothing stored while decoding
    assert ends["as-filled"] == ends["at-release"]


@pytest.mark.parametrize("mode", ["as-filled", "at-release"])
def test_the_flag_runs_a_trace(capsys: pytest.CaptureFixture[str], mode: str) -> None:
    """Both ways serve a Mooncake slice and report a hit rate."""
    code, out, err = run_main(capsys, "simulate", "--preset", "llama-3-8b", "--trace",
                              "mooncake-conversation", "--requests", "12", "--no-plot",
                              "--cache-outputs", mode)
    assert (0, "") == (code, err.strip()), err
    assert "hit" in out


@pytest.mark.parametrize("value", ["eager", "", "AT-RELEASE"])
def test_a_bad_value_is_one_line(capsys: pytest.CaptureFixture[str], value: str) -> None:
    """Anything but the two ways: one line, exit 2."""
    code, _, err = run_main(capsys, "simulate", "--cache-outputs", value)
    assert_one_line_exit_2(code, err, "--cache-outputs")


def test_a_bad_config_value_is_refused() -> None:
    """The library refuses an unknown way when the config is made (attrs: a ValueError)."""
    with pytest.raises(ValueError, match="cache_outputs"):
        SchedulerConfig(cache_outputs="eager")
