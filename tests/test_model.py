"""The naive model reproduces the spec's pinned behaviour (so it can judge the core).

Block ids below are worked out by hand from ``spec/reference-behaviour.md``
sections 2-4; the section is named in each docstring.
"""

import pytest

import kvfunc as kf
from kvfunc.testing import NaiveAllocator


def full(num_blocks: int, block_size: int = 4) -> NaiveAllocator:
    """A model with one FullAttention group keyed "FullAttention"."""
    return NaiveAllocator({"FullAttention": kf.FullAttention(num_blocks, block_size)}, 1024)


def swa(num_blocks: int, block_size: int, window: int, max_model_len: int = 1024
        ) -> NaiveAllocator:
    """A model with one SlidingWindow group keyed "swa"."""
    return NaiveAllocator({"swa": kf.SlidingWindow(num_blocks, block_size, window)},
                          max_model_len)


def test_fresh_pool_hands_out_ids_from_one_in_order() -> None:
    """§2: block 0 is the null block; a fresh pool hands out 1, 2, 3, ... FIFO."""
    m = full(12)
    assert m.allocate_slots("a", 0, 9)
    assert m.allocate_slots("b", 0, 4)
    assert {"FullAttention": (1, 2, 3)} == m.get_block_ids("a")
    assert {"FullAttention": (4,)} == m.get_block_ids("b")
    assert (5, 6, 7, 8, 9, 10, 11) == m.free_block_ids("FullAttention")


def test_freed_ids_reenter_at_the_tail_in_logical_order() -> None:
    """§2/§3.1: freed blocks are reused only after every block already free."""
    m = full(6)
    assert m.allocate_slots("a", 0, 8)
    assert m.allocate_slots("b", 0, 4)
    m.free("a")
    assert (4, 5, 1, 2) == m.free_block_ids("FullAttention")
    assert m.allocate_slots("c", 0, 16)
    assert {"FullAttention": (4, 5, 1, 2)} == m.get_block_ids("c")


def test_format_usage_counts_the_null_block_as_used() -> None:
    """§4: a fresh pool reads 1/N, a full one N/N; no groups reads 0/0."""
    m = full(12)
    assert "FullAttention:1/12" == m.format_usage()
    assert m.allocate_slots("a", 0, 44)
    assert "FullAttention:12/12" == m.format_usage()
    assert "0/0" == NaiveAllocator({}, 16).format_usage()


def test_sliding_window_prefill_puts_nulls_before_the_window() -> None:
    """§3.3: N=40, bs=8, W=16 gives [null, null, real, real, real]."""
    m = swa(num_blocks=8, block_size=8, window=16)
    assert m.allocate_slots("a", 0, 40)
    assert {"swa": (0, 0, 1, 2, 3)} == m.get_block_ids("a")


def test_first_decode_recycles_the_extra_prefill_block() -> None:
    """§9.10: prefill keeps W+1 tokens; the next step recycles the head block, then grows."""
    m = swa(num_blocks=8, block_size=4, window=8)
    assert m.allocate_slots("a", 0, 12)
    assert {"swa": (1, 2, 3)} == m.get_block_ids("a")
    assert m.allocate_slots("a", 12, 1)
    assert {"swa": (0, 2, 3, 4)} == m.get_block_ids("a")
    assert (5, 6, 7, 1) == m.free_block_ids("swa")


def test_several_recycled_blocks_reenter_highest_index_first() -> None:
    """§3.1/§9.11: blocks recycled in one call go back in descending logical order."""
    m = swa(num_blocks=8, block_size=4, window=4)
    assert m.allocate_slots("a", 0, 12)
    assert {"swa": (0, 1, 2)} == m.get_block_ids("a")
    assert m.allocate_slots("a", 16, 1)
    assert {"swa": (0, 0, 0, 3, 4)} == m.get_block_ids("a")
    assert (5, 6, 7, 2, 1) == m.free_block_ids("swa")


def test_reservation_counts_every_registered_request() -> None:
    """§3.1/§9.9: ceil(reserved/bs) per registered request, empty lists and the caller too."""
    m = full(5, block_size=16)
    assert m.allocate_slots("a", 0, 0)
    assert m.allocate_slots("b", 0, 0)
    assert {"a", "b"} == m.registered_request_ids("FullAttention")
    # c is not registered yet: reserve 1 block for each of a and b, 4 free.
    assert m.allocate_slots("c", 0, 16, reserved_tokens=16)
    assert {"FullAttention": (1,)} == m.get_block_ids("c")
    # a needs nothing, but 3 registered x 2 blocks > 3 free: refused all the same.
    assert not m.allocate_slots("a", 0, 0, reserved_tokens=32)


def test_only_full_attention_applies_reservations() -> None:
    """§3.3/§3.4: SlidingWindow and Mamba ignore reserved_tokens."""
    m = NaiveAllocator({"swa": kf.SlidingWindow(3, 4, 8), "m": kf.Mamba(2)}, 1024)
    assert m.allocate_slots("a", 0, 8, reserved_tokens=1000)
    assert {"swa": (1, 2), "m": (1,)} == m.get_block_ids("a")


def test_mamba_takes_one_block_then_tops_up_to_one_plus_next_n() -> None:
    """§3.4: the first allocation takes one block whatever the tokens; later ones top up."""
    m = NaiveAllocator({"m": kf.Mamba(8, next_n=2)}, 1024)
    assert m.allocate_slots("a", 0, 100)
    assert {"m": (1,)} == m.get_block_ids("a")
    assert m.allocate_slots("a", 100, 3)
    assert {"m": (1, 2, 3)} == m.get_block_ids("a")
    assert m.allocate_slots("a", 103, 3)
    assert {"m": (1, 2, 3)} == m.get_block_ids("a")


def test_token_counts_are_clamped_to_max_model_len() -> None:
    """§4: totals and computed tokens are clamped, so the window stops sliding at L."""
    m = NaiveAllocator({"FullAttention": kf.FullAttention(20, 16)}, 64)
    assert m.allocate_slots("a", 0, 1000)
    assert {"FullAttention": (1, 2, 3, 4)} == m.get_block_ids("a")
    w = swa(num_blocks=8, block_size=4, window=4, max_model_len=16)
    assert w.allocate_slots("a", 0, 16)
    assert {"swa": (0, 0, 1, 2)} == w.get_block_ids("a")
    assert w.allocate_slots("a", 100, 1)
    assert w.allocate_slots("a", 200, 5)
    assert {"swa": (0, 0, 0, 2)} == w.get_block_ids("a")


def test_manager_keys_select_groups_and_ignore_unknown_keys() -> None:
    """§4: [] is a successful no-op (not even a registration); unknown keys are ignored."""
    m = NaiveAllocator({"f": kf.FullAttention(4, 4), "m": kf.Mamba(4)}, 1024)
    assert m.allocate_slots("a", 0, 8, manager_keys=[])
    assert set() == m.request_ids()
    assert m.allocate_slots("a", 0, 8, manager_keys=["m", "nope"])
    assert {"f": (), "m": (1,)} == m.get_block_ids("a")
    assert set() == m.registered_request_ids("f")


def test_zero_token_call_registers_the_request_everywhere() -> None:
    """§4: allocate_slots(rid, 0, 0) registers rid with empty lists in every group."""
    m = NaiveAllocator({"f": kf.FullAttention(4, 4), "s": kf.SlidingWindow(4, 4, 4)}, 64)
    assert m.allocate_slots("a", 0, 0)
    assert ({"a"}, {"a"}) == (m.registered_request_ids("f"), m.registered_request_ids("s"))
    assert {"f": (), "s": ()} == m.get_block_ids("a")


def test_a_refused_call_changes_nothing_unlike_the_seed() -> None:
    """kvfunc's deviation from §4/§9.8: a refusal keeps the window's head block in place."""
    m = NaiveAllocator({"swa": kf.SlidingWindow(8, 4, 4), "f": kf.FullAttention(2, 4)}, 1024)
    assert m.allocate_slots("a", 0, 4)
    # The seed would null and free swa block 1 here before the full group refuses.
    assert not m.allocate_slots("a", 12, 4)
    assert {"swa": (1,), "f": (1,)} == m.get_block_ids("a")
    assert (2, 3, 4, 5, 6, 7) == m.free_block_ids("swa")


def test_invalid_counts_raise_and_change_nothing() -> None:
    """§4: negative num_new_tokens, or a negative total in a selected group, raises."""
    m = full(8)
    assert m.allocate_slots("a", 0, 4)
    with pytest.raises(ValueError, match="num_new_tokens must be non-negative"):
        m.allocate_slots("a", 4, -1)
    with pytest.raises(ValueError, match="num_tokens must be non-negative"):
        m.allocate_slots("b", 0, 0, -1)
    assert m.allocate_slots("b", 0, 0, -1, manager_keys=[])
    assert ({"FullAttention": (1,)}, {"a"}) == (m.get_block_ids("a"), m.request_ids())


def test_free_of_unknown_or_freed_requests_is_a_no_op() -> None:
    """§3.1/§4: freeing an unknown request, or one twice, changes nothing."""
    m = full(8)
    assert m.allocate_slots("a", 0, 8)
    m.free("a")
    m.free("a")
    m.free("never")
    assert (3, 4, 5, 6, 7, 1, 2) == m.free_block_ids("FullAttention")
    assert set() == m.request_ids()


def test_batch_is_all_or_nothing_when_a_request_raises() -> None:
    """kvfunc's contract: a batch with an invalid request leaves the model as it was."""
    m = full(8)
    with pytest.raises(ValueError, match="num_new_tokens"):
        m.allocate_batch([("a", 0, 4), ("b", 0, -1)])
    assert (set(), 7) == (m.request_ids(), m.num_free_blocks("FullAttention"))
