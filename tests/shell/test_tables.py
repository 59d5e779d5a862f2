"""Block tables and slot mappings rebuilt from the state (spec §5.6, §5.7)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvfunc import InvalidArgumentError, InvalidTypeError
from kvfunc.compat import (
    FullAttentionManager,
    KVCacheManager,
    MambaManager,
    SlidingWindowManager,
    prepare_block_tables,
    prepare_slot_mapping,
)
from kvfunc.shell import slot_mapping


def reqs(*ids: Any) -> list[SimpleNamespace]:
    """Request objects as the seed's scheduler passes them."""
    return [SimpleNamespace(request_id=i) for i in ids]


def hybrid() -> KVCacheManager:
    """Full (bs 4), sliding window 8 (bs 4), Mamba (next_n 1) and a compressed full group.

    "a" holds 10 tokens, "b" 3 tokens (Mamba: one state block each, then "a" a second).
    """
    mgr = KVCacheManager(64, [
        FullAttentionManager("FullAttention", 16, 4),
        SlidingWindowManager("SlidingWindow", 16, 4, sliding_window=4),
        MambaManager("Mamba", 8, 1, next_n=1),
        FullAttentionManager("FullAttention", 16, 4, manager_key="c", compress_ratio=4),
    ], None)
    assert mgr.allocate_slots("a", 0, 10) and mgr.allocate_slots("b", 0, 3)
    assert mgr.allocate_slots("a", 10, 1)
    return mgr


def rows(tensor: torch.Tensor) -> list[list[int]]:
    """A table as nested lists."""
    return tensor.tolist()


def test_rows_are_padded_block_lists_and_extra_rows_are_null() -> None:
    """Rows are block lists padded with null; unknown requests and extra rows are null."""
    mgr = hybrid()
    assert [0, 1, 2] == mgr.get_block_ids("a")["SlidingWindow"]  # a dead head is a null entry
    tables = prepare_block_tables(reqs("a", -1, "b"), mgr, 5, "cpu", batch_size=4,
                                  is_prefill=True)
    assert ["FullAttention", "SlidingWindow", "Mamba", "c"] == list(tables)
    assert [[1, 2, 3, 0, 0], [0] * 5, [4, 0, 0, 0, 0], [0] * 5] == rows(tables["FullAttention"])
    assert [[0, 1, 2, 0, 0], [0] * 5, [3, 0, 0, 0, 0], [0] * 5] == rows(tables["SlidingWindow"])
    assert [[1], [0], [2], [0]] == rows(tables["Mamba"])
    assert [[1, 2, 3, 0, 0], [0] * 5, [4, 0, 0, 0, 0], [0] * 5] == rows(tables["c"])
    assert {torch.int32} == {t.dtype for t in tables.values()}
    without_mamba = KVCacheManager(64, [FullAttentionManager("FullAttention", 4, 4)], None)
    assert [[0, 0]] == rows(prepare_block_tables(reqs("zz"), without_mamba, 2, "cpu",
                                                 1)["FullAttention"])


def test_mamba_width_is_one_for_prefill_and_one_plus_next_n_for_decode() -> None:
    """Mamba rows take the first 1 (prefill) or 1 + next_n ids; dummies (-1) pad with null."""
    mgr = hybrid()
    assert [1, 3] == mgr.get_block_ids("a")["Mamba"]
    prefill = prepare_block_tables(reqs("a", "b"), mgr, 5, "cpu", 3, is_prefill=True)
    assert [[1], [2], [0]] == rows(prefill["Mamba"])
    decode = prepare_block_tables(reqs("a", -1), mgr, 5, "cpu", 2)
    assert [[1, 3], [0, 0]] == rows(decode["Mamba"])


def test_a_real_request_with_too_few_mamba_blocks_raises() -> None:
    """A real request with fewer Mamba blocks than the width is the seed's ValueError."""
    with pytest.raises(InvalidArgumentError, match=r"Mamba block table requires 2 blocks for "
                       r"request b, but got 1 blocks: \[2\]\."):
        prepare_block_tables(reqs("a", "b"), hybrid(), 5, "cpu", 2)


def test_widths_per_manager_and_their_errors() -> None:
    """A dict gives each manager its width; a missing key or a too-long table raises."""
    mgr = hybrid()
    tables = prepare_block_tables(reqs("a"), mgr, {"FullAttention": 3, "SlidingWindow": 4,
                                                   "c": 6}, "cpu", 1, is_prefill=True)
    assert [3, 4, 1, 6] == [t.shape[1] for t in tables.values()]
    with pytest.raises(InvalidArgumentError, match="max_block_num is required for "
                       "manager_key=SlidingWindow"):
        prepare_block_tables(reqs("a"), mgr, {"FullAttention": 3}, "cpu", 1, True)
    with pytest.raises(InvalidArgumentError, match="block table for manager_key=FullAttention, "
                       "request_id=a exceeds max_block_num: blocks=3, max_block_num=2"):
        prepare_block_tables(reqs("b", "a"), mgr, 2, "cpu", 2, True)


def test_empty_and_missing_request_lists_give_null_tables() -> None:
    """An empty list (the seed crashed in torch) and None both give all-null tables."""
    mgr = hybrid()
    choices: list[list[SimpleNamespace] | None] = [[], None]
    for requests in choices:
        tables = prepare_block_tables(requests, mgr, 3, "cpu", batch_size=2)
        assert {k: [[0] * t.shape[1]] * 2 for k, t in tables.items()} == {
            k: rows(t) for k, t in tables.items()}
    assert (0, 3) == tuple(prepare_block_tables([], mgr, 3, "cpu")["c"].shape)


@pytest.mark.parametrize("batch_size", [0, 1, -1, 2.0])
def test_batch_size_smaller_than_the_requests_is_a_clear_error(batch_size: Any) -> None:
    """batch_size below len(requests) (the seed crashed in torch) or not an int raises."""
    with pytest.raises(InvalidArgumentError, match="batch_size must be an int of at least "
                       "len\\(requests\\)=2"):
        prepare_block_tables(reqs("a", "b"), hybrid(), 5, "cpu", batch_size, True)


def test_block_tables_reject_bad_arguments() -> None:
    """Requests without request_id and managers without a state are typed errors."""
    with pytest.raises(InvalidTypeError, match="request_id attribute"):
        prepare_block_tables(["a"], hybrid(), 5, "cpu", 1)
    with pytest.raises(InvalidTypeError, match=r"kvfunc\.compat\.KVCacheManager"):
        prepare_block_tables(reqs("a"), object(), 5, "cpu", 1)
    with pytest.raises(InvalidTypeError, match="request ids must be str or int"):
        prepare_block_tables(reqs(1.5), hybrid(), 5, "cpu", 1)


def test_slot_mapping_follows_the_tables_and_skips_mamba_and_compressed() -> None:
    """slot = table[row, pos // bs] * bs + pos % bs; null entries and padding hit block 0."""
    mgr = hybrid()
    tables = prepare_block_tables(reqs("a", "b", -1), mgr, 5, "cpu", 3, is_prefill=True)
    # a: positions 1 (SWA null head) and 10; b: position 2; padding row: position 0.
    slots = prepare_slot_mapping(torch.tensor([1, 10, 2, 0]), [2, 3, 4], mgr, tables)
    assert ["FullAttention", "SlidingWindow"] == list(slots)
    assert [1 * 4 + 1, 3 * 4 + 2, 4 * 4 + 2, 0] == slots["FullAttention"].tolist()
    assert [0 * 4 + 1, 2 * 4 + 2, 3 * 4 + 2, 0] == slots["SlidingWindow"].tolist()
    assert torch.int64 == slots["FullAttention"].dtype


def test_slot_mapping_ignores_positions_after_the_last_row() -> None:
    """Positions past the last cumulative end belong to no row and are ignored (as in the seed)."""
    mgr = hybrid()
    tables = prepare_block_tables(reqs("a"), mgr, 5, "cpu", 1)
    assert [5] == prepare_slot_mapping([1, 7, 7], [1], mgr, tables)["FullAttention"].tolist()


def test_empty_batches_give_empty_mappings() -> None:
    """An empty cumulative-length list (the seed crashed in torch) gives empty int64 mappings."""
    mgr = hybrid()
    tables = prepare_block_tables([], mgr, 5, "cpu", 0)
    out = prepare_slot_mapping(torch.tensor([], dtype=torch.int64), [], mgr, tables)
    assert {"FullAttention": [], "SlidingWindow": []} == {k: v.tolist() for k, v in out.items()}


@pytest.mark.parametrize(("positions", "ends", "tables_fn", "error", "message"), [
    ([0, 25], [1, 2], None, InvalidArgumentError,
     "block_indices out of range for manager_key=FullAttention: max_index=6, "
     "block_table_width=5"),
    ([0, -3], [1, 2], None, InvalidArgumentError,
     r"positions must be non-negative, but position_ids\[1\] = -3 \(batch row 1\)"),
    ([0, 1], [2, 1], None, InvalidArgumentError, "non-decreasing ends"),
    ([0, 1], [1, 3], None, InvalidArgumentError, "ends within the 2 positions"),
    ([0.0, 1.0], [1, 2], None, InvalidTypeError, "position_ids must be a 1-D integer"),
    ([0, 1], [1, 2], lambda t: {k: v for k, v in t.items() if k != "c"}, InvalidArgumentError,
     "block_table is required for manager_key=c"),
    ([0, 1], [1, 2], lambda t: {**t, "c": t["c"][:, :0]}, InvalidArgumentError,
     "block_table for manager_key=c must have non-zero width"),
    ([0, 1], [1, 2], lambda t: {**t, "SlidingWindow": t["SlidingWindow"][:1]},
     InvalidArgumentError, "block_table for manager_key=SlidingWindow has 1 rows, but "
     "actual_seq_lengths_cu_q describes 2"),
])
def test_slot_mapping_errors(positions: Any, ends: Any, tables_fn: Any, error: type[Exception],
                             message: str) -> None:
    """Out-of-width blocks, negative positions, bad ends and bad tables raise typed errors."""
    mgr = hybrid()
    tables = prepare_block_tables(reqs("a", "b"), mgr, 5, "cpu", 2, True)
    if tables_fn is not None:
        tables = tables_fn(tables)
    with pytest.raises(error, match=message):
        prepare_slot_mapping(torch.tensor(positions), ends, mgr, tables)


def test_compressed_tables_need_not_cover_the_batch() -> None:
    """A compressed group's table is checked for width only: it gets no slot mapping."""
    mgr = hybrid()
    tables = prepare_block_tables(reqs("a", "b"), mgr, 5, "cpu", 2, True)
    tables["c"] = tables["c"][:1]
    assert ["FullAttention", "SlidingWindow"] == list(prepare_slot_mapping([0, 1], [1, 2], mgr,
                                                                           tables))


@st.composite
def batches(draw: st.DrawFn) -> tuple[torch.Tensor, list[int], list[int], int]:
    """A random table, block size, and per-row positions within the table's width."""
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    num_rows = draw(st.integers(0, 5))
    width = draw(st.integers(1, 6))
    flat = draw(st.lists(st.integers(0, 50), min_size=num_rows * width,
                         max_size=num_rows * width))
    table = torch.tensor(flat, dtype=torch.int32).view(num_rows, width)
    counts = draw(st.lists(st.integers(0, 4), min_size=num_rows, max_size=num_rows))
    positions = draw(st.lists(st.integers(0, width * block_size - 1), min_size=sum(counts),
                              max_size=sum(counts)))
    ends = torch.cumsum(torch.tensor(counts, dtype=torch.int64), 0).tolist()
    return table, positions, ends, block_size


@given(batches())
def test_slot_mapping_equals_the_per_token_definition(
        batch: tuple[torch.Tensor, list[int], list[int], int]) -> None:
    """The vectorised mapping equals spec §5.7's loop over rows and tokens."""
    table, positions, ends, bs = batch
    expected: list[int] = []
    start = 0
    for row, end in enumerate(ends):
        for pos in positions[start:end]:
            expected.append(int(table[row][pos // bs]) * bs + pos % bs)
        start = end
    assert expected == slot_mapping(table, torch.tensor(positions, dtype=torch.int64), ends,
                                    bs).tolist()
