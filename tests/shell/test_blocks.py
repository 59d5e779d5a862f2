"""Block copies, swaps and zeroing over every cache tensor, checked before any write."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kvfunc as kf
from kvfunc import (
    BlockIndexError,
    BlocksChanged,
    InvalidArgumentError,
    InvalidTypeError,
    MissingKeyError,
)
from kvfunc.shell import apply_delta, copy_blocks, swap_blocks, zero_blocks


def caches(num_blocks: int = 6) -> list[torch.Tensor]:
    """Two layouts' worth of distinct blocks: [B, 2, 3] and a Mamba-like [B, 5]."""
    return [torch.arange(num_blocks * 6, dtype=torch.float32).view(num_blocks, 2, 3),
            torch.arange(num_blocks * 5, dtype=torch.int64).view(num_blocks, 5) * -1]


def moved(tensors: list[torch.Tensor], src: list[int], dst: list[int]) -> list[torch.Tensor]:
    """The reference: every source read first, then written to its destination."""
    out = [t.clone() for t in tensors]
    for o, t in zip(out, tensors, strict=True):
        o[dst] = t[src]
    return out


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Element-wise equality of two tensor lists."""
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5)), max_size=6,
                unique_by=lambda pair: pair[1]))
def test_copy_blocks_copies_all_pairs_at_once(pairs: list[tuple[int, int]]) -> None:
    """copy_blocks equals reading every source, then writing every destination."""
    tensors = caches()
    src, dst = [s for s, _ in pairs], [d for _, d in pairs]
    expected = moved(tensors, src, dst)
    copy_blocks(tensors, src, dst)
    assert same(expected, tensors)


def test_chained_copies_read_the_old_blocks() -> None:
    """1 -> 2 and 2 -> 3 in one call leave the old block 2 in block 3."""
    t = torch.arange(5.0).view(5, 1)
    copy_blocks({"k": t}, torch.tensor([1, 2]), [2, 3])
    assert [0.0, 1.0, 1.0, 2.0, 4.0] == t.view(-1).tolist()


def test_swap_moves_blocks_between_pools_of_different_sizes() -> None:
    """Swap-out then swap-in restores the blocks; tensors pair by key."""
    device = {"k": torch.randn(4, 2, 3), "v": torch.randn(4, 2, 3)}
    original = {k: t.clone() for k, t in device.items()}
    host = {"v": torch.zeros(9, 2, 3), "k": torch.zeros(9, 2, 3)}
    swap_blocks(device, host, [3, 1], [8, 0])
    assert torch.equal(original["k"][[3, 1]], host["k"][[8, 0]])
    zero_blocks(device, [1, 3])
    swap_blocks(host, device, [8, 0], [3, 1])
    assert same(list(original.values()), list(device.values()))


def test_zero_blocks_zeroes_only_the_named_blocks() -> None:
    """Named blocks (repeats allowed) become zero in every tensor; others stay."""
    tensors = caches()
    expected = [t.clone() for t in tensors]
    for e in expected:
        e[[0, 4]] = 0
    zero_blocks(tensors, [4, 0, 4])
    assert same(expected, tensors)


@pytest.mark.parametrize(("src", "dst", "error", "match"), [
    ([0, 1], [2], InvalidArgumentError, "must have the same length, but got 2 and 1"),
    ([0, 1], [2, 2], InvalidArgumentError, "writes block 2 more than once"),
    ([0], [6], BlockIndexError, r"dst_block_ids holds block id 6, out of range \[0, 6\) for "
     r"tensors\[0\]"),
    ([-1], [2], BlockIndexError, "src_block_ids holds block id -1"),
    ([0], [4], BlockIndexError, r"out of range \[0, 4\) for tensors\[1\]"),
    ([0.5], [2], InvalidTypeError, "src_block_ids must be a 1-D integer"),
])
def test_bad_copies_raise_and_write_nothing(src: Any, dst: Any, error: type[Exception],
                                           match: str) -> None:
    """Mismatched lengths, repeated or out-of-range ids raise before any tensor is written."""
    tensors = [caches(6)[0], caches(4)[0]]
    before = [t.clone() for t in tensors]
    with pytest.raises(error, match=match):
        copy_blocks(tensors, src, dst)
    assert same(before, tensors)


@pytest.mark.parametrize(("src", "dst", "match", "error"), [
    ([torch.zeros(3, 2)], [torch.zeros(3, 2, dtype=torch.float16)],
     r"src_tensors\[0\] is torch.float32 but dst_tensors\[0\] is torch.float16", InvalidTypeError),
    ([torch.zeros(3, 2)], [torch.zeros(3, 3)], "blocks of src_tensors\\[0\\] have shape \\[2\\] "
     "but blocks of dst_tensors\\[0\\] have shape \\[3\\]", InvalidArgumentError),
    ([torch.zeros(3, 2)], [], "1 source tensors but 0 destination tensors",
     InvalidArgumentError),
    ({"k": torch.zeros(3, 2)}, {"v": torch.zeros(3, 2)}, "same keys", InvalidArgumentError),
    (torch.zeros(3, 2), [torch.zeros(3, 2)], "not one tensor", InvalidTypeError),
    ([torch.zeros(())], [torch.zeros(3)], "block dimension", InvalidTypeError),
])
def test_bad_swaps_raise_typed_errors(src: Any, dst: Any, match: str,
                                      error: type[Exception]) -> None:
    """Mismatched dtypes, block shapes, keys or counts are typed errors naming the tensors."""
    with pytest.raises(error, match=match):
        swap_blocks(src, dst, [0], [1])


def test_a_bad_swap_destination_leaves_every_tensor_alone() -> None:
    """An id past the smaller destination pool raises before the first tensor pair is written."""
    device = [torch.ones(4, 2), torch.ones(4, 2)]
    host = [torch.zeros(8, 2), torch.zeros(3, 2)]
    with pytest.raises(BlockIndexError, match=r"block id 5, out of range \[0, 3\) for "
                       r"dst_tensors\[1\]"):
        swap_blocks(device, host, [0, 1], [2, 5])
    assert [0.0, 0.0] == [float(h.sum()) for h in host]


def test_apply_delta_zeroes_new_blocks_and_copies() -> None:
    """With zero_new_blocks, the blocks a transition took are zeroed; plain copies run too."""
    state = kf.KVState.create({"full": kf.FullAttention(num_blocks=8, block_size=2),
                               "swa": kf.SlidingWindow(num_blocks=8, block_size=2,
                                                       sliding_window=2)}, 64)
    result = kf.allocate_batch(state, [("a", 0, 6)])
    tensors = {"full": caches(8), "swa": caches(8)}
    expected = {k: [t.clone() for t in ts] for k, ts in tensors.items()}
    for key, ts in expected.items():
        for t in ts:
            t[list(result.delta.new_block_ids(key))] = 0
    apply_delta(tensors, result.delta, zero_new_blocks=True)
    assert [True, True] == [same(expected[k], tensors[k]) for k in ("full", "swa")]
    fork = BlocksChanged(order="CC", copied_keys=("full", "full"), copied_request_ids=("c", "c"),
                         copied_positions=(0, 1), copied_src_block_ids=(1, 2),
                         copied_dst_block_ids=(5, 6))
    expected["full"] = moved(tensors["full"], [1, 2], [5, 6])
    apply_delta(tensors, fork)
    assert same(expected["full"], tensors["full"])
    expected["full"] = moved(tensors["full"], [1, 2], [5, 6])
    apply_delta(tensors, kf.TierDelta(device=fork))  # a tiered delta: its device part
    assert same(expected["full"], tensors["full"])


def test_apply_delta_checks_every_key_before_writing() -> None:
    """A bad copy in the second key, or a key without tensors, leaves the first key untouched."""
    tensors = {"full": caches(8), "swa": caches(2)}
    before = [t.clone() for t in tensors["full"]]
    delta = BlocksChanged(order="AC", appended_keys=("full",), appended_request_ids=("a",),
                          appended_block_ids=(3,), copied_keys=("swa",), copied_request_ids=("a",),
                          copied_positions=(0,), copied_src_block_ids=(1,),
                          copied_dst_block_ids=(5,))
    with pytest.raises(BlockIndexError, match="copy destinations of 'swa' holds block id 5"):
        apply_delta(tensors, delta, zero_new_blocks=True)
    with pytest.raises(MissingKeyError, match="manager_key='swa', which has no tensors"):
        apply_delta({"full": tensors["full"]}, delta, zero_new_blocks=True)
    assert same(before, tensors["full"])
    with pytest.raises(InvalidTypeError, match="expected a BlocksChanged or TierDelta delta"):
        apply_delta(tensors, None)  # type: ignore[arg-type]
