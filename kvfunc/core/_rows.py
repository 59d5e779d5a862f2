"""Block tables as rows: one small immutable record per request and group.

Theory of operation
-------------------
A group keeps one :class:`Row` per registered request in a persistent map
(``immutables.Map``, request id -> row).  A row's table is ``nulls`` null
entries (block 0: a sliding window's dead head; null entries only ever form
a prefix) followed by ``blocks``, the real block ids in logical order::

    table   [0, 0, 7, 9, 4]      nulls = 2, blocks = (7, 9, 4), length 5

Two counters serve prefix caching (both 0 without it) so that the common
decode step reads no per-block vector:

* ``shared``: positions at or past it hold blocks no other table holds, so a
  write there needs no copy-on-write;
* ``stored``: positions before ``max(stored, nulls)`` are cached or null, so
  a step whose written tokens end before it has nothing to cache.

``seq`` orders the rows by registration (the state counts registrations),
so every listing of a group's requests is in the same order in every
process.

The last four fields are the row's *quiet limits*, computed from the policy
when the row is stored (:func:`~kvfunc.core._policy.row_limits`): a step of
``(computed, written, total)`` tokens with ``total <= room``, ``computed <
slide``, ``computed >= cow_from``, and ``written < fill`` or hashes that do
not cover ``fill`` tokens, has nothing to do in this group, so the fold
decides it from the row alone.  A row built but
not stored yet has limits that send every step to the policy (:data:`ASK`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

__all__ = ["ASK", "NULL", "Row", "TablesView", "leading_nulls", "make_row", "row_table"]

NULL = 0


class Row(NamedTuple):
    """One request's block table in one group (see the module docstring)."""

    blocks: tuple[int, ...]
    nulls: int
    stored: int
    shared: int
    seq: int
    room: int = -1
    slide: int = -1
    fill: int = -1
    cow_from: int = 1 << 62

    @property
    def length(self) -> int:
        """Table entries, null ones included."""
        return self.nulls + len(self.blocks)


#: The quiet limits of a row not stored yet: every step asks the policy.
ASK = (-1, -1, -1, 1 << 62)
_new = tuple.__new__


def make_row(blocks: tuple[int, ...], nulls: int, stored: int, shared: int, seq: int) -> Row:
    """A row whose quiet limits are not known yet (:data:`ASK`).

    >>> make_row((4,), 0, 0, 0, 7).room
    -1
    """
    return _new(Row, (blocks, nulls, stored, shared, seq, *ASK))


def row_table(row: Row) -> tuple[int, ...]:
    """The row's entries as a tuple, null entries as block 0.

    >>> row_table(make_row((8, 9), 1, 0, 0, 0))
    (0, 8, 9)
    """
    return (NULL,) * row.nulls + row.blocks if row.nulls else row.blocks


def leading_nulls(entries: Sequence[int]) -> int:
    """How many entries of a table open it as null entries (block 0).

    >>> leading_nulls((0, 0, 5, 0)), leading_nulls(())
    (2, 0)
    """
    n = 0
    while n < len(entries) and not entries[n]:
        n += 1
    return n


class TablesView(Mapping[Any, tuple[int, ...]]):
    """A group's block tables as a read-only mapping, in registration order (built on access)."""

    __slots__ = ("_rows",)

    def __init__(self, rows: Any) -> None:
        self._rows = rows

    def __getitem__(self, request_id: Any) -> tuple[int, ...]:
        return row_table(self._rows[request_id])

    def __contains__(self, request_id: object) -> bool:
        try:
            return request_id in self._rows
        except TypeError:  # an unhashable key is not a request id
            return False

    def __iter__(self) -> Iterator[Any]:
        items = sorted(self._rows.items(), key=lambda kv: kv[1].seq)
        return iter([rid for rid, _ in items])

    def __len__(self) -> int:
        return len(self._rows)

    def __repr__(self) -> str:
        return f"TablesView({dict(self)!r})"


def rows_by_seq(rows: Mapping[Any, Row]) -> list[tuple[Any, Row]]:
    """``(request id, row)`` pairs in registration order."""
    return sorted(rows.items(), key=lambda kv: kv[1].seq)
