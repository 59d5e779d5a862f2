"""The fold's lane (quiet and growing entries) gives exactly what the general step gives."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvfunc as kf
import kvfunc.core._fold as fold_module
from kvfunc.testing import kv_states, programs, run_program, token_budget


@contextmanager
def without_lane() -> Iterator[None]:
    """Every entry through the general step: the fold finds no lane (run it on fresh states:
    a state caches the lane a lane run made on it)."""
    quiet_lane = fold_module.quiet_lane
    fold_module.quiet_lane = lambda tr: None  # type: ignore[assignment]
    try:
        yield
    finally:
        fold_module.quiet_lane = quiet_lane


def outcome(steps: list[Any]) -> list[tuple[Any, ...]]:
    """What a run produced: every state (as its snapshot), delta and refusal."""
    return [(step.after, step.delta, step.refused) for step in steps]


@given(kv_states().flatmap(lambda s: st.tuples(
    st.just(s), programs(s.manager_keys, max_tokens=token_budget(s)))))
def test_the_lane_equals_the_general_step_on_random_programs(case: tuple[Any, Any]) -> None:
    """Random programs of allocations, batches, frees and recycles: same states, same deltas."""
    state, program = case
    with without_lane():  # first: a lane run caches its lane on the states it meets
        slow = outcome(run_program(state, program))
    fast = outcome(run_program(state, program))
    assert fast == slow


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("caching", [False, True])
def test_the_lane_equals_the_general_step_on_decode_traffic(
        seed: int, caching: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps of decodes, growth across block ends, window slides and admissions (with hits
    and hashes when caching): lane and general step give the same states and deltas, and
    the lane run passes entries over the general step."""
    stepped = [0, 0]  # general steps run, without and with the lane
    step_fn = fold_module.step

    def counting(*args: Any) -> bool:
        stepped[lane] += 1
        return step_fn(*args)

    monkeypatch.setattr(fold_module, "step", counting)
    rnd = random.Random(seed)
    s0 = kf.KVState.create({"full": kf.FullAttention(num_blocks=96, block_size=4),
                            "swa": kf.SlidingWindow(num_blocks=64, block_size=4,
                                                    sliding_window=rnd.choice([4, 9, 16]))},
                           256, enable_prefix_caching=caching)
    runs = []
    for lane in (False, True):  # the general step first: a lane run caches its lane on s0
        rnd = random.Random(seed)
        tokens: dict[int, list[int]] = {}
        hashes: dict[int, kf.BlockHashes] = {}
        state, log = s0, []
        for step in range(40):
            entries: list[Any] = []
            for rid in sorted(tokens):
                n = rnd.choice([1, 1, 1, 2, 5])
                entries.append((rid, len(tokens[rid]), n))
                tokens[rid] += [rnd.randrange(3) for _ in range(n)]
                if caching:
                    hashes[rid] = hashes[rid].update(tokens[rid])
            if rnd.random() < 0.4:
                rid = 1000 + step
                prompt = [7] * rnd.choice([3, 8, 12]) + [rnd.randrange(3) for _ in range(5)]
                tokens[rid] = prompt
                if caching:
                    hashes[rid] = h = kf.BlockHashes.of(prompt, 4)
                    hit = kf.lookup_prefix(state, h, max_tokens=len(prompt) - 1)
                    entries.append(kf.SlotRequest(rid, hit.num_tokens,
                                                  len(prompt) - hit.num_tokens,
                                                  block_hashes=h, prefix_hit=hit))
                else:
                    entries.append((rid, 0, len(prompt)))
            if lane:
                res = kf.allocate_batch(state, entries, block_hashes=hashes if caching else None)
            else:
                with without_lane():
                    res = kf.allocate_batch(state, entries,
                                            block_hashes=hashes if caching else None)
            state = res.state
            log.append(res.delta)
            for rid in res.refused:  # a refused request is dropped (its tokens were not run)
                del tokens[rid]
                hashes.pop(rid, None)
                state, freed = kf.free_request(state, rid)
                log.append(freed)
            kf.check_invariants(state)
        runs.append((state, log))
    (slow, slow_log), (fast, fast_log) = runs
    assert stepped[1] < stepped[0], f"the lane took no entry: {stepped}"
    assert fast == slow
    assert fast_log == slow_log
    assert kf.replay(s0, fast_log) == fast
