"""Big per-block containers and the garbage collector.

A pool's arrays are plain lists in a store its lineage shares
(``kvfunc.core._lineage``): a transition writes them in place, so it makes
no new big container for a young collection to walk.  The host tier's free
stack is a persistent vector of ints that ``kvfunc.core._untracked`` keeps
from the collector.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest
from pyrsistent import pvector

import kvfunc as kf
from kvfunc.core import _untracked
from kvfunc.core._untracked import atomic


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


def _store(state: kf.KVState) -> Any:
    ver = state.pools[0].ver
    assert ver is not None and ver.store is not None, "not the head of its lineage"
    return ver.store


def test_a_transition_makes_no_big_container_for_the_collector() -> None:
    n = 4096
    state = kf.KVState.create({"full": kf.FullAttention(num_blocks=n, block_size=4),
                               "swa": kf.SlidingWindow(num_blocks=n, block_size=4,
                                                       sliding_window=8)},
                              256, enable_prefix_caching=True, layout="shared")
    store = _store(state)
    arrays = [store.refs, store.hash_of, store.prev, store.next, store.by_key]
    gc.collect()  # the arrays are old now; whatever a transition makes is young
    state = _program(state)
    young = [o for o in gc.get_objects(generation=0)
             if type(o) in (list, dict) and len(o) >= n]
    assert not young, [len(o) for o in young]
    store = _store(state)  # the same lists and dict, written in place
    assert [store.refs, store.hash_of, store.prev, store.next, store.by_key] == arrays
    assert all(x is y for x, y in zip(arrays, [store.refs, store.hash_of, store.prev,
                                                store.next, store.by_key], strict=True))
    kf.check_invariants(state)


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


def test_atomic_untracks_a_vector_while_the_collector_is_on_only() -> None:
    pytest.importorskip("pvectorc")
    assert _untracked._untrack is not None
    vector = atomic(pvector([0] * 100))
    assert not gc.is_tracked(vector) and list(vector) == [0] * 100
    gc.disable()
    kept = atomic(pvector([1, 2]))
    assert gc.is_tracked(kept) and list(kept) == [1, 2]
