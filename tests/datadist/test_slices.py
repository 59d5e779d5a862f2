"""Planning a transfer as slices: every element lands where it belongs, in few slices."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvfunc.datadist import _slices
from kvfunc.datadist._slices import Side, chunk_slices, chunks_of, run_starts, stages

ROWS = 12  # rows of each tensor, both sides
RB = 4  # bytes of a row


@st.composite
def transfers(draw: st.DrawFn) -> dict[str, object]:
    """Random rows on both sides, tensors (back to back or apart), layers, who stages,
    and the chunk size."""
    n = draw(st.integers(1, 6))
    src = draw(st.permutations(range(ROWS)))[:n]
    if draw(st.booleans()):  # consecutive runs, as paged blocks often are
        start = draw(st.integers(0, ROWS - n))
        src = list(range(start, start + n))
    dst = draw(st.permutations(range(ROWS)))[:n]
    num = draw(st.integers(1, 4))
    order = draw(st.permutations(range(num)))
    cut = draw(st.integers(1, num))
    return {"n": n, "src": list(src), "dst": list(dst), "num": num,
            "layers": [list(order[:cut]), list(order[cut:])] if cut < num else [list(order)],
            "gap": draw(st.sampled_from([0, 7])), "src_staged": draw(st.booleans()),
            "dst_staged": draw(st.booleans()), "chunk_rows": draw(st.integers(1, 9))}


def place(num: int, gap: int, base: int) -> list[int]:
    """Where each of ``num`` tensors of ``ROWS`` rows starts: back to back or apart."""
    return [base + t * (ROWS * RB + gap) for t in range(num)]


@given(transfers())
def test_slices_move_every_element_where_it_belongs(t: dict[str, object]) -> None:
    """Reading each chunk's slices (from a staged or in-place sender into a staged or
    in-place receiver, which then scatters) leaves each destination row of each tensor
    holding its source row; the slices of a chunk cover exactly its bytes; a chunk
    between two staged regions is one slice."""
    n, num, layers = t["n"], t["num"], t["layers"]
    assert isinstance(n, int) and isinstance(num, int) and isinstance(layers, list)
    src, dst = t["src"], t["dst"]
    assert isinstance(src, list) and isinstance(dst, list)
    order = [i for layer in layers for i in layer]
    memory = bytearray(1 << 14)  # both processes' memory, in one address space
    src_at, dst_at = place(num, int(t["gap"]), 0), place(num, int(t["gap"]), 4096)
    for i in range(num):
        for r in range(ROWS):
            memory[src_at[i] + r * RB:src_at[i] + (r + 1) * RB] = bytes([i, r, 1, 1])
    stage_src, stage_dst = 8192, 12288
    if t["src_staged"]:  # the sender gathers in stream order
        for p, i in enumerate(order):
            for j, r in enumerate(src):
                at = stage_src + (p * n + j) * RB
                memory[at:at + RB] = bytes([i, r, 1, 1])
    remote = Side(stage_src, (), ()) if t["src_staged"] else \
        Side(None, [src_at[i] for i in order], src)
    local = Side(stage_dst, (), ()) if t["dst_staged"] else \
        Side(None, [dst_at[i] for i in order], dst)
    starts = run_starts(n, None if t["dst_staged"] else dst, None if t["src_staged"] else src)
    for chunk in chunks_of(layers, n, int(t["chunk_rows"])):
        slices = chunk_slices(chunk, n, RB, starts, local, remote)
        assert (chunk.stop - chunk.start) * RB == sum(length for _, _, length in slices)
        if t["src_staged"] and t["dst_staged"]:
            assert 1 == len(slices)
        for to, frm, length in slices:
            memory[to:to + length] = memory[frm:frm + length]
    if t["dst_staged"]:  # the receiver scatters from its region
        for p, i in enumerate(order):
            for j, r in enumerate(dst):
                at, frm = dst_at[i] + r * RB, stage_dst + (p * n + j) * RB
                memory[at:at + RB] = memory[frm:frm + RB]
    for i in order:
        for j, r in enumerate(dst):
            assert bytes([i, src[j], 1, 1]) == memory[dst_at[i] + r * RB:][:RB]


def test_adjacent_runs_merge_across_tensors_into_one_slice() -> None:
    """Every row of two tensors that lie back to back on both sides is one slice."""
    local, remote = Side(None, (0, 40), list(range(10))), Side(None, (100, 140),
                                                                list(range(10)))
    chunk, = chunks_of([[0, 1]], 10, 1 << 20)
    assert [(0, 100, 80)] == chunk_slices(chunk, 10, 4, [0], local, remote)


@pytest.mark.parametrize(("rows", "row_bytes", "tensors", "staged"), [
    ([3, 9, 5, 1], 16 << 10, 1, True),  # scattered 16 KiB blocks: slices cost more than a copy
    (list(range(16)) + list(range(40, 56)), 16 << 10, 16, False),  # runs of 256 KiB
    ([7], 1 << 10, 1, False),  # one slice never gains from a copy
    ([7], 1 << 10, 4, True),  # one small row of each of 4 tensors: 4 slices
    ([1, 5], 1 << 20, 8, False),  # rows of 1 MiB: a slice each costs less than copying it
])
def test_the_rule_stages_short_runs_only(rows: list[int], row_bytes: int, tensors: int,
                                         staged: bool) -> None:
    """A side is staged iff it takes several slices whose runs average under STAGE_BELOW
    bytes."""
    runs = len(_slices.row_runs(rows))
    assert staged == stages(rows, row_bytes, tensors)
    assert staged == (len(rows) * row_bytes / runs < _slices.STAGE_BELOW and
                      runs * tensors > 1)
