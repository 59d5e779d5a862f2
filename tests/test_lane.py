"""The fold's lane decides nothing of its own: with it or without it, the same states and deltas.

The lane skips the step for entries that a row's quiet limits call quiet
(``kvfunc.core._fold.LANE``); these tests run random programs with it and
with every entry through the step, and compare everything.  They also hold
the limits to the policy's answers they stand for.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from admission import admitted
from hypothesis import given, settings
from hypothesis import strategies as st

import kvfunc as kf
import kvfunc.core._fold as fold_module
from kvfunc.core._policy import blocks_needed, row_limits, skip_mode, slid_out
from kvfunc.testing import kv_states, programs, run_program, state_snapshot, token_budget


@contextmanager
def lane(on: bool) -> Iterator[None]:
    """Run with the fold's lane on or off."""
    before = fold_module.LANE
    fold_module.LANE = on
    try:
        yield
    finally:
        fold_module.LANE = before


def _run_both(make: Callable[[], list[tuple[Any, Any]]]) -> None:
    with lane(True):
        fast = make()
    with lane(False):
        slow = make()
    assert len(fast) == len(slow)
    for (s1, d1), (s2, d2) in zip(fast, slow, strict=True):
        assert d1 == d2
        assert s1 == s2 and state_snapshot(s1) == state_snapshot(s2)


@settings(max_examples=60)
@given(kv_states().flatmap(lambda s: st.tuples(st.just(s), programs(
    s.manager_keys, max_tokens=token_budget(s)))))
def test_the_lane_equals_the_step_on_random_programs(case: tuple[kf.KVState, Any]) -> None:
    """Random programs (allocations, batches, frees, recycles, either layout, any order of
    reuse): the same state and delta after every operation with the lane and without."""
    state, program = case

    def make() -> list[tuple[Any, Any]]:
        return [(step.after, step.delta) for step in run_program(state, program)]
    _run_both(make)


def _caching_traffic(seed: int, layout: str) -> list[tuple[Any, Any]]:
    """Admissions with hits, decodes (hashes given or not), frees with hashes, forks."""
    rng = random.Random(seed)
    n = 48
    groups: dict[str, Any] = {"full": kf.FullAttention(num_blocks=n, block_size=4)}
    if rng.random() < 0.6:
        groups["swa"] = kf.SlidingWindow(num_blocks=n, block_size=4, sliding_window=8)
    state = kf.KVState.create(groups, 256, enable_prefix_caching=True, layout=layout)
    prompts = [[rng.randrange(3) for _ in range(rng.randint(1, 20))] for _ in range(4)]
    toks: dict[int, list[int]] = {}
    out: list[tuple[Any, Any]] = []
    for rid in range(40):
        live = list(toks)
        roll = rng.random()
        if roll < 0.3 or not live:
            t = toks[rid] = list(rng.choice(prompts)) + [rng.randrange(9) for _ in range(3)]
            r = admitted(state, rid, t, 4)
            if not r.ok:
                del toks[rid]
            state = r.state
            out.append((state, r.delta))
        elif roll < 0.8:
            entries = []
            for r_id in live:
                t = toks[r_id]
                t.append(rng.randrange(9))
                eager = rng.random() < 0.5
                h = kf.BlockHashes.of(t if eager else t[:-1], 4)
                entries.append(kf.SlotRequest(r_id, len(t) - 1, 1, block_hashes=h))
            res = kf.allocate_batch(state, entries)
            for r_id in res.refused:
                toks[r_id].pop()
            state = res.state
            out.append((state, res.delta))
        else:
            victim = rng.choice(live)
            state, d = kf.free_request(state, victim,
                                       block_hashes=kf.BlockHashes.of(toks.pop(victim), 4))
            out.append((state, d))
        kf.check_invariants(state)
    return out


@settings(max_examples=40)
@given(st.integers(0, 10**6), st.sampled_from(["per-type", "shared"]))
def test_the_lane_equals_the_step_with_prefix_caching(seed: int, layout: str) -> None:
    """Caching traffic with hits, eager and lazy hashing, and frees that cache: the same
    states and deltas with the lane and without, in either layout."""
    _run_both(lambda: _caching_traffic(seed, layout))


@given(st.data())
def test_row_limits_stand_for_the_policy_answers(data: st.DataObject) -> None:
    """Within a row's quiet limits the policy recycles nothing and needs no block; at each
    limit it does (the limits are tight, so the lane sends every busy entry on), and less
    than one block past the slide limit exactly one block has left the window."""
    bs = data.draw(st.sampled_from([1, 2, 4, 16]))
    policy: Any = data.draw(st.sampled_from([
        kf.FullAttention(num_blocks=64, block_size=bs),
        kf.SlidingWindow(num_blocks=64, block_size=bs,
                         sliding_window=data.draw(st.integers(0, 40)))]))
    traits = (bs, policy.grows_with_tokens, skip_mode(policy), policy.window)
    held = data.draw(st.integers(1, 12))
    nulls = data.draw(st.integers(0, held))
    room, slide, _, _ = row_limits(policy, traits, False, held, nulls, 0, 0)
    assert room == held * bs
    for computed in range(0, room + 2 * bs + 2):
        upto = slid_out(policy, traits[2], computed, held)
        assert (upto > nulls) == (computed >= slide), (computed, slide, upto, nulls)
        if slide <= computed < slide + bs:  # the lane's lean step: exactly one block leaves
            assert upto == nulls + 1, (computed, slide, upto, nulls)
    for total in range(0, room + bs + 1):
        assert (blocks_needed(policy, True, held, total) != (0, 0)) == (total > room)


def test_a_request_twice_in_one_batch_is_served_from_its_row_as_the_first_entry_left_it() -> None:
    """A batch that names a request twice, on a state whose working copy is fresh (an older
    state of its lineage): the second entry reads the row the first one grew, lane or not, and
    equals two calls of allocate_slots."""
    groups = {"full": kf.FullAttention(num_blocks=64, block_size=4),
              "swa": kf.SlidingWindow(num_blocks=64, block_size=4, sliding_window=6)}
    base = kf.KVState.create(groups, max_model_len=256)
    old = kf.allocate_slots(base, "r", 0, 4).state
    kf.allocate_slots(old, "r", 4, 1)  # the lineage goes on: ``old`` is no longer its newest
    batch = [("q", 0, 3), ("r", 4, 4), ("r", 8, 1), ("q", 3, 6)]
    want = old
    for rid, done, new in batch:
        want = kf.allocate_slots(want, rid, done, new).state
    for on in (True, False):
        with lane(on):
            got = kf.allocate_batch(old, batch).state
        assert got == want and state_snapshot(got) == state_snapshot(want)


def test_growing_past_a_fully_cached_table_caches_the_block_it_completes(monkeypatch: Any
                                                                         ) -> None:
    """Every held block is cached (the row's fill limit is unbounded), and the step both takes
    a block and fills it: the lane's lean step caches the new block, never reaching the
    general step, exactly as the step does without the lane."""
    state = kf.KVState.create({"full": kf.FullAttention(num_blocks=16, block_size=4)}, 64,
                              enable_prefix_caching=True)
    h = kf.BlockHashes.of(list(range(12)), 4)
    state = kf.allocate_slots(state, "r", 0, 8, block_hashes=h).state  # two blocks, both cached
    stepped: list[Any] = []
    real = fold_module.step
    monkeypatch.setattr(fold_module, "step", lambda *a: stepped.append(a[1]) or real(*a))
    results = []
    for on in (True, False):
        with lane(on):
            results.append(kf.allocate_slots(state, "r", 8, 4, block_hashes=h))
    fast, slow = results
    assert stepped == ["r"]  # the call without the lane only
    assert fast.delta == slow.delta and fast.state == slow.state
    assert [op.block_id for op in fast.delta.operations() if type(op).__name__ == "Stored"] == [3]


def test_a_quiet_call_answers_with_the_state_it_was_given_whichever_came_last() -> None:
    """Quiet calls on two states in turn: each result holds its own input state (the
    result of the last quiet call is reused only for the same state)."""
    s0 = kf.KVState.create({"full": kf.FullAttention(num_blocks=16, block_size=4)}, 64)
    a = kf.allocate_slots(s0, "r", 0, 3).state
    b = kf.allocate_slots(a, "q", 0, 3).state
    for state in (a, a, b, a, b, b):
        r = kf.allocate_slots(state, "r", 2, 1)
        assert r.ok and r.state is state and r.delta.is_empty
    grown = kf.allocate_slots(a, "r", 3, 2)  # a new block: never the quiet answer
    assert grown.state is not a and len(kf.get_block_ids(grown.state, "r")["full"]) == 2
    assert kf.get_block_ids(a, "r")["full"] == (1,)


def test_a_window_sliding_one_block_takes_the_lean_step_and_equals_the_step(monkeypatch: Any
                                                                            ) -> None:
    """Decode steps of a full + window model on one shared pool, prefix caching on: a step
    where the window's next block leaves it (with or without a new block) is served by the
    lane's lean step, never the general step, and every state, delta and refusal equals the
    general step's; a jump past two blocks goes to the general step."""
    groups = {"full": kf.FullAttention(num_blocks=9, block_size=4),
              "swa": kf.SlidingWindow(num_blocks=9, block_size=4, sliding_window=6)}
    base = kf.KVState.create(groups, 256, enable_prefix_caching=True, layout="shared")
    h = kf.BlockHashes.of(list(range(10)), 4)  # two full blocks: the third is never cached
    start = kf.allocate_slots(base, "r", 0, 10, block_hashes=h).state
    stepped: list[Any] = []
    real = fold_module.step
    monkeypatch.setattr(fold_module, "step", lambda *a: stepped.append(a[2]) or real(*a))
    runs = []
    for on in (True, False):
        state, out = start, []
        with lane(on):
            for done in range(10, 24):
                r = kf.allocate_slots(state, "r", done, 1, block_hashes=h)
                out.append((r.ok, r.state, r.delta))
                state = r.state
            out.append(kf.allocate_slots(state, "r", 40, 1, block_hashes=h)[:2])
        runs.append((out, list(stepped)))
        stepped.clear()
    (fast, fast_steps), (slow, _) = runs
    assert fast == slow
    assert any(not ok for ok, *_ in fast[:-1])  # the pool ran out: a refusal on both paths
    slides = [d for ok, _, d in fast[:-1] if ok and d.nulled_positions]
    assert any(d.appended_block_ids for d in slides)  # a slide with a new block
    assert any(not d.appended_block_ids for d in slides)  # and one without
    assert fast_steps == [40]  # only the jump past two blocks reached the step


@pytest.mark.parametrize("layout", ["per-type", "shared", "full only"])
def test_decode_steps_that_complete_blocks_take_the_lean_step_and_equal_the_step(
        layout: str, monkeypatch: Any) -> None:
    """Decode steps of a full + window model and of a full one, prefix caching on, hashing
    the token each step writes or only those before it: a step that completes a block (alone,
    with a new block, with the window sliding) is served by the lane's lean step, one that
    only caches with no room check or recycling pass, one group that takes a block (and may
    cache) with no plan or recycling pass, and every state, delta and refusal equals the
    general step's."""
    groups: dict[str, Any] = {"full": kf.FullAttention(num_blocks=8, block_size=4)}
    if layout != "full only":
        groups["swa"] = kf.SlidingWindow(num_blocks=8, block_size=4, sliding_window=8)
    base = kf.KVState.create(groups, 256, enable_prefix_caching=True,
                             layout="per-type" if layout == "full only" else layout)
    tokens = list(range(60))
    start = kf.allocate_slots(base, "r", 0, 5, block_hashes=kf.BlockHashes.of(tokens[:5], 4))
    import kvfunc.core._step as step_module

    stepped: list[Any] = []
    recycled: list[int] = []
    real, real_first, real_room = fold_module.step, step_module.recycle_first, step_module.has_room
    monkeypatch.setattr(fold_module, "step", lambda *a: stepped.append(a[1]) or real(*a))
    monkeypatch.setattr(step_module, "recycle_first",
                        lambda *a: recycled.append(1) or real_first(*a))
    monkeypatch.setattr(step_module, "has_room", lambda *a: recycled.append(2) or real_room(*a))
    runs, alone, grown = [], 0, 0
    for on in (True, False):
        state, out = start.state, []
        with lane(on):
            for done in range(5, 56):
                eager = (done // 4) % 2 == 0  # hashing the token written, or not yet
                h = kf.BlockHashes.of(tokens[:done + eager], 4)
                recycled.clear()
                r = kf.allocate_slots(state, "r", done, 1, block_hashes=h)
                if on and r.delta.stored_keys and not (r.delta.appended_block_ids
                                                       or r.delta.nulled_positions):
                    assert not recycled  # caching alone: no plan of room or recycling
                    alone += 1
                if on and layout == "full only" and r.delta.appended_block_ids:
                    assert not recycled  # one group grows (and caches): no plan's room
                    # check, no recycling pass
                    grown += r.delta.stored_keys != ()
                out.append((r.ok, r.state, r.delta))
                state = r.state
                if not r.ok:
                    break
        runs.append((out, list(stepped)))
        stepped.clear()
    (fast, fast_steps), (slow, _) = runs
    assert fast == slow
    assert fast_steps == []  # every decode step took the lane
    deltas = [d for ok, _, d in fast if ok]
    assert not fast[-1][0]  # the pool ran out: a refusal on both paths
    stored = [d for d in deltas if d.stored_keys]
    assert any(not d.appended_block_ids for d in stored)  # a block completes alone
    assert any(d.appended_block_ids for d in stored)  # and with a new block
    if layout == "full only":  # a block completes with nothing else to do, or with a new one
        assert alone, "no step cached a block alone"
        assert grown, "no step took a block and cached one"
    else:
        assert any(d.nulled_positions for d in stored)  # and with the window sliding


@pytest.mark.parametrize("models", ["full", "full+swa per-type", "full+swa shared"])
def test_decode_steps_that_only_grow_take_the_lean_steps_growth_and_equal_the_step(
        models: str, monkeypatch: Any) -> None:
    """Decode steps without prefix caching, a batch of two requests: a step where every group
    of a request only takes a new block is grown by the lean step directly (one group: no
    plan, no room check of plans; several: no recycling pass), and every state, delta and
    refusal equals the general step's."""
    import kvfunc.core._step as step_module

    groups: dict[str, kf.Policy] = {"full": kf.FullAttention(num_blocks=12, block_size=4)}
    if models != "full":
        groups["swa"] = kf.SlidingWindow(num_blocks=12, block_size=4, sliding_window=64)
    layout = "shared" if models.endswith("shared") else "per-type"
    base = kf.KVState.create(groups, 256, layout=layout)
    start = kf.allocate_batch(base, [("a", 0, 3), ("b", 0, 2)]).state
    calls: dict[str, int] = {"has_room": 0, "recycle_first": 0, "step": 0}

    def counting(name: str, real: Any) -> Any:
        def counted(*a: Any) -> Any:
            calls[name] += 1
            return real(*a)
        return counted

    for name, module in (("has_room", step_module), ("recycle_first", step_module),
                         ("step", fold_module)):
        monkeypatch.setattr(module, name, counting(name, getattr(module, name)))
    runs = []
    for on in (True, False):
        state, out = start, []
        with lane(on):
            for done in range(3, 40):
                r = kf.allocate_batch(state, [("a", done, 1), ("b", done - 1, 1)])
                out.append((r.refused, r.state, r.delta))
                state = r.state
        runs.append((out, dict(calls)))
        calls.update(dict.fromkeys(calls, 0))
    (fast, fast_calls), (slow, _) = runs
    assert fast == slow
    assert any(d.appended_block_ids for _, _, d in fast)
    assert fast[-1][0]  # the pool ran out: a refusal on both paths
    assert fast_calls["step"] == 0  # every decode step took the lane
    assert fast_calls["recycle_first"] == 0  # nothing slid out, nothing cached: no pass
    if models == "full":
        assert fast_calls["has_room"] == 0  # one group: its own room check, no plan
    else:
        assert fast_calls["has_room"] > 0


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("layout", ["per-type", "shared"])
def test_work_of_tells_a_step_with_nothing_to_do_or_only_caching(seed: int,
                                                                  layout: str) -> None:
    """``work_of`` (the vLLM manager's check before it fetches a request's hashes): whenever
    it says a step of one token or a few (and a lookahead) has nothing to do, the transition
    with the request's hashes, or without any, returns the state it was given and an empty
    delta; when it says only caching, the transition with hashes only caches (T rows) and the
    one without any changes nothing; without the caching bit nothing is cached, and without
    the sliding bit nothing is let go (N rows)."""
    rng = random.Random(seed)
    groups: dict[str, Any] = {"full": kf.FullAttention(num_blocks=40, block_size=4)}
    if seed % 2:
        groups["swa"] = kf.SlidingWindow(num_blocks=40, block_size=4, sliding_window=6)
    state = kf.KVState.create(groups, 128, enable_prefix_caching=True, layout=layout)
    prefix = [rng.randrange(3) for _ in range(8)]
    toks: dict[int, list[int]] = {}
    seen = {fold_module.NOTHING: 0, fold_module.CACHING: 0, fold_module.BUSY: 0}
    for rid in range(120):
        if len(toks) < 4:
            t = toks[rid] = prefix[:rng.randint(0, 8)] + [rng.randrange(9) for _ in range(3)]
            r = admitted(state, rid, t, 4)
            state = r.state if r.ok else state
            if not r.ok:
                del toks[rid]
            continue
        victim = rng.choice(list(toks))
        t = toks[victim]
        if len(t) > 60 or rng.random() < 0.05:
            state = kf.free_request(state, victim, block_hashes=kf.BlockHashes.of(t, 4))[0]
            del toks[victim]
            continue
        new = rng.choice([1, 1, 1, 2, 5])
        t.extend(rng.randrange(9) for _ in range(new))
        computed, lookahead = len(t) - new, rng.choice([0, 0, 1, 5])
        work = fold_module.work_of(state.groups, state.max_model_len, victim, computed,
                                   computed + new, computed + new + lookahead)
        h = kf.BlockHashes.of(t, 4)
        r = kf.allocate_slots(state, victim, computed, new, lookahead, block_hashes=h)
        bare = kf.allocate_slots(state, victim, computed, new, lookahead)
        if work == fold_module.NOTHING:
            assert r.ok and r.state is state and r.delta.is_empty
        if work in (fold_module.NOTHING, fold_module.CACHING):
            assert bare.ok and bare.state is state and bare.delta.is_empty
            assert set(r.delta.order) <= {"T"}
        if not work & fold_module.CACHING:
            assert not r.delta.stored_keys
        if not work & fold_module.SLIDES:
            assert not r.delta.nulled_positions
        seen[work & fold_module.BUSY or work] += 1
        if r.ok:
            state = r.state
        else:
            del t[-new:]
    assert min(seen.values()) > 2, seen
    with lane(False):  # with the lane off every answer has every bit
        assert {fold_module.work_of(state.groups, state.max_model_len, rid, len(t) - 1, len(t),
                                    len(t)) for rid, t in toks.items()} <= {7}


@pytest.mark.parametrize("layout", ["per-type", "shared"])
def test_busy_slots_equals_allocate_slots_and_checks_the_lookahead(layout: str) -> None:
    """The vLLM manager's transition for a call its rows call busy (no quiet check first)
    gives what ``allocate_slots`` gives, on random decode and prefill calls of a full +
    window model with caching on, and the same state when it records no delta (as does
    ``run_free`` against ``free_request``); a lookahead that is not an int is the same typed
    error."""
    from kvfunc.core._internal import busy_slots, run_free

    groups = {"full": kf.FullAttention(num_blocks=24, block_size=4),
              "swa": kf.SlidingWindow(num_blocks=24, block_size=4, sliding_window=8)}
    state = kf.KVState.create(groups, 128, enable_prefix_caching=True, layout=layout)
    rng, done = random.Random(7), {"a": 0, "b": 0, "c": 0}
    tokens = [rng.randrange(50) for _ in range(64)]
    refused = 0
    for _ in range(120):
        rid = rng.choice(sorted(done))
        new, la = rng.choice([1, 1, 1, 3, 9]), rng.choice([0, 0, 2])
        h = kf.BlockHashes.of(tokens[:done[rid] + new], 4)
        want = kf.allocate_slots(state, rid, done[rid], new, la, block_hashes=h)
        got = busy_slots(state, rid, done[rid], new, la, h)
        assert got.ok == want.ok and got.delta == want.delta
        assert state_snapshot(got.state) == state_snapshot(want.state)
        unrecorded = busy_slots(state, rid, done[rid], new, la, h, record=False)
        assert unrecorded.ok == want.ok and (unrecorded.delta is None) is (want.state is not state)
        assert state_snapshot(unrecorded.state) == state_snapshot(want.state)
        if want.ok:
            state, done[rid] = want.state, min(done[rid] + new, 60)
            if done[rid] == 60:
                freed, delta = run_free(state, rid, False)
                state, done[rid] = kf.free_request(state, rid)[0], 0
                assert delta is None and state_snapshot(freed) == state_snapshot(state)
        refused += not want.ok
    assert refused, "no call was refused: the refusal path is not covered"
    for la in (True, 2.0, None):
        with pytest.raises(kf.InvalidTypeError):
            busy_slots(state, "a", done["a"], 1, la, None)  # type: ignore[arg-type]
