"""Example tests that pin exact block ids of the pure core against the spec's scenarios."""

from __future__ import annotations

import math

import pytest

import kvfunc as kf
import kvfunc.core._fold


def full(num_blocks: int = 10, block_size: int = 4) -> kf.KVState:
    return kf.KVState.create({"full": kf.FullAttention(num_blocks=num_blocks,
                                                       block_size=block_size)}, 1024)


def swa(num_blocks: int = 10, block_size: int = 4, window: int = 8, max_len: int = 1024
        ) -> kf.KVState:
    return kf.KVState.create({"swa": kf.SlidingWindow(num_blocks=num_blocks, block_size=block_size,
                                                      sliding_window=window)}, max_len)


def ids(state: kf.KVState, rid: kf.RequestId) -> dict[str, tuple[int, ...]]:
    return kf.get_block_ids(state, rid)


def test_fresh_pool_hands_out_ids_from_one_in_order() -> None:
    """A fresh pool hands out 1, 2, 3, ...; the null block 0 is never handed out."""
    s = kf.allocate_slots(full(), "a", 0, 12).state
    s = kf.allocate_slots(s, "b", 0, 5).state
    assert {"full": (1, 2, 3)} == ids(s, "a")
    assert {"full": (4, 5)} == ids(s, "b")
    assert (6, 7, 8, 9) == s.pool_of("full").free_block_ids()


def test_freed_blocks_reenter_at_the_tail_in_logical_order() -> None:
    """Freed ids are reused only after every id already free (FIFO, tail re-entry)."""
    s = kf.allocate_slots(full(), "a", 0, 12).state
    s, delta = kf.free_request(s, "a")
    assert (1, 2, 3) == delta.freed_block_ids
    assert (4, 5, 6, 7, 8, 9, 1, 2, 3) == s.pool_of("full").free_block_ids()
    s = kf.allocate_slots(s, "b", 0, 28).state
    assert {"full": (4, 5, 6, 7, 8, 9, 1)} == ids(s, "b")


def test_decode_grows_one_block_at_each_boundary() -> None:
    """A request grows by one block exactly when its tokens cross a block boundary."""
    s = kf.allocate_slots(full(), "a", 0, 4).state
    assert {"full": (1,)} == ids(s, "a")
    r = kf.allocate_slots(s, "a", 4, 0)
    assert (True, True) == (r.ok, r.state is s)  # success that changes nothing: same value
    s = kf.allocate_slots(r.state, "a", 4, 1).state
    assert {"full": (1, 2)} == ids(s, "a")


@pytest.mark.parametrize("block_size", [1, 2, 3, 4, 16])
@pytest.mark.parametrize("window", [0, 1, 4, 7, 8, 33])
@pytest.mark.parametrize("num_tokens", [0, 1, 2, 5, 8, 9, 31, 64])
def test_sliding_window_prefill_layout(block_size: int, window: int, num_tokens: int) -> None:
    """Prefill gives ``first_blk`` null entries then real blocks up to ``ceil(N/bs)``."""
    s = swa(num_blocks=200, block_size=block_size, window=window)
    table = ids(kf.allocate_slots(s, "a", 0, num_tokens).state, "a")["swa"]
    total = math.ceil(num_tokens / block_size)
    first = max(0, num_tokens - 1 - window) // block_size if num_tokens else 0
    expected = (0,) * first + tuple(range(1, total - first + 1))
    assert expected == table


def test_sliding_window_recycles_before_growing() -> None:
    """Blocks that slid out are nulled and freed before the growth takes new ones."""
    s = kf.allocate_slots(swa(), "a", 0, 20).state
    assert {"swa": (0, 0, 1, 2, 3)} == ids(s, "a")
    r = kf.allocate_slots(s, "a", 20, 1)
    assert {"swa": (0, 0, 0, 2, 3, 4)} == ids(r.state, "a")
    assert (5, 6, 7, 8, 9, 1) == r.state.pool_of("swa").free_block_ids()
    assert (("swa",), ("a",), (2,)) == (r.delta.nulled_keys, r.delta.nulled_request_ids,
                                        r.delta.nulled_positions)


def test_several_recycled_blocks_reenter_highest_index_first() -> None:
    """When several blocks slide out at once they re-enter highest logical index first."""
    s = kf.allocate_slots(swa(block_size=2, window=4), "a", 0, 8).state
    assert {"swa": (0, 1, 2, 3)} == ids(s, "a")
    s = kf.allocate_slots(s, "a", 12, 1).state
    assert {"swa": (0, 0, 0, 0, 4, 5, 6)} == ids(s, "a")
    assert (7, 8, 9, 3, 2, 1) == s.pool_of("swa").free_block_ids()


def test_recycled_blocks_count_as_free_for_the_same_call() -> None:
    """A call whose growth only fits thanks to its own recycling succeeds, as in the seed."""
    s = kf.allocate_slots(swa(num_blocks=5, block_size=4, window=4), "a", 0, 16).state
    assert {"swa": (0, 0, 1, 2)} == ids(s, "a")
    s = kf.allocate_slots(s, "b", 0, 8).state
    assert 0 == kf.num_free_blocks(s, "swa")
    r = kf.allocate_slots(s, "a", 16, 1)
    assert r.ok
    assert {"swa": (0, 0, 0, 2, 1)} == ids(r.state, "a")


def test_refused_allocation_recycles_nothing() -> None:
    """Strict atomicity: a refused call returns the input state, even where the seed recycled."""
    s = kf.allocate_slots(swa(num_blocks=5, block_size=4, window=4), "a", 0, 16).state
    s = kf.allocate_slots(s, "b", 0, 8).state
    r = kf.allocate_slots(s, "b", 8, 9)
    assert (False, True) == (r.ok, r.state is s)
    assert r.delta.is_empty


def test_reservation_counts_every_registered_request_including_empty_ones() -> None:
    """reserved_tokens keeps ceil(reserved/bs) blocks per registered request, caller included."""
    s = kf.allocate_slots(full(), "a", 0, 0).state
    assert {"full": ()} == ids(s, "a")
    r = kf.allocate_slots(s, "b", 0, 8, reserved_tokens=5)
    assert r.ok
    refused = kf.allocate_slots(r.state, "a", 0, 0, reserved_tokens=16)
    assert (False, True) == (refused.ok, refused.state is r.state)
    assert kf.allocate_slots(r.state, "a", 0, 0, reserved_tokens=12).ok


def test_reservation_is_ignored_by_sliding_window_and_mamba() -> None:
    """Only full attention honours reserved_tokens."""
    s = kf.KVState.create({"swa": kf.SlidingWindow(num_blocks=3, block_size=4, sliding_window=8),
                           "m": kf.Mamba(num_blocks=2)}, 64)
    r = kf.allocate_slots(s, "a", 0, 8, reserved_tokens=1000)
    assert r.ok
    assert {"swa": (1, 2), "m": (1,)} == ids(r.state, "a")


def test_mamba_takes_one_block_then_tops_up_to_one_plus_next_n() -> None:
    """Mamba: first allocation 1 block whatever the tokens, any later one tops up to 1+next_n."""
    s = kf.KVState.create({"m": kf.Mamba(num_blocks=8, next_n=2)}, 1024)
    s = kf.allocate_slots(s, "a", 0, 500).state
    assert {"m": (1,)} == ids(s, "a")
    s = kf.allocate_slots(s, "a", 500, 3).state
    assert {"m": (1, 2, 3)} == ids(s, "a")
    r = kf.allocate_slots(s, "a", 503, 3)
    assert r.ok and {"m": (1, 2, 3)} == ids(r.state, "a")


def test_manager_keys_select_groups_and_ignore_unknown_keys() -> None:
    """manager_keys restricts the groups; [] is a successful no-op; unknown keys are ignored."""
    s = kf.KVState.create({"full": kf.FullAttention(num_blocks=10, block_size=4),
                           "m": kf.Mamba(num_blocks=4)}, 1024)
    empty = kf.allocate_slots(s, "a", 0, 9, manager_keys=[])
    assert (True, True) == (empty.ok, empty.state is s)
    r = kf.allocate_slots(s, "a", 0, 9, manager_keys=["m", "nope"])
    assert {"full": (), "m": (1,)} == ids(r.state, "a")
    assert "a" not in r.state.group("full").tables
    with pytest.raises(kf.InvalidTypeError):
        kf.allocate_slots(s, "a", 0, 9, manager_keys="full")


def test_token_counts_are_clamped_to_max_model_len() -> None:
    """Both computed and total tokens are clamped, so the window stops sliding at the cap."""
    s = kf.KVState.create({"full": kf.FullAttention(num_blocks=10, block_size=4)}, 10)
    assert {"full": (1, 2, 3)} == ids(kf.allocate_slots(s, "a", 0, 100).state, "a")
    w = swa(block_size=4, window=4, max_len=12)
    w = kf.allocate_slots(w, "a", 0, 12).state
    assert {"swa": (0, 1, 2)} == ids(w, "a")
    far = kf.allocate_slots(w, "a", 1000, 5).state
    assert {"swa": (0, 0, 2)} == ids(far, "a")


def test_zero_token_allocation_registers_the_request() -> None:
    """allocate_slots(rid, 0, 0) registers the request with empty tables in every group."""
    r = kf.allocate_slots(full(), 7, 0, 0)
    assert r.ok
    assert (("full",), (7,)) == (r.delta.registered_keys, r.delta.registered_request_ids)
    assert {"full": ()} == ids(r.state, 7)


def test_format_usage_counts_the_null_block_as_used() -> None:
    """format_usage reads 'key:used/num_blocks' with the null block counted as used."""
    s = kf.KVState.create({"FullAttention": kf.FullAttention(num_blocks=20, block_size=4),
                           "SlidingWindow": kf.SlidingWindow(num_blocks=10, block_size=4,
                                                             sliding_window=8)}, 1024)
    assert "FullAttention:1/20,SlidingWindow:1/10" == kf.format_usage(s)
    s = kf.allocate_slots(s, "a", 0, 16).state
    assert "FullAttention:5/20,SlidingWindow:4/10" == kf.format_usage(s)
    assert "0/0" == kf.format_usage(kf.KVState.create({}, 8))


@pytest.mark.parametrize(("args", "error", "builtin"), [
    (("a", 0, -1), kf.InvalidArgumentError, ValueError),
    (("a", -5, 1), kf.InvalidArgumentError, ValueError),
    (("a", 0, 1.5), kf.InvalidTypeError, TypeError),
    (("a", "0", 1), kf.InvalidTypeError, TypeError),
    ((1.5, 0, 1), kf.InvalidTypeError, TypeError),
])
def test_bad_arguments_raise_typed_errors(args: tuple[object, ...], error: type[Exception],
                                          builtin: type[Exception]) -> None:
    """Bad token counts or ids raise a kvfunc error that is also the seed's builtin."""
    with pytest.raises(error) as info:
        kf.allocate_slots(full(), *args)  # type: ignore[arg-type]
    assert isinstance(info.value, builtin) and isinstance(info.value, kf.KVFuncError)


def test_recycle_skipped_blocks_is_its_own_transition() -> None:
    """recycle_skipped_blocks nulls and frees slid-out blocks without allocating."""
    s = kf.allocate_slots(swa(block_size=2, window=4), "a", 0, 8).state
    s2, d = kf.recycle_skipped_blocks(s, "a", 12)
    assert {"swa": (0, 0, 0, 0)} == ids(s2, "a")
    assert (3, 2, 1) == d.freed_block_ids
    s3, d3 = kf.recycle_skipped_blocks(s, "zzz", 12)
    assert (True, True) == (s3 is s, d3.is_empty)


def test_free_of_unknown_request_changes_nothing() -> None:
    """Freeing an unknown or already freed request is a no-op returning the same state."""
    s = full()
    s2, d = kf.free_request(s, "ghost")
    assert (True, True) == (s2 is s, d.is_empty)


def test_from_cache_info_groups_like_the_seed() -> None:
    """KVState.from_cache_info builds one group per group_key in first-appearance order."""
    layers = [
        kf.LayerCacheInfo(0, [
            kf.CacheEntry("kv", "SlidingWindow", 64, 2, "bfloat16", True, block_size=16,
                          sliding_window=128),
            kf.MambaCacheEntry(cache_name="conv", dtype="float32", needs_block=True,
                               shape=[4, 8], next_n=1),
        ]),
        kf.LayerCacheInfo(1, [kf.CacheEntry("kv", "FullAttention", 64, 2, "bfloat16", True,
                                            block_size=16)]),
    ]
    info = kf.ModelCacheInfo(2, layers)
    s = kf.KVState.from_cache_info(info, {"SlidingWindow": 9, "Mamba": 5, "FullAttention": 33},
                                   4096)
    assert ("SlidingWindow", "Mamba", "FullAttention") == s.manager_keys
    assert kf.SlidingWindow(num_blocks=9, block_size=16, sliding_window=128) == s.groups[0].policy
    assert kf.Mamba(num_blocks=5, block_size=1, next_n=1) == s.groups[1].policy
    with pytest.raises(kf.InvalidArgumentError, match="Unknown manager_key 'Mamba'"):
        kf.KVState.from_cache_info(info, {"SlidingWindow": 9, "FullAttention": 33}, 4096)


@pytest.mark.parametrize("make", [kf.SlotRequest, lambda *r: r])
def test_quiet_entries_change_nothing(make: object) -> None:
    """A step whose entries all write into blocks they hold returns the input state object
    and an empty delta (plain tuples and SlotRequests alike); one that grows does not."""
    s = kf.allocate_batch(full(), [("a", 0, 5), ("b", 0, 3)]).state
    quiet = kf.allocate_batch(s, [make("a", 5, 3), make("b", 3, 1)])  # type: ignore[operator]
    assert quiet.state is s and quiet.delta.is_empty and quiet.refused == ()
    res = kf.allocate_batch(s, [make("a", 5, 4), make("b", 3, 1), make("c", 0, 1)])  # type: ignore[operator]
    assert ({"full": (1, 2, 4)}, {"full": (3,)}, {"full": (5,)}) == (
        ids(res.state, "a"), ids(res.state, "b"), ids(res.state, "c"))


@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("req", [
    ("a", 0, True), ("a", 0.0, 5), ("a", 0, 5, False), (None, 0, 5), (1.0, 0, 5),
    kf.SlotRequest("a", 0, 5, 0, False), kf.SlotRequest("a", 0, 5, 0, 0.0),
    kf.SlotRequest("a", 0, 5, 0, 0, "full"), kf.SlotRequest("a", 0, -1)])
def test_a_batch_rejects_what_allocate_slots_rejects(req: tuple[object, ...],
                                                     caching: bool) -> None:
    """A batch entry that allocate_slots would refuse to take raises the same typed error,
    wherever it stands in the batch, and leaves nothing behind: the next step on the input
    state gives what it gave before."""
    s = kf.KVState.create({"full": kf.FullAttention(num_blocks=10, block_size=4)}, 1024,
                          enable_prefix_caching=caching)
    s = kf.allocate_batch(s, [("b", 0, 5)]).state
    rid, computed, new, *rest = req
    lookahead, reserved, keys = (list(rest) + [0, 0, None])[:3]
    with pytest.raises(kf.KVFuncError) as expected:
        kf.allocate_slots(s, rid, computed, new, lookahead,  # type: ignore[arg-type]
                          reserved_tokens=reserved, manager_keys=keys)
    before = kf.allocate_batch(s, [("b", 5, 4)])
    for batch in ([req, ("b", 5, 4)], [("b", 5, 4), req]):
        with pytest.raises(type(expected.value)):
            kf.allocate_batch(s, batch)  # type: ignore[list-item]
        kf.check_invariants(s)
        assert before == kf.allocate_batch(s, [("b", 5, 4)])


def test_a_request_named_twice_in_a_batch_runs_twice() -> None:
    """A request id repeated in one batch is two steps in order, as two allocate_slots calls
    would be, and the step's one delta replays them."""
    s = swa(num_blocks=3, block_size=1, window=0)
    res = kf.allocate_batch(s, [kf.SlotRequest(0, 0, 0, 1), kf.SlotRequest(0, 0, 1, 0)])
    one = kf.allocate_slots(s, 0, 0, 0, 1)
    two = kf.allocate_slots(one.state, 0, 0, 1)
    assert two.state == res.state and () == res.refused
    assert res.state == kf.replay(s, [res.delta])
