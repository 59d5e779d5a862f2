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
    gc.collect()  # what earlier tests left open is settled
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


def _program(state: kf.KVState) -> kf.KVState:
    """Admit, free (caching) and admit again with a hit: every per-block vector changes."""
    hashes = kf.BlockHashes.of(list(range(40)), 4)
    state = kf.allocate_slots(state, "a", 0, 40, block_hashes=hashes).state
    state = kf.free_request(state, "a")[0]
    return kf.allocate_slots(state, "b", 0, 40, block_hashes=hashes).state


def _caching_state() -> kf.KVState:
    return kf.KVState.create({"full": kf.FullAttention(num_blocks=64, block_size=4),
                              "swa": kf.SlidingWindow(num_blocks=64, block_size=4,
                                                      sliding_window=8)},
                             256, enable_prefix_caching=True, layout="shared")


def test_a_states_per_block_vectors_are_untracked_and_unchanged() -> None:
    gc.disable()  # made with the collector off: nothing is done, the vectors stay tracked
    off = _program(_caching_state())
    gc.enable()
    on = _program(_caching_state())
    assert all(gc.is_tracked(v) for v in _vectors(off))
    assert not any(gc.is_tracked(v) for v in _vectors(on))
    assert on == off and [list(v) for v in _vectors(on)] == [  # type: ignore[call-overload]
        list(v) for v in _vectors(off)]  # type: ignore[call-overload]
    kf.check_invariants(on)


def test_an_open_evolvers_working_copy_is_untracked_before_a_collection() -> None:
    vector = atomic(pvector([0] * 100))
    assert not gc.is_tracked(vector)
    ev = evolver(vector)
    ev[3] = 7  # the working copy is made
    copies = [p for p in gc.get_referents(ev) if p is not vector and type(p) is type(vector)]
    assert copies and gc.is_tracked(copies[0])
    gc.collect()
    assert not gc.is_tracked(copies[0])
    ev[4] = 8  # the evolver goes on as before
    done = persist(ev)
    assert (done[3], done[4], vector[3], vector[4]) == (7, 8, 0, 0)
    assert id(ev) not in _untracked._open and not gc.is_tracked(done)


def test_evolvers_given_up_on_are_not_held() -> None:
    before = len(_untracked._open)  # evolvers other live code holds open, if any
    kept = evolver(pvector([1]))
    for i in range(3 * _untracked._OPEN_MAX):
        dropped = evolver(pvector([i]))
        del dropped  # a transition that gave up
        assert len(_untracked._open) <= _untracked._OPEN_MAX + 1
    gc.collect()
    assert kept in _untracked._open.values() and len(_untracked._open) <= before + 1
    gc.disable()
    del kept
    evolver(pvector([0]))  # the collector is off: nothing is held for it
    assert len(_untracked._open) <= before


def test_nothing_is_done_while_the_collector_is_off() -> None:
    gc.disable()
    vector = atomic(pvector([0] * 10))
    ev = evolver(vector)
    assert id(ev) not in _untracked._open
    ev[1] = 1
    done = persist(ev)
    assert gc.is_tracked(vector) and gc.is_tracked(done) and list(done) == [0, 1] + [0] * 8
