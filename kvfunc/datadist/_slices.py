"""Planning a transfer as slices: runs of rows, staging, chunks, coalescing.  Pure.

Theory of operation
-------------------
A transfer moves, for each tensor of each layer, ``n`` rows of
``row_bytes`` from the sender's rows to the receiver's, paired by
position.  Laid end to end they form the transfer's **stream**: layer
after layer, tensor after tensor, each tensor's rows in the transfer's
order, so element ``e = p * n + j`` is row ``j`` of the ``p``-th tensor
sent::

    stream   | t0 r0 | t0 r1 | ... | t0 r(n-1) | t1 r0 | ... |
    sender   rows src_rows[j] of tensor t, or one staged region in stream order
    receiver rows dst_rows[j] of tensor t, or one staged region in stream order

An engine that moves ``(local, remote, length)`` **slices** (Mooncake)
needs both ends of a slice contiguous, so a slice is a run of elements
whose addresses follow each other on both sides.  A side either leaves its
rows **in place** or is **staged**: the sender gathers its rows into one
region in stream order before they are read, the receiver reads into one
such region and scatters from it.  A staged side is contiguous in stream
order, so it never cuts a slice; the price is one copy of the bytes.

**The rule** (:func:`stages`, measured by ``benchmarks/bench_datadist.py``,
its crossover section): each Mooncake slice over TCP costs a fixed time on
top of its bytes (20-30 us on the 2-core machine), and a copy of a
row costs its bytes at memory speed.  A side whose runs of consecutive
rows average fewer than ``STAGE_BELOW`` bytes is staged, if it would take
more than one slice; contiguous runs of at least that size move in place,
with no copy.  Each side decides alone, from its own rows.

**Chunks** (:func:`chunks_of`): each layer's stream is cut into chunks of
``chunk_rows`` elements, the unit in which a staged sender reports its
gathered rows and a receiver reads and scatters (it reads chunk ``k + 1``
while it scatters chunk ``k``).  :func:`chunk_slices` lists a chunk's
slices, adjacent ones merged, also across tensors that lie back to back.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator, Sequence
from typing import NamedTuple

__all__ = ["CHUNK_BYTES", "RAMP", "STAGE_BELOW", "Chunk", "Side", "chunk_rows_for", "chunk_sizes",
           "chunk_slices", "chunks_of", "coalesce", "row_runs", "run_starts", "spans", "stages"]

# Below this average run length a side's rows are staged.  Measured (bench_datadist.py, the
# crossover; 2-core machine, 64 MiB pulls of 16 KiB blocks, five runs): staged takes
# 0.55-0.67 of the in-place time for runs of 16 KiB, in place wins from runs of 32 KiB
# (staged 0.89-1.22 of it, median 1.10) and more so for longer runs.
STAGE_BELOW = 32 << 10
# A staged transfer moves in chunks of about this size: fewer chunks cost fewer messages,
# smaller ones overlap the gather, the wire and the scatter sooner.
CHUNK_BYTES = 8 << 20
RAMP = 3  # chunks at each end of a layer that are smaller: 1/8, 1/4, 1/2 of a chunk

Slice = tuple[int, int, int]  # (local address, remote address, length in bytes)


def row_runs(rows: Sequence[int]) -> list[tuple[int, int]]:
    """``rows`` as runs ``(first, count)`` of consecutive rows, in order.

    >>> row_runs([4, 5, 6, 9, 2, 3])
    [(4, 3), (9, 1), (2, 2)]
    """
    runs: list[tuple[int, int]] = []
    for r in rows:
        if runs and runs[-1][0] + runs[-1][1] == r:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((r, 1))
    return runs


def stages(rows: Sequence[int], row_bytes: int, num_tensors: int = 1) -> bool:
    """Whether a side holding ``rows`` (of ``row_bytes`` each) of ``num_tensors`` tensors
    is staged: more than one slice in place (runs times tensors), and the runs average
    under ``STAGE_BELOW`` bytes.

    >>> stages(list(range(256)), 16 << 10, 16), stages([4, 9, 2], 16 << 10)
    (False, True)
    >>> stages([4], 16), stages([4], 16, num_tensors=2), stages([0, 1, 4, 5], 1 << 20)
    (False, True, False)
    """
    runs = len(row_runs(rows))
    return runs * num_tensors > 1 and len(rows) * row_bytes < STAGE_BELOW * runs


def run_starts(n: int, *rows: Sequence[int] | None) -> list[int]:
    """The indices ``j`` in ``[0, n)`` where a slice must start: ``0``, and wherever the
    rows of a side in place (``None``: staged) do not follow the previous row.

    >>> run_starts(5, [1, 2, 3, 7, 8], [0, 1, 5, 6, 7]), run_starts(5, None, None)
    ([0, 2, 3], [0])
    """
    starts = {0}
    for side in rows:
        if side is not None:
            starts.update(j for j in range(1, n) if side[j] != side[j - 1] + 1)
    return sorted(starts)


class Chunk(NamedTuple):
    """Elements ``[start, stop)`` of the stream, all of layer ``layer``; ``number`` counts
    the chunks of the whole transfer."""

    number: int
    layer: int
    start: int
    stop: int


def spans(chunk: Chunk, n: int) -> Iterator[tuple[int, int, int]]:
    """``(p, j0, j1)``: the rows ``j0 .. j1 - 1`` of the ``p``-th tensor sent that
    ``chunk`` covers (``n`` rows per tensor), tensor after tensor.

    >>> list(spans(Chunk(0, 0, 2, 7), 3))
    [(0, 2, 3), (1, 0, 3), (2, 0, 1)]
    """
    for p in range(chunk.start // n, (chunk.stop - 1) // n + 1):
        yield p, max(chunk.start - p * n, 0), min(chunk.stop - p * n, n)


def chunk_rows_for(row_bytes: int) -> int:
    """How many elements a chunk of about ``CHUNK_BYTES`` holds (at least one).

    >>> chunk_rows_for(16 << 10), chunk_rows_for(64 << 20)
    (512, 1)
    """
    return max(1, CHUNK_BYTES // max(row_bytes, 1))


def chunk_sizes(count: int, chunk_rows: int) -> list[int]:
    """``count`` elements cut into chunks of ``chunk_rows``, the first and last
    ``RAMP`` chunks smaller (an eighth, a quarter, a half of it) so that the first read
    starts and the last scatter ends sooner.

    >>> chunk_sizes(100, 16)
    [2, 4, 8, 16, 16, 16, 16, 8, 8, 4, 2]
    >>> chunk_sizes(5, 16), chunk_sizes(3, 1)
    ([2, 1, 2], [1, 1, 1])
    """
    head: list[int] = []
    tail: list[int] = []
    left = count
    for size in [max(1, chunk_rows >> k) for k in range(RAMP, 0, -1)]:
        for side in (head, tail):
            if left:
                side.append(min(size, left))
                left -= side[-1]
    middle = [min(chunk_rows, left - i) for i in range(0, left, chunk_rows)]
    return head + middle + tail[::-1]


def chunks_of(layers: Sequence[Sequence[int]], n: int, chunk_rows: int) -> list[Chunk]:
    """Each layer's elements (``n`` per tensor) cut into chunks (:func:`chunk_sizes`).

    >>> [(c.layer, c.start, c.stop) for c in chunks_of([[0, 1], [2]], 3, 8)]
    [(0, 0, 1), (0, 1, 3), (0, 3, 5), (0, 5, 6), (1, 6, 7), (1, 7, 8), (1, 8, 9)]
    """
    out: list[Chunk] = []
    first = 0
    for number, layer in enumerate(layers):
        for size in chunk_sizes(len(layer) * n, chunk_rows):
            out.append(Chunk(len(out), number, first, first + size))
            first += size
    return out


class Side(NamedTuple):
    """Where one side's elements lie: a staged region at ``base`` (stream order), or in
    place: the ``p``-th tensor sent starts at ``addrs[p]`` and element ``(p, j)`` is its
    row ``rows[j]``."""

    base: int | None
    addrs: Sequence[int]
    rows: Sequence[int]

    def addr(self, p: int, j: int, n: int, row_bytes: int) -> int:
        """The address of row ``j`` of the ``p``-th tensor (``n`` rows per tensor)."""
        if self.base is not None:
            return self.base + (p * n + j) * row_bytes
        return self.addrs[p] + self.rows[j] * row_bytes


def coalesce(slices: Sequence[Slice]) -> list[Slice]:
    """Merge each slice with the next where both ends follow on.

    >>> coalesce([(0, 100, 8), (8, 108, 8), (16, 200, 8), (40, 208, 8)])
    [(0, 100, 16), (16, 200, 8), (40, 208, 8)]
    """
    out: list[Slice] = []
    for local, remote, length in slices:
        if out and out[-1][0] + out[-1][2] == local and out[-1][1] + out[-1][2] == remote:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + length)
        else:
            out.append((local, remote, length))
    return out


def chunk_slices(chunk: Chunk, n: int, row_bytes: int, starts: Sequence[int], local: Side,
                 remote: Side) -> list[Slice]:
    """The slices that move ``chunk``: one per run (``starts`` from :func:`run_starts`)
    of each tensor it covers, adjacent ones merged.

    >>> staged, rows = Side(1000, (), ()), [4, 5, 9]
    >>> in_place = Side(None, (0, 5000), rows)
    >>> chunk = Chunk(0, 0, 0, 6)
    >>> chunk_slices(chunk, 3, 10, run_starts(3, rows, None), in_place, staged)
    [(40, 1000, 20), (90, 1020, 10), (5040, 1030, 20), (5090, 1050, 10)]
    >>> chunk_slices(chunk, 3, 10, run_starts(3, None, None), Side(0, (), ()), staged)
    [(0, 1000, 60)]
    """
    out: list[Slice] = []
    for p, j0, j1 in spans(chunk, n):
        cuts = starts[bisect.bisect_right(starts, j0):bisect.bisect_left(starts, j1)]
        for a, b in itertools.pairwise([j0, *cuts, j1]):
            out.append((local.addr(p, a, n, row_bytes), remote.addr(p, a, n, row_bytes),
                        (b - a) * row_bytes))
    return coalesce(out)
