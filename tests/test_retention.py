"""Retention priority in the device pool: ``free_request(priority=)``.

The pool hands out (so evicts) the cached free blocks of the lowest priority
first, the least recently freed first within one priority; blocks that cache
nothing still come first.  Priority 0 everywhere is vLLM's queue, unchanged.
"""

from __future__ import annotations

from typing import Any

import pytest

import kvfunc as kf
from kvfunc.core import BlockHashes


def caching(num_blocks: int = 9, **extra: Any) -> kf.KVState:
    return kf.KVState.create({"f": kf.FullAttention(num_blocks=num_blocks, block_size=4)}, 64,
                             enable_prefix_caching=True, **extra)


def admit(state: kf.KVState, rid: str, first: int, log: list[kf.BlocksChanged],
          n: int = 8) -> kf.KVState:
    """``rid`` computes ``n`` tokens ``first ..``: its full blocks are cached."""
    tokens = list(range(first, first + n))
    r = kf.allocate_slots(state, rid, 0, n, block_hashes=BlockHashes.of(tokens, 4))
    assert r.ok
    log.append(r.delta)
    return r.state


def three_freed(priorities: tuple[int, int, int]) -> tuple[kf.KVState, kf.KVState, list[Any]]:
    """a (blocks 1, 2), b (3, 4), c (5, 6) cached and freed in that order at ``priorities``."""
    s0 = caching()
    log: list[kf.BlocksChanged] = []
    s = s0
    for rid, first in (("a", 0), ("b", 100), ("c", 200)):
        s = admit(s, rid, first, log)
    for rid, p in zip("abc", priorities, strict=True):
        s, d = kf.free_request(s, rid, priority=p)
        log.append(d)
    kf.check_invariants(s)
    assert kf.replay(s0, log) == s
    return s0, s, log


def evicted_by(state: kf.KVState, n: int) -> tuple[int, ...]:
    r = kf.allocate_slots(state, "new", 0, 4 * n)
    assert r.ok
    kf.check_invariants(r.state)
    return r.delta.evicted_block_ids


def test_lower_priorities_are_evicted_first_and_uncached_blocks_before_any() -> None:
    _, s, log = three_freed((5, -2, 0))
    # blocks 7 and 8 cache nothing: handed out first; then b (-2), c (0), a (5); tails first
    assert s.pools[0].free_block_ids() == (7, 8, 4, 3, 6, 5, 2, 1)
    assert evicted_by(s, 6) == (4, 3, 6, 5)
    assert log[3].retained_priorities == (5,) and log[5].retained_priorities == ()


def test_priority_zero_everywhere_is_the_queue_without_priorities() -> None:
    _, with_zero, log = three_freed((0, 0, 0))
    s, plain = caching(), []
    for rid, first in (("a", 0), ("b", 100), ("c", 200)):
        s = admit(s, rid, first, plain)
    for rid in "abc":
        s, d = kf.free_request(s, rid)
        plain.append(d)
    assert with_zero == s and log == plain
    assert with_zero.pools[0].queue.levels == ()
    assert not any(d.retained_keys for d in log)


def test_one_priority_alone_keeps_lru_order() -> None:
    _, s, _ = three_freed((3, 3, 3))
    assert s.pools[0].free_block_ids() == (7, 8, 2, 1, 4, 3, 6, 5)
    assert evicted_by(s, 4) == (2, 1)


def test_states_with_the_same_free_ids_but_other_priorities_differ() -> None:
    _, a, _ = three_freed((1, 2, 3))
    _, b, _ = three_freed((0, 0, 0))
    assert a.pools[0].free_block_ids() == b.pools[0].free_block_ids()
    assert a != b


def test_a_prefix_hit_takes_a_block_out_of_its_priority_segment() -> None:
    s0, s, log = three_freed((5, -2, 0))
    hashes = BlockHashes.of(list(range(100, 112)), 4)
    hit = kf.lookup_prefix(s, hashes)
    assert hit.num_tokens == 8
    r = kf.allocate_slots(s, "b2", 8, 4, block_hashes=hashes, prefix_hit=hit)
    assert r.ok and r.state.group("f").tables["b2"] == (3, 4, 7)
    kf.check_invariants(r.state)
    assert kf.replay(s0, [*log, r.delta]) == r.state
    assert evicted_by(r.state, 3) == (6, 5)


def test_resetting_the_cache_keeps_the_order_and_drops_the_markers() -> None:
    _, s, _ = three_freed((5, -2, 0))
    s2, _ = kf.reset_prefix_cache(s)
    kf.check_invariants(s2)
    assert s2.pools[0].queue.levels == ()
    assert s2.pools[0].free_block_ids() == s.pools[0].free_block_ids()


def test_a_shared_pool_keeps_priorities_across_its_groups() -> None:
    groups = {"full": kf.FullAttention(num_blocks=17, block_size=4),
              "swa": kf.SlidingWindow(num_blocks=17, block_size=4, sliding_window=8)}
    s0 = kf.KVState.create(groups, 64, enable_prefix_caching=True, layout="shared")
    log: list[kf.BlocksChanged] = []
    s = s0
    for rid, first in (("a", 0), ("b", 100)):
        s = admit(s, rid, first, log)
    held = {rid: {b for g in s.groups for b in g.tables[rid]} for rid in "ab"}
    for rid, p in (("a", 4), ("b", 1)):
        s, d = kf.free_request(s, rid, priority=p)
        log.append(d)
    kf.check_invariants(s)
    assert kf.replay(s0, log) == s
    evicted: list[int] = []
    for n in range(12):  # one block per group at a time, until b's four are gone
        r = kf.allocate_slots(s, f"n{n}", 0, 4)
        assert r.ok
        s = r.state
        evicted += r.delta.evicted_block_ids
        if len(evicted) >= 4:
            break
    kf.check_invariants(s)
    assert set(evicted[:4]) == held["b"] and not set(evicted) & held["a"]


def test_tiers_free_a_request_at_its_priority_on_the_device() -> None:
    dev = caching()
    t = kf.TieredState.create(dev, host_blocks=4)
    r = kf.allocate_tiered(t, [("a", 0, 8)], block_hashes={"a": BlockHashes.of(list(range(8)), 4)},
                           priorities={"a": 7})
    t2, d = kf.free_tiered(r.state, "a")
    assert d.device.retained_priorities == (7,)
    assert ("priority", 7) in t2.device.pools[0].queue_layout()
    kf.check_invariants(t2)


@pytest.mark.parametrize("bad, error", [
    (True, kf.InvalidTypeError), (1.0, kf.InvalidTypeError), ("1", kf.InvalidTypeError),
    (None, kf.InvalidTypeError), (kf.MAX_PRIORITY + 1, kf.InvalidArgumentError),
    (-kf.MAX_PRIORITY - 1, kf.InvalidArgumentError), (10**4000, kf.InvalidArgumentError),
])
def test_a_bad_priority_is_a_typed_error_that_changes_nothing(bad: object,
                                                              error: type[Exception]) -> None:
    s = admit(caching(), "a", 0, [])
    before = repr(s.identity())
    with pytest.raises(error, match="priority") as info:
        kf.free_request(s, "a", priority=bad)  # type: ignore[arg-type]
    assert len(str(info.value)) < 300
    assert repr(s.identity()) == before
    with pytest.raises(error, match="priority"):
        kf.allocate_tiered(kf.TieredState.create(caching(), host_blocks=2), [("a", 0, 4)],
                           priorities={"a": bad})


def retained(order: str, keys: tuple[Any, ...], priorities: tuple[Any, ...],
             freed: tuple[int, ...] = (2, 1)) -> kf.BlocksChanged:
    """a's release with a Retained row (or several) where ``order`` puts them."""
    return kf.BlocksChanged(
        order=order, released_keys=("f",), released_request_ids=("a",),
        freed_keys=("f",) * len(freed), freed_block_ids=freed,
        retained_keys=keys, retained_priorities=priorities)


@pytest.mark.parametrize("delta, message", [
    (retained("LYFF", ("f",), (0,)), "not a retention priority other than 0"),
    (retained("LYFF", ("f",), (kf.MAX_PRIORITY + 1,)), "not a retention priority"),
    (retained("LYFF", ("f",), (True,)), "retained_priorities holds True"),
    (retained("LYFF", ("f",), ("1",)), "retained_priorities holds '1'"),
    (retained("LYYFF", ("f", "f"), (1, 2)), "no Freed run after it"),
    (retained("LFFY", ("f",), (1,)), "no Freed run after it"),
    (retained("YLFF", ("f",), (1,)), "no Freed run after it"),
    (retained("LYFF", ("g",), (1,)), "unknown manager_key 'g'"),
    (retained("LYFF", (3,), (1,)), "retained_keys holds 3"),
])
def test_a_forged_retention_row_is_refused_by_replay(delta: kf.BlocksChanged,
                                                     message: str) -> None:
    log: list[kf.BlocksChanged] = []
    s0 = caching()
    admit(s0, "a", 0, log)
    with pytest.raises(kf.ReplayMismatchError, match=message):
        kf.replay(s0, [*log, delta])


def test_a_retention_row_on_a_state_without_a_prefix_cache_is_refused() -> None:
    s0 = kf.KVState.create({"f": kf.FullAttention(num_blocks=9, block_size=4)}, 64)
    r = kf.allocate_slots(s0, "a", 0, 8)
    s1, d = kf.free_request(r.state, "a", priority=3)  # nothing cached: no Retained row
    assert not d.retained_keys and s1 == kf.free_request(r.state, "a")[0]
    with pytest.raises(kf.ReplayMismatchError, match="not a group with a prefix cache"):
        kf.replay(s0, [r.delta, retained("LYFF", ("f",), (3,), (1, 2))])


def test_the_right_retention_row_replays() -> None:
    log: list[kf.BlocksChanged] = []
    s0 = caching()
    s = admit(s0, "a", 0, log)
    s2, d = kf.free_request(s, "a", priority=2)
    assert d == retained("LYFF", ("f",), (2,))
    assert kf.replay(s0, [*log, d]) == s2


def test_a_free_block_evicted_on_request_keeps_its_place_as_in_vllm() -> None:
    s0, s, log = three_freed((5, -2, 0))
    s2, d = kf.evict_blocks(s, [1])  # a's first block, cached at priority 5
    log.append(d)
    assert d.evicted_block_ids == (1,)
    assert s2.pools[0].queue_layout() == s.pools[0].queue_layout()
    kf.check_invariants(s2)
    assert kf.replay(s0, log) == s2


def test_a_retention_row_before_a_run_of_a_huge_key_gets_a_short_message() -> None:
    log: list[kf.BlocksChanged] = []
    s0 = caching()
    admit(s0, "a", 0, log)
    bad = kf.BlocksChanged(order="LYFF", released_keys=("f",), released_request_ids=("a",),
                           freed_keys=("x" * 100_000,) * 2, freed_block_ids=(2, 1),
                           retained_keys=("f",), retained_priorities=(3,))
    with pytest.raises(kf.ReplayMismatchError) as info:
        kf.replay(s0, [*log, bad])
    assert len(str(info.value)) < 400
