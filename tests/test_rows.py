"""Rows share their lineage's block-id list: every kept state still reads its own table.

A growing table appends to the list its earlier rows hold (``_rows``), so
these tests keep states along the way, branch from old ones, fork, copy on
write and race threads from one state, and check that each state reads
exactly the table it had when it was made.
"""

from __future__ import annotations

import random
import threading
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvfunc as kf
from kvfunc.testing import state_snapshot

BS = 4


def make_state(caching: bool = False, window: int | None = None) -> kf.KVState:
    groups: dict[str, Any] = {"full": kf.FullAttention(num_blocks=400, block_size=BS)}
    if window is not None:
        groups["swa"] = kf.SlidingWindow(num_blocks=400, block_size=BS, sliding_window=window)
    return kf.KVState.create(groups, max_model_len=1 << 14, enable_prefix_caching=caching)


def tables(state: kf.KVState) -> dict[str, dict[Any, tuple[int, ...]]]:
    return {g.key: dict(g.tables) for g in state.groups}


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2 ** 32 - 1), window=st.sampled_from([None, 6, 13]))
def test_every_kept_state_reads_the_table_it_had(seed: int, window: int | None) -> None:
    """Grow requests step by step, branch from random old states, keep them all: each state's
    tables, snapshot and invariants are those recorded when it was made."""
    rng = random.Random(seed)
    kept: list[tuple[kf.KVState, Any, Any]] = []
    state = make_state(window=window)
    lengths: dict[int, int] = {}
    for _ in range(60):
        if kept and rng.random() < 0.3:  # branch: go on from an older state
            state = rng.choice(kept)[0]
            lengths = _lengths(state)
        entries = []
        for rid in rng.sample(range(6), rng.randint(1, 4)):
            done = lengths.get(rid, 0)
            entries.append((rid, done, rng.randint(1, 2 * BS + 1)))
        res = kf.allocate_batch(state, entries)
        state = res.state
        for rid, done, new in entries:
            if rid not in res.refused:
                lengths[rid] = done + new
        kept.append((state, tables(state), state_snapshot(state)))
    for state, want, snap in kept:
        assert tables(state) == want
        assert state_snapshot(state) == snap
        kf.check_invariants(state)


def _lengths(state: kf.KVState) -> dict[int, int]:
    """Tokens each request was given, read back from the full-attention table's length."""
    full = state.group("full")
    return {rid: len(table) * BS for rid, table in full.tables.items()}


def test_two_futures_of_one_state_keep_their_own_tables() -> None:
    """From one state, grow a request by different blocks twice: neither sees the other's."""
    base = kf.allocate_slots(make_state(), "r", 0, 3 * BS).state
    one = kf.allocate_slots(base, "r", 3 * BS, BS).state
    two = kf.allocate_slots(base, "r", 3 * BS, 2 * BS).state
    three = kf.allocate_slots(one, "r", 4 * BS, BS).state
    assert base.group("full").table("r") == (1, 2, 3)
    assert one.group("full").table("r") == (1, 2, 3, 4)
    assert two.group("full").table("r") == (1, 2, 3, 4, 5)
    assert three.group("full").table("r") == (1, 2, 3, 4, 5)
    assert kf.allocate_slots(two, "r", 5 * BS, 1).state.group("full").table("r") == (
        1, 2, 3, 4, 5, 6)


def test_a_lineage_shares_one_list() -> None:
    """States kept along one request's growth hold one list between them, not one each."""
    state = kf.allocate_slots(make_state(), "r", 0, BS).state
    kept = [state]
    for k in range(1, 50):
        state = kf.allocate_slots(state, "r", k * BS, BS).state
        kept.append(state)
    lists = {id(s.group("full").rows["r"].ids) for s in kept}
    assert len(lists) == 1
    assert [len(s.group("full").table("r")) for s in kept] == list(range(1, 51))


def test_copy_on_write_and_forks_leave_the_parent_list_alone() -> None:
    """A fork shares the parent's blocks; the child's copy-on-write and growth never show in
    the parent's table, nor in the state before the fork."""
    state = kf.allocate_slots(make_state(caching=True), "p", 0, 2 * BS + 2).state
    forked = kf.fork_request(state, "p", "c")[0]
    wrote = kf.allocate_slots(forked, "c", 2 * BS + 2, BS).state
    parent = kf.allocate_slots(wrote, "p", 2 * BS + 2, 3 * BS).state
    assert state.group("full").table("p") == (1, 2, 3)
    assert forked.group("full").table("c") == (1, 2, 3)
    assert wrote.group("full").table("c")[:2] == (1, 2)
    assert wrote.group("full").table("c")[2] != 3  # its own copy of the shared block
    assert parent.group("full").table("p")[:3] == (1, 2, 3)
    for s in (state, forked, wrote, parent):
        kf.check_invariants(s)


@pytest.mark.parametrize("window", [None, 6])
def test_threads_growing_from_one_state_get_the_serial_answer(window: int | None) -> None:
    """Many threads take transitions from the same state at once (they race to append to the
    same lists): every result equals the one computed alone."""
    base = kf.allocate_batch(make_state(window=window), [(r, 0, 3 * BS) for r in range(8)]).state
    before = tables(base)
    steps = [[(r, 3 * BS, k + 1) for r in range(8)] for k in range(2 * BS)]
    want = [tables(kf.allocate_batch(base, s).state) for s in steps]
    got: list[Any] = [None] * (len(steps) * 8)
    barrier = threading.Barrier(8)

    def work(t: int) -> None:
        barrier.wait()
        for k, s in enumerate(steps):
            got[t * len(steps) + k] = tables(kf.allocate_batch(base, s).state)
    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert not any(th.is_alive() for th in threads)
    assert got == want * 8
    assert tables(base) == before
