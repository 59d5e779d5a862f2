"""The pool's per-block vectors and the garbage collector (``kvfunc.core._untracked``).

The vectors hold only ints, None and bytes, so no reference cycle can run
through them; the collector must not walk them, neither a state's nor a
transition's working copy, and their values must not change for it.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest
from pyrsistent import pvector

import kvfunc as kf
from kvfunc.core import _untracked
from kvfunc.core._pool import PoolCopy
from kvfunc.core._untracked import atomic, forget, untrack, watch, watching

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


def evolver(vector: Any) -> Any:
    """An evolver opened as the pool opens its own (``PoolCopy.writing``)."""
    ev = vector.evolver()
    if watching():
        watch(ev)
    return ev


def persist(ev: Any) -> Any:
    """An evolver's vector, made as the pool makes its own (``PoolCopy.freeze``)."""
    forget(ev)
    vector = ev.persistent()
    if watching():
        untrack(vector)
    return vector


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


def test_a_pool_copys_evolvers_are_open_from_its_first_write_to_its_freeze() -> None:
    copy = PoolCopy(_caching_state().pools[0], None)
    copy.take(2)  # the first write: every per-block vector becomes an evolver
    evolvers = [copy.refs, copy.hash_of, copy.queue.prev, copy.queue.next]
    assert all(id(ev) in _untracked.open_evolvers for ev in evolvers)
    pool = copy.freeze()
    assert not any(id(ev) in _untracked.open_evolvers for ev in evolvers)
    assert not any(gc.is_tracked(v) for v in (pool.refs, pool.hash_of, pool.queue.prev,
                                              pool.queue.next))
    assert pool.num_free == 64 - 3


def _host(state: kf.TieredState) -> Any:
    assert state.host is not None
    return state.host


def test_a_host_tiers_free_stack_is_untracked_once_a_transition_gives_a_block_back() -> None:
    device = kf.KVState.create({"f": kf.FullAttention(num_blocks=5, block_size=4)}, 256,
                               enable_prefix_caching=True)
    state = kf.TieredState.create(device, host_blocks=8)
    assert not gc.is_tracked(_host(state).free)
    for rid, tag, n in (("a", 1, 13), ("b", 2, 16)):  # "b" evicts "a": its stores start
        tokens = [tag * 1000 + i for i in range(n)]
        h = kf.BlockHashes.of(tokens, 4)
        hit = kf.lookup_tiers(state, h, max_tokens=n - 1)
        state = kf.allocate_tiered(state, [(rid, hit.num_tokens, n - hit.num_tokens, 0, 0,
                                            None, h, hit)]).state
        if rid == "a":
            state = kf.free_tiered(state, "a")[0]
    before = _host(state).free
    state = kf.complete_moves(state, failed=list(state.moves)).state  # host blocks come back
    host = _host(state)
    assert host.num_free == 8 and host.free is not before and not gc.is_tracked(host.free)
    kf.check_tiered_invariants(state)


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
    assert id(ev) not in _untracked.open_evolvers and not gc.is_tracked(done)


def test_evolvers_given_up_on_are_not_held() -> None:
    before = len(_untracked.open_evolvers)  # evolvers other live code holds open, if any
    kept = evolver(pvector([1]))
    for i in range(3 * _untracked._OPEN_MAX):
        dropped = evolver(pvector([i]))
        del dropped  # a transition that gave up
        assert len(_untracked.open_evolvers) <= _untracked._OPEN_MAX + 1
    gc.collect()
    assert kept in _untracked.open_evolvers.values() and len(_untracked.open_evolvers) <= before + 1
    gc.disable()
    del kept
    watch(pvector([0]).evolver())  # the collector is off: nothing is held for it
    assert len(_untracked.open_evolvers) <= before


def test_nothing_is_done_while_the_collector_is_off() -> None:
    gc.disable()
    before = dict(_untracked.open_evolvers)
    vector = atomic(pvector([0] * 10))
    ev = evolver(vector)
    watch(ev)  # asked even though the collector is off: still nothing kept
    assert id(ev) not in _untracked.open_evolvers
    ev[1] = 1
    done = persist(ev)
    assert gc.is_tracked(vector) and gc.is_tracked(done) and list(done) == [0, 1] + [0] * 8
    _program(_caching_state())  # a pool's transitions keep no evolver either
    assert _untracked.open_evolvers.keys() <= before.keys()
