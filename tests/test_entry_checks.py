"""Arguments are checked once, at the entry: a bad one is a typed error and changes nothing."""

from __future__ import annotations

from typing import Any

import pytest

import kvfunc as kf
from kvfunc.compat import FullAttentionManager, KVCacheManager


def state(caching: bool = False) -> kf.KVState:
    """A small full-attention state holding request "a" (two blocks)."""
    s = kf.KVState.create({"full": kf.FullAttention(num_blocks=8, block_size=4)}, 64,
                          enable_prefix_caching=caching)
    return kf.allocate_slots(s, "a", 0, 6).state


@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("rid", [True, False, 1.0, None, b"a", ("a",)])
def test_a_request_id_that_is_not_a_str_or_int_is_refused_everywhere(rid: Any,
                                                                     caching: bool) -> None:
    """A bool id would alias request 1 or 0; every transition and query refuses it."""
    s = kf.allocate_slots(state(caching), 1, 0, 4).state
    calls = [lambda: kf.allocate_slots(s, rid, 0, 1),
             lambda: kf.allocate_batch(s, [(rid, 0, 1)]),
             lambda: kf.free_request(s, rid),
             lambda: kf.recycle_skipped_blocks(s, rid, 0),
             lambda: kf.get_block_ids(s, rid)]
    for call in calls:
        with pytest.raises(kf.InvalidTypeError, match="request_id must be a str or an int"):
            call()
    assert {"full": (3,)} == kf.get_block_ids(s, 1)


@pytest.mark.parametrize("computed", [-3, -100])
def test_negative_computed_tokens_are_an_error_naming_the_argument(computed: int) -> None:
    """A negative computed_tokens is refused, and the message names that argument."""
    s = state()
    for call in (lambda: kf.allocate_slots(s, "b", computed, 5),
                 lambda: kf.allocate_batch(s, [("b", computed, 5)]),
                 lambda: kf.recycle_skipped_blocks(s, "a", computed)):
        with pytest.raises(kf.InvalidArgumentError, match="computed_tokens must be non-negative"):
            call()


@pytest.mark.parametrize("kwargs", [
    {"computed_tokens": True}, {"num_new_tokens": False}, {"lookahead_tokens": True},
    {"reserved_tokens": None}, {"reserved_tokens": False}, {"num_new_tokens": 1.0}])
def test_compat_refuses_bools_floats_and_none_counts(kwargs: dict[str, Any]) -> None:
    """The seed-compatible manager refuses what the pure API refuses; its state is unchanged."""
    mgr = KVCacheManager(64, [FullAttentionManager("FullAttention", 8, 4)], None)
    assert mgr.allocate_slots("a", 0, 6)
    before = mgr.state
    args = {"request_id": "b", "computed_tokens": 0, "num_new_tokens": 4} | kwargs
    with pytest.raises(kf.KVFuncError):
        mgr.allocate_slots(**args)
    assert before == mgr.state and kf.check_invariants(mgr.state) is None


@pytest.mark.parametrize("bad", [None, "state", 3])
def test_a_non_state_is_a_typed_error(bad: Any) -> None:
    """Transitions and queries given something other than a state say what they got."""
    for call in (lambda: kf.allocate_slots(bad, "a", 0, 1), lambda: kf.allocate_batch(bad, []),
                 lambda: kf.free_request(bad, "a"), lambda: kf.get_block_ids(bad, "a"),
                 lambda: kf.format_usage(bad), lambda: kf.replay(bad, [])):
        with pytest.raises(kf.InvalidTypeError, match="must be a KVState, but got"):
            call()


def test_passing_a_result_where_its_state_was_meant_says_so() -> None:
    """An AllocationResult in place of its state: the message says to pass its .state."""
    result = kf.allocate_slots(state(), "b", 0, 1)
    with pytest.raises(kf.InvalidTypeError, match=r"pass its \.state"):
        kf.allocate_slots(result, "b", 1, 1)  # type: ignore[arg-type]


def test_a_malformed_batch_entry_is_a_typed_error() -> None:
    """Entries that are not tuples, too short or too long, or hold an unhashable id."""
    s = state()
    for entries in ([["a", 6, 1]], [("a", 6)], [("a", 6, 1, 0, 0, None, None, None, 9)],
                    [(["a"], 0, 1)], None):
        with pytest.raises(kf.InvalidTypeError):
            kf.allocate_batch(s, entries)  # type: ignore[arg-type]


def test_a_pool_past_the_documented_bound_is_refused_before_anything_is_built() -> None:
    """num_blocks past MAX_NUM_BLOCKS is a typed error, not a MemoryError mid-way."""
    with pytest.raises(kf.InvalidArgumentError, match=f"at most {kf.MAX_NUM_BLOCKS}"):
        kf.FullAttention(num_blocks=10**9, block_size=16)
    assert 1 << 24 == kf.MAX_NUM_BLOCKS


def test_an_error_shows_a_short_excerpt_of_a_huge_value() -> None:
    """A 100 MB bad value yields a message of a few hundred characters, built quickly."""
    s = state()
    huge = b"x" * (100 << 20)
    for call in (lambda: kf.allocate_slots(s, huge, 0, 1),  # type: ignore[arg-type]
                 lambda: kf.allocate_batch(s, [("a", [0] * 10**7, 1)])):
        with pytest.raises(kf.KVFuncError) as info:
            call()
        assert len(str(info.value)) < 300
