"""The builder of deltas: one transition's rows, collected in the order it acts.

See :mod:`kvfunc.core._delta` for the families and their codes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvfunc.core._delta import EMPTY_DELTA, BlocksChanged, Run

__all__ = ["DeltaBuilder"]


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
        self.rows.append(Run((head, lasts)))
        self.codes.append(code * len(lasts))
        self.runs = True

    def build(self) -> BlocksChanged:
        """Freeze the collected rows into one record (its columns are built when read)."""
        if not self.codes:
            return EMPTY_DELTA
        return BlocksChanged._of("".join(self.codes), self.rows, self.runs)
