"""Owed calls paid without the step's planning give what the fold gives.

``run_owed`` (``kvfunc.core._owed``) serves a call that only takes promised
blocks, or only caches what it fills, by the primitives the step uses; every
other call goes through the fold.  These tests build such calls as
``kvfunc.vllm`` does (the rows tell the work, the free queue the promise) in
random caching traffic, and compare ``run_owed`` with ``run_batch`` of the same
requests: states, refusals and deltas.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from admission import admitted

import kvfunc as kf
import kvfunc.core._owed as owed_module
from kvfunc.core._fold import BUSY, CACHING, NOTHING, SLIDES, lane_plan, work_of
from kvfunc.core._internal import run_batch, run_owed
from kvfunc.core._pool import next_free
from kvfunc.testing import state_snapshot

BS = 4


def _traffic(rng: random.Random, layout: str, window: bool
             ) -> tuple[kf.KVState, dict[int, list[int]]]:
    """A caching state after random admissions (with hits), decodes and frees."""
    n = 64
    groups: dict[str, Any] = {"full": kf.FullAttention(num_blocks=n, block_size=BS)}
    if window:
        groups["swa"] = kf.SlidingWindow(num_blocks=n, block_size=BS, sliding_window=8)
    state = kf.KVState.create(groups, 256, enable_prefix_caching=True, layout=layout)
    prompts = [[rng.randrange(3) for _ in range(rng.randint(1, 14))] for _ in range(4)]
    toks: dict[int, list[int]] = {}
    for rid in range(rng.randint(4, 24)):
        if rng.random() < 0.5 or not toks:
            t = toks[rid] = [*rng.choice(prompts), *(rng.randrange(9) for _ in range(2))]
            r = admitted(state, rid, t, BS)
            if not r.ok:
                del toks[rid]
            state = r.state
        elif rng.random() < 0.8:
            live = rng.choice(list(toks))
            t = toks[live]
            for _ in range(rng.randint(1, 6)):
                r = kf.allocate_slots(state, live, len(t), 1,
                                      block_hashes=kf.BlockHashes.of(t, BS))
                if not r.ok:
                    break
                state = r.state
                t.append(rng.randrange(9))
        else:
            gone = rng.choice(list(toks))
            state = kf.free_request(state, gone,
                                    block_hashes=kf.BlockHashes.of(toks.pop(gone)[:-1], BS))[0]
    return state, toks


def _owed_calls(state: kf.KVState, toks: dict[int, list[int]], shared: bool
                ) -> list[tuple[Any, Any]]:
    """The decode calls of ``toks`` that ``kvfunc.vllm`` would owe: each take promised the
    free queue's next blocks past those promised before it (one pool), each caching call
    with its hashes, each call that lets a window's cached block go (one pool)."""
    out: list[tuple[Any, Any]] = []
    cursor = None
    for rid, t in toks.items():
        computed = len(t)
        work = work_of(state.groups, state.max_model_len, rid, computed, computed + 1,
                       computed + 1)
        hashes = kf.BlockHashes.of([*t, 0], BS)
        if work == CACHING:
            out.append((kf.SlotRequest(rid, computed, 1, 0, 0, None, hashes, None), None))
        elif work == BUSY and shared:
            plan = lane_plan(state.groups, rid, computed, computed + 1)
            assert plan is not None
            needs = [need for need, _ in plan]
            ids = next_free(state.pools[0], cursor, sum(needs))
            if ids is None or not ids:
                continue
            tables, at = [], 0
            for need in needs:
                tables.append(ids[at:at + need])
                at += need
            cursor = ids[-1]
            out.append((kf.SlotRequest(rid, computed, 1, 0, 0, None, None, None), tables))
        elif work & SLIDES and shared:  # a window lets a block go; nothing taken
            plan = lane_plan(state.groups, rid, computed, computed + 1)
            if plan is not None and not any(need or front for need, front in plan):
                out.append((kf.SlotRequest(rid, computed, 1, 0, 0, None,
                                           hashes if work & CACHING else None, None), None))
        else:
            assert work == NOTHING or work & BUSY
    return out


def _same(a: Any, b: Any) -> None:
    """The same refusals, delta and state; cell for cell when recorded, and else every cell
    but the free queue's links, with the hash index's copies in order.  (Unrecorded takes
    may pop their blocks in one run, which leaves other stale links in the cells of the
    blocks popped than one pop each: no reader looks at a held block's links, and the
    queue's order is compared.)"""
    assert a.refused == b.refused
    assert a.delta == b.delta
    assert a.state == b.state
    if a.delta is not None:
        assert state_snapshot(a.state) == state_snapshot(b.state)
    assert _cells(a.state) == _cells(b.state)


def _cells(state: kf.KVState) -> Any:
    """A state's snapshot without the queue's link cells, with each pool's hash index (the
    copies of a key in the order a hit takes them) and count of cached blocks."""
    limit, groups, pools, usage = state_snapshot(state)
    return (limit, groups, tuple((*p[:5], *p[6:]) for p in pools), usage,
            tuple((sorted(p.by_key.items()), p.num_cached) for p in state.pools))


@pytest.mark.parametrize("layout", ["shared", "per-type"])
@pytest.mark.parametrize("seed", range(40))
def test_owed_calls_paid_directly_equal_the_fold(seed: int, layout: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Takes and caching calls built as the manager owes them: ``run_owed`` gives
    ``run_batch``'s state, refusals and delta, recorded or not, and serves every one of
    them without the fold (unrecorded in one pool, every take popped in one run)."""
    rng = random.Random(seed)
    state, toks = _traffic(rng, layout, window=seed % 3 != 0)
    owed = _owed_calls(state, toks, layout == "shared" or len(state.groups) == 1)
    folds, together = [], []
    real_fold, real_together = owed_module.fold, owed_module._together
    monkeypatch.setattr(owed_module, "fold", lambda tr, es: folds.append(es) or real_fold(tr, es))
    monkeypatch.setattr(owed_module, "_together",
                        lambda tr, o: together.append(real_together(tr, o)) or together[-1])
    for record in (False, True):
        direct = run_owed(state, owed, record)
        general = run_batch(state, [e for e, _ in owed], record)
        _same(direct, general)
        kf.check_invariants(direct.state)
    assert folds == []
    assert together == ([True] if len(state.pools) == 1 else [])  # unrecorded, one pool


def test_the_random_traffic_builds_takes_caching_calls_and_slides() -> None:
    """The random traffic above does build takes, caching calls and calls that let a
    window's block go (the comparison is not of empty payments)."""
    kinds = set()
    for seed in range(40):
        rng = random.Random(seed)
        state, toks = _traffic(rng, "shared", window=seed % 3 != 0)
        kinds.update("take" if t is not None else "slide" if e.computed_tokens >= min(
            g.rows[e.request_id].slide for g in state.groups) else "cache"
                      for e, t in _owed_calls(state, toks, True))
    assert kinds == {"take", "cache", "slide"}


def _one_take() -> tuple[kf.KVState, Any]:
    state = kf.KVState.create({"full": kf.FullAttention(num_blocks=8, block_size=BS)}, 256,
                              enable_prefix_caching=True)
    state = kf.allocate_slots(state, "a", 0, BS).state
    return state, kf.SlotRequest("a", BS, 1, 0, 0, None, None, None)


def test_a_take_off_its_promise_is_a_typed_error_and_changes_nothing() -> None:
    """A take promised other blocks than the free queue hands out raises, and the state it
    was given stays as it was (the same payment with the right promise goes on from it)."""
    state, request = _one_take()
    before = state_snapshot(state)
    right = next_free(state.pools[0], None, 1)
    assert right is not None
    for wrong in ([[right[0] + 1]], [[right[0], right[0] + 1]]):
        with pytest.raises(kf.KVFuncError, match="did not take the blocks"):
            run_owed(state, [(request, wrong)], False)
        assert state_snapshot(state) == before
    _same(run_owed(state, [(request, [right])], True), run_batch(state, [request], True))


def test_calls_of_other_shapes_take_the_fold_and_equal_it(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """A take with hashes, a plain tuple, a reservation, a caching call of a new request or
    with its hashes unchecked: each goes through the fold, with the fold's answer; a take
    whose rows want other blocks than its promise, or a promise for the wrong number of
    groups, goes through the fold too and is a typed error that changes nothing."""
    state, request = _one_take()
    right = next_free(state.pools[0], None, 1)
    hashes = kf.BlockHashes.of(range(BS + 1), BS)
    folds = []
    real_fold = owed_module.fold
    monkeypatch.setattr(owed_module, "fold", lambda tr, es: folds.append(es) or real_fold(tr, es))
    cases = [
        [(request._replace(block_hashes=hashes), [right])],
        [(("a", BS, 1), [right])],
        [(request._replace(reserved_tokens=BS), [right])],
        [(kf.SlotRequest("b", 0, 1), None)],
        [(request._replace(block_hashes=hashes), None)],
    ]
    for owed in cases:
        _same(run_owed(state, owed, True), run_batch(state, [e for e, _ in owed], True))
    assert len(folds) == len(cases)
    before = state_snapshot(state)
    for owed in ([(request._replace(block_hashes=hashes), [[right[0] + 1]])],
                 [(request._replace(num_new_tokens=BS + 1), [right])],  # it takes two
                 [(request, [right, []])],  # a promise for two groups
                 [(kf.SlotRequest("b", 0, 1), [[right[0] + 1]])]):  # a new request
        with pytest.raises(kf.KVFuncError, match="did not take the blocks"):
            run_owed(state, owed, False)
        assert state_snapshot(state) == before
    assert len(folds) == len(cases) + 4


def test_run_owed_refuses_what_the_fold_refuses_and_checks_its_input() -> None:
    """A take that does not fit is refused as the fold refuses it; a non-iterable payment, an
    owed call that is not ``(request, tables)`` and a reservation that is not an int are
    typed errors that change nothing."""
    state = kf.KVState.create({"full": kf.FullAttention(num_blocks=3, block_size=BS)}, 256,
                              enable_prefix_caching=True)
    state = kf.allocate_slots(state, "a", 0, 2 * BS).state
    request = kf.SlotRequest("a", 2 * BS, 1, 0, 0, None, None, None)
    r = run_owed(state, [(request, [[5]])], False)
    assert r.refused == ("a",) and r.state is state
    with pytest.raises(kf.InvalidTypeError):
        run_owed(state, 3, False)  # type: ignore[arg-type]
    before = state_snapshot(state)
    for bad in ([(request,)], [(request, 5)], [(request, [5])], [request],
                [(request._replace(reserved_tokens=False), [[5]])]):
        with pytest.raises(kf.InvalidTypeError):
            run_owed(state, bad, False)
        assert state_snapshot(state) == before
    with pytest.raises(kf.InvalidTypeError):  # as the fold answers a reservation of False
        run_batch(state, [request._replace(reserved_tokens=False)], False)


@pytest.mark.parametrize("seed", range(24))
def test_any_call_paid_as_owed_gives_the_folds_answer(seed: int) -> None:
    """Every live request's next call (one token, a block, two; with hashes or none; from
    its tokens or from half of them, so that it may write into blocks it shares), paid as a
    take promised exactly the blocks the fold appends, or as a caching call: what the rows
    say it does not do (a window letting a block go, a block to take, a write to copy)
    sends it to the fold, and the state, refusals and delta are the fold's."""
    rng = random.Random(seed)
    state, toks = _traffic(rng, "shared" if seed % 2 else "per-type", window=seed % 3 != 0)
    for rid, t, computed in [(r, ts, c) for r, ts in toks.items() for c in (len(ts), len(ts) // 2)]:
        for new in (1, BS, 2 * BS):
            for hashes in (None, kf.BlockHashes.of([*t[:computed], *range(new)], BS)):
                request = kf.SlotRequest(rid, computed, new, 0, 0, None, hashes, None)
                for record in (True, False):
                    general = run_batch(state, [request], record)
                    tables = []
                    for g in state.groups:
                        old, row = g.rows[rid], general.state.group(g.key).rows[rid]
                        tables.append(list(row.ids[old.length:row.length]))
                    for promise in (tables, None):
                        _same(run_owed(state, [(request, promise)], record), general)


def test_a_request_owed_twice_is_paid_one_call_at_a_time() -> None:
    """Two calls of one request in one payment (one caches, the next takes): the second is
    planned from the rows the first leaves, not both from the rows before, so the payment
    goes call by call, with the fold's answer."""
    state = kf.KVState.create({"full": kf.FullAttention(num_blocks=8, block_size=BS)}, 256,
                              enable_prefix_caching=True)
    state = kf.allocate_slots(state, "a", 0, 2 * BS,
                              block_hashes=kf.BlockHashes.of(range(BS), BS)).state
    promise = next_free(state.pools[0], None, 1)
    assert promise is not None
    owed = [(kf.SlotRequest("a", 2 * BS - 1, 1, 0, 0, None,
                            kf.BlockHashes.of(range(2 * BS), BS), None), None),
            (kf.SlotRequest("a", 2 * BS, 1, 0, 0, None, None, None), [promise])]
    paid = run_owed(state, owed, False)
    _same(paid, run_batch(state, [e for e, _ in owed], False))
    row = paid.state.group("full").row("a")
    assert (row.ids[:row.length], row.stored) == ([1, 2, *promise], 2)


def test_a_block_let_go_to_the_front_keeps_the_takes_after_it_one_by_one() -> None:
    """A window's block that caches nothing joins the front of the free queue, so a take
    owed after it pops that block first: the payment does not pop the takes in one run
    then, and a take promised the blocks that were first before is a typed error (the
    promise that counts the block let go gives the fold's state)."""
    groups = {"full": kf.FullAttention(num_blocks=16, block_size=BS),
              "swa": kf.SlidingWindow(num_blocks=16, block_size=BS, sliding_window=8)}
    state = kf.KVState.create(groups, 256, enable_prefix_caching=True, layout="shared")
    state = kf.allocate_slots(state, "w", 0, 3 * BS).state  # no hashes: nothing cached
    state = kf.allocate_slots(state, "t", 0, BS).state
    slide = kf.SlotRequest("w", 3 * BS - 1, 1, 0, 0, None, None, None)
    take = kf.SlotRequest("t", BS, 1, 0, 0, None, None, None)
    first = next_free(state.pools[0], None, 2)
    assert first is not None
    before = state_snapshot(state)
    with pytest.raises(kf.KVFuncError, match="did not take the blocks"):
        run_owed(state, [(slide, None), (take, [first[:1], first[1:]])], False)
    assert state_snapshot(state) == before
    general = run_batch(state, [slide, take], False)
    let_go = state.group("swa").row("w").ids[0]
    assert general.state.group("full").row("t").ids[1] == let_go
    _same(run_owed(state, [(slide, None), (take, [[let_go], first[:1]])], False), general)
