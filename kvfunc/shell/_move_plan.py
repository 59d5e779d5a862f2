"""How a batch of block moves becomes few large copies (pure: numpy only).

A move copies blocks ``src[i] -> dst[i]`` between two tensors that keep
block ``b`` in row ``b``.  Done one block at a time, the cost is the
per-copy overhead, not the bytes, so the pairs are grouped first:

* **runs**: pairs where both ids step by one, ``(s, d, n)``: one slice copy
  ``dst[d:d+n] = src[s:s+n]``;
* **gather**: destination runs whose sources are scattered, ``(ids, d, n)``:
  one indexed read into a slice, ``dst[d:d+n] = src[ids]``;
* **scatter**: source runs whose destinations are scattered, ``(s, ids, n)``:
  one indexed write from a slice, ``dst[ids] = src[s:s+n]``;
* **scattered**: both sides scattered, no grouping helps: the pairs as given.

:func:`plan_move` picks the grouping with the fewest copies (ties go to
runs, the plainest copy), and ``scattered`` when even that would average
fewer than two blocks per copy.  Which grouping is taken changes only the
speed: every plan writes ``dst[dst_ids[i]] = src[src_ids[i]]`` for all ``i``.

Pairs are sorted by destination (or source) before grouping, so the order
in which the caller lists them does not matter; destinations are distinct
(checked by the caller), so the result does not depend on order either.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = ["MovePlan", "Segment", "plan_move", "row_runs"]


class Segment(NamedTuple):
    """One copy of ``n`` rows: ``ids`` are the gather's sources or the scatter's destinations.

    runs ``dst[d:d+n] = src[s:s+n]``; gather ``dst[d:d+n] = src[ids]``;
    scatter ``dst[ids] = src[s:s+n]`` (``s``, ``d``: ``src_start``, ``dst_start``).
    """

    src_start: int
    dst_start: int
    n: int
    ids: np.ndarray | None = None


class MovePlan(NamedTuple):
    """The copies of one move: ``kind`` and its segments (module docstring)."""

    kind: str
    segments: tuple[Segment, ...]
    src_ids: np.ndarray
    dst_ids: np.ndarray

    @property
    def num_copies(self) -> int:
        """Copies per tensor: one per segment, or one per pair when scattered."""
        return len(self.src_ids) if self.kind == "scattered" else len(self.segments)


def _starts(a: np.ndarray, b: np.ndarray | None = None) -> np.ndarray:
    """Indices where a run begins: ``a`` (and ``b``) stop stepping by one.

    >>> _starts(np.array([4, 5, 6, 9, 10])).tolist()
    [0, 3]
    >>> _starts(np.array([4, 5, 6]), np.array([1, 2, 7])).tolist()
    [0, 2]
    """
    if len(a) == 0:
        return np.zeros(0, dtype=np.int64)
    step = np.diff(a) == 1
    if b is not None:
        step &= np.diff(b) == 1
    return np.concatenate(([0], np.flatnonzero(~step) + 1))


def _bounds(starts: np.ndarray, n: int) -> list[tuple[int, int]]:
    if n == 0:
        return []
    ends = [*starts[1:].tolist(), n]
    return list(zip(starts.tolist(), ends, strict=True))


def plan_move(src_ids: np.ndarray, dst_ids: np.ndarray) -> MovePlan:
    """Group the pairs ``src_ids[i] -> dst_ids[i]`` into few copies (module docstring).

    >>> plan_move(np.array([7, 8, 9, 2]), np.array([0, 1, 2, 3])).kind
    'gather'
    >>> p = plan_move(np.array([3, 4, 5]), np.array([10, 11, 12])); p.kind, p.segments
    ('runs', (Segment(src_start=3, dst_start=10, n=3, ids=None),))
    >>> plan_move(np.array([5, 1, 9, 3]), np.array([2, 8, 0, 6])).kind
    'scattered'
    """
    n = len(src_ids)
    if n == 0:
        return MovePlan("runs", (), src_ids, dst_ids)
    if n == 1:  # one pair: one run
        return MovePlan("runs", (Segment(int(src_ids[0]), int(dst_ids[0]), 1),), src_ids,
                        dst_ids)
    by_dst = np.argsort(dst_ids, kind="stable")
    s_d, d_d = src_ids[by_dst], dst_ids[by_dst]
    joint = _starts(d_d, s_d)
    if len(joint) == 1:  # one run: no grouping has fewer copies (ties go to runs)
        return MovePlan("runs", (Segment(int(s_d[0]), int(d_d[0]), n),), src_ids, dst_ids)
    by_src = np.argsort(src_ids, kind="stable")
    s_s, d_s = src_ids[by_src], dst_ids[by_src]
    dst_runs, src_runs = _starts(d_d), _starts(s_s)
    best = min(len(joint), len(dst_runs), len(src_runs))
    if 2 * best > n:  # n > 1 here
        return MovePlan("scattered", (), src_ids, dst_ids)
    if len(joint) == best:
        segments = [Segment(int(s_d[i]), int(d_d[i]), j - i) for i, j in _bounds(joint, n)]
        kind = "runs"
    elif len(dst_runs) <= len(src_runs):
        segments = [Segment(0, int(d_d[i]), j - i, s_d[i:j]) for i, j in _bounds(dst_runs, n)]
        kind = "gather"
    else:
        segments = [Segment(int(s_s[i]), 0, j - i, d_s[i:j]) for i, j in _bounds(src_runs, n)]
        kind = "scatter"
    return MovePlan(kind, tuple(segments), src_ids, dst_ids)


def row_runs(src_ids: np.ndarray, dst_ids: np.ndarray, split: bool
             ) -> list[tuple[int, int, int]]:
    """Runs ``(s, d, n)`` where both ids step by one; single rows when ``split``.

    A device copy moves one contiguous range per call: a run of rows is one
    range only where both sides keep consecutive rows back to back (not a
    tensor of the host's block layout, whose rows are strided).

    >>> row_runs(np.array([1, 2, 3, 9]), np.array([4, 5, 6, 0]), False)
    [(9, 0, 1), (1, 4, 3)]
    >>> row_runs(np.array([1, 2]), np.array([4, 5]), True)
    [(1, 4, 1), (2, 5, 1)]
    >>> row_runs(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), False)
    []
    """
    if split:
        return [(s, d, 1) for s, d in zip(src_ids.tolist(), dst_ids.tolist(), strict=True)]
    order = np.argsort(dst_ids, kind="stable")
    s, d = src_ids[order], dst_ids[order]
    return [(int(s[i]), int(d[i]), j - i) for i, j in _bounds(_starts(d, s), len(s))]
