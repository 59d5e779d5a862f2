"""The pool's per-block vectors and the garbage collector (``kvfunc.core._untracked``).

The vectors hold only ints, None and bytes, so no reference cycle can run
through them; the collector must not walk them, neither a state's nor a
transition's working copy, and their values must not change for it.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
from pyrsistent import pvector

import kvfunc as kf
from kvfunc.core import _untracked
from kvfunc.core._untracked import atomic, evolver, persist

pytestmark = pytest.mark.skipif(_untracked._untrack is None, reason="pyrsistent without pvectorc")


@pytest.fixture(autouse=True)
def no_collection() -> Iterator[None]:
    """The collector on, but no collection other than the test's own ``gc.collect()``."""
    enabled, thresholds = gc.isenabled(), gc.get_threshold()
    gc.enable()
    gc.set_threshold(1 << 30)
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        (gc.enable if enabled else gc.disable)()


def _vectors(state: kf.KVState) -> list[object]:
    out: list[object] = []
    for pool in state.pools:
        out += [pool.refs, pool.hash_of, pool.queue.prev, pool.queue.next]
    return out


def _caching_state() -> kf.KVState:
    return kf.KVState.create({"full": kf.FullAttention(num_blocks=64, block_size=4),
                              "swa": kf.SlidingWindow(num_blocks=64, block_size=4,
                                                      sliding_window=8)},
                             256, enable_prefix_caching=True, layout="shared")


def test_a_states_per_block_vectors_are_untracked_once_the_collector_runs() -> None:
    state = _caching_state()
    hashes = kf.BlockHashes.of(list(range(40)), 4)
    state = kf.allocate_slots(state, "a", 0, 40, block_hashes=hashes).state
    state = kf.free_request(state, "a")[0]
    hit = kf.allocate_slots(state, "b", 0, 40, block_hashes=hashes).state
    before = [list(v) for v in _vectors(hit)]  # type: ignore[call-overload]
    assert any(gc.is_tracked(v) for v in _vectors(hit))  # new versions wait for a collection
    gc.collect()
    assert not any(gc.is_tracked(v) for v in _vectors(hit))
    assert [list(v) for v in _vectors(hit)] == before  # type: ignore[call-overload]
    kf.check_invariants(hit)


def test_an_open_evolvers_working_copy_is_untracked_before_a_collection() -> None:
    vector = atomic(pvector([0] * 100))
    ev = evolver(vector)
    ev[3] = 7  # the working copy is made
    copies = [p for p in gc.get_referents(ev) if p is not vector and type(p) is type(vector)]
    assert copies and gc.is_tracked(copies[0])
    gc.collect()
    assert not gc.is_tracked(copies[0])
    ev[4] = 8  # the evolver goes on as before
    done = persist(ev)
    assert (done[3], done[4], vector[3], vector[4]) == (7, 8, 0, 0)
    assert id(ev) not in _untracked._open


def test_the_notes_stay_short_and_hold_nothing_dead_when_nothing_collects() -> None:
    gc.collect()
    kept = [atomic(pvector([i])) for i in range(3)]
    for i in range(3 * _untracked._FRESH_MAX):
        atomic(pvector([i]))  # dropped at once by its caller
        dropped = evolver(pvector([i]))
        del dropped  # an evolver its transition gave up
    assert len(_untracked._fresh) <= _untracked._FRESH_MAX + 1
    assert len(_untracked._open) <= _untracked._FRESH_MAX + 1
    assert not any(gc.is_tracked(v) for v in kept)  # the live ones were untracked
    assert not any(v is f for v in kept for f in _untracked._fresh)


def test_nothing_is_noted_while_the_collector_is_off() -> None:
    gc.collect()
    gc.disable()
    vector = atomic(pvector([0] * 10))
    ev = evolver(vector)
    ev[1] = 1
    done = persist(ev)
    assert not _untracked._fresh and not _untracked._open
    assert gc.is_tracked(done) and list(done) == [0, 1] + [0] * 8
