"""The builder of deltas: one transition's rows, collected in the order it acts.

See :mod:`kvfunc.core._delta` for the families and their codes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from itertools import repeat
from typing import Any

from kvfunc.core._delta import EMPTY_DELTA, BlocksChanged, Run

__all__ = ["DeltaBuilder", "record_stored", "stored_row"]


class DeltaBuilder:
    """Collects one transition's rows in order, then freezes them into one delta.

    A primitive appends its code letters to ``codes`` (a run of one family
    as one string: ``"F" * 3``) and its rows to ``rows``, in the order it
    acts, or a run of rows with :meth:`run`; :meth:`build` joins the codes
    into the delta's ``order``.
    """

    __slots__ = ("codes", "rows", "runs")

    def __init__(self) -> None:
        self.codes: list[str] = []
        self.rows: list[tuple[Any, ...]] = []
        self.runs = False

    def run(self, code: str, head: tuple[Any, ...], lasts: Sequence[Any]) -> None:
        """One ``code`` row ``(*head, last)`` for each of ``lasts`` (never written again), in
        order: a table's new blocks or a freed run, built as rows only if the delta is read."""
        self.rows.append(Run((_repeated, (head, lasts))))
        self.codes.append(code * len(lasts))
        self.runs = True

    def spell(self, code: str, n: int, fn: Callable[..., Iterable[tuple[Any, ...]]],
              *args: Any) -> None:
        """``n`` ``code`` rows, those ``fn(*args)`` gives (its arguments never written again),
        built only if the delta is read."""
        self.rows.append(Run((fn, args)))
        self.codes.append(code * n)
        self.runs = True

    def build(self) -> BlocksChanged:
        """Freeze the collected rows into one record (its columns are built when read)."""
        if not self.codes:
            return EMPTY_DELTA
        return BlocksChanged._of("".join(self.codes), self.rows, self.runs)


def _repeated(head: tuple[Any, ...], lasts: Sequence[Any]) -> Iterable[tuple[Any, ...]]:
    """The rows ``(*head, last)`` for each of ``lasts``, in order."""
    return zip(*map(repeat, head), lasts, strict=False)


def stored_row(key: str, request_id: Any, position: int, block: int, digest: bytes,
               hashes: Any, m: int) -> tuple[Any, ...]:
    """The T row of caching ``block`` at ``position`` (one block of :func:`record_stored`)."""
    bs, tokens = m * hashes.block_size, hashes._tokens
    return (key, request_id, position, block, digest,
            hashes._digests[position * m - 1] if position else None,
            None if tokens is None else tuple(tokens[position * bs:(position + 1) * bs]))


def record_stored(sink: DeltaBuilder, key: str, request_id: Any, positions: Sequence[int],
                  run: Sequence[int], digests: Sequence[bytes], hashes: Any, m: int) -> None:
    """Record the T rows of caching ``run`` at ``positions`` under ``digests`` (``m`` hash
    blocks each), in order.

    A row carries the parent digest (None at position 0) and the block's
    tokens (None where ``hashes`` keep none).  A contiguous run (the common
    case) keeps slices of them, and its rows are built only if the delta is
    read.
    """
    first, n = positions[0], len(run)
    if positions[-1] - first + 1 != n:
        sink.rows.extend([stored_row(key, request_id, q, b, h, hashes, m)
                          for q, b, h in zip(positions, run, digests, strict=True)])
        sink.codes.append("T" * n)
        return
    every, bs, tokens = hashes._digests, m * hashes.block_size, hashes._tokens
    parents = (every[first * m - 1:(first + n) * m - 1:m] if first
               else [None, *every[m - 1:(n - 1) * m:m]])
    sink.spell("T", n, _stored_rows, key, request_id, positions, run, digests, parents,
               None if tokens is None else tokens[first * bs:(first + n) * bs], bs)


def _stored_rows(key: str, request_id: Any, positions: Sequence[int], run: Sequence[int],
                 digests: Sequence[bytes], parents: Sequence[bytes | None],
                 tokens: list[int] | None, bs: int) -> Iterable[tuple[Any, ...]]:
    """The T rows of a contiguous run, ``tokens`` in blocks of ``bs`` (:func:`record_stored`;
    None rows where the hashes keep no tokens)."""
    blocks = repeat(None) if tokens is None else zip(*[iter(tokens)] * bs, strict=True)
    return zip(repeat(key), repeat(request_id), positions, run, digests, parents, blocks,
               strict=False)
