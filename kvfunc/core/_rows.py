"""Block tables as rows: one small immutable record per request and group.

Theory of operation
-------------------
A group keeps one :class:`Row` per registered request in a persistent map
(``immutables.Map``, request id -> row).  A row's table is its first
``length`` entries: ``nulls`` null entries (block 0: a sliding window's
dead head; null entries only ever form a prefix) followed by the real block
ids in logical order (``blocks``)::

    table   [0, 0, 7, 9, 4]      nulls = 2, blocks = (7, 9, 4), length 5

The entries live in ``ids``, a list that the rows of one request's lineage
share: a row reads ``ids[nulls:length]`` and nothing past ``length``.  A
table that grows appends to the list in place when nobody appended past its
``length`` before (:func:`append_ids`), else it copies the first ``length``
entries, so growing a table costs its new entries, not the table, and every
state kept along the way shares one list.  No entry below a list's end is
ever written again: recycling positions only raises ``nulls`` (what the list
still holds there is never read), and a copy-on-write copies the list.

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

__all__ = ["ASK", "NULL", "Row", "TablesView", "append_ids", "grown", "leading_nulls", "make_row",
           "recycled_free", "remade", "replaced", "row_table", "row_tail"]

NULL = 0


class Row(NamedTuple):
    """One request's block table in one group (see the module docstring)."""

    ids: list[int]
    nulls: int
    stored: int
    shared: int
    seq: int
    room: int = -1
    slide: int = -1
    fill: int = -1
    cow_from: int = 1 << 62
    length: int = 0

    @property
    def blocks(self) -> tuple[int, ...]:
        """The real block ids in logical order (a tuple built on access)."""
        return tuple(self.ids[self.nulls:self.length])


#: The quiet limits of a row not stored yet: every step asks the policy.
ASK = (-1, -1, -1, 1 << 62)
_new = tuple.__new__


def make_row(blocks: Sequence[int], nulls: int, stored: int, shared: int, seq: int) -> Row:
    """A row of ``nulls`` null entries then ``blocks``, in a list of its own, limits :data:`ASK`.

    >>> row = make_row((4,), 1, 0, 0, 7)
    >>> row.blocks, row.length, row.room
    ((4,), 2, -1)
    """
    ids = [NULL] * nulls
    ids.extend(blocks)
    return _new(Row, (ids, nulls, stored, shared, seq, *ASK, len(ids)))


def remade(row: Row, nulls: int, stored: int, shared: int) -> Row:
    """``row``'s table with other counters (its list shared), limits :data:`ASK`.

    ``nulls`` may only rise within the table (positions recycled).

    >>> row = make_row((4, 5), 0, 0, 0, 7)
    >>> new = remade(row, 1, 0, 2)
    >>> new.blocks, new.ids is row.ids, new.length
    ((5,), True, 2)
    """
    return _new(Row, (row[0], nulls, stored, shared, row[4], *ASK, row[9]))


def append_ids(ids: list[int], length: int, new: list[int]) -> list[int]:
    """A list holding ``ids[:length] + new``: ``ids`` itself when nobody appended past ``length``.

    Appending in place is safe because a row reads only its first
    ``length`` entries.  Two transitions from one state may race to append
    (threads): whoever's entries land first keeps the list, the other
    copies, checked after the append, which a list does atomically.

    >>> ids = [3, 4]
    >>> grown = append_ids(ids, 2, [5])
    >>> grown is ids, append_ids(ids, 2, [6]), ids
    (True, [3, 4, 6], [3, 4, 5])
    """
    if len(ids) == length:
        ids.extend(new)
        if ids[length:length + len(new)] == new:
            return ids
    out = ids[:length]
    out.extend(new)
    return out


def grown(row: Row, entries: list[int], nulls: int, stored: int, shared: int) -> Row:
    """``row`` with ``entries`` appended (its lineage's list shared when it can be), ``nulls``
    null entries in all, the counters given, limits :data:`ASK`.

    >>> row = grown(make_row((), 0, 0, 0, 1), [NULL, 6], 1, 0, 0)
    >>> row_table(row), row.nulls
    ((0, 6), 1)
    """
    length = row[9]
    return _new(Row, (append_ids(row[0], length, entries), nulls, stored, shared, row[4], *ASK,
                      length + len(entries)))


def replaced(row: Row, position: int, block: int, stored: int) -> Row:
    """``row`` with ``block`` at ``position`` (a copy-on-write), in a list of its own.

    The lineage's list is never written below its end, so the table is copied.

    >>> old = make_row((4, 5), 0, 2, 2, 1)
    >>> new = replaced(old, 1, 9, 1)
    >>> row_table(new), row_table(old), new.stored
    ((4, 9), (4, 5), 1)
    """
    ids = row[0][:row[9]]
    ids[position] = block
    return _new(Row, (ids, row[1], stored, row[3], row[4], *ASK, row[9]))


def recycled_free(row: Row, upto: int, refs: Any) -> int:
    """Blocks that recycling positions ``row.nulls .. upto - 1`` frees: all of them without
    reference counts (``refs`` None), else those no other table holds.

    >>> recycled_free(make_row((4, 5, 6), 0, 0, 0, 1), 2, [0, 0, 0, 0, 2, 1, 1])
    1
    """
    if refs is None:
        return upto - row[1]
    return sum(1 for b in row[0][row[1]:upto] if refs[b] == 1)


def row_table(row: Row) -> tuple[int, ...]:
    """The row's entries as a tuple, null entries as block 0.

    >>> row_table(make_row((8, 9), 1, 0, 0, 0))
    (0, 8, 9)
    """
    nulls = row.nulls
    table = tuple(row.ids[nulls:row.length])
    return (NULL,) * nulls + table if nulls else table


def row_tail(row: Row, start: int) -> list[int]:
    """The row's entries from position ``start`` on, null entries as block 0.

    >>> row = make_row((8, 9, 7), 2, 0, 0, 0)
    >>> row_tail(row, 1), row_tail(row, 3), row_tail(row, 9)
    ([0, 8, 9, 7], [9, 7], [])
    """
    nulls = row[1]
    if start >= nulls:
        return row[0][start:row[9]]
    return [NULL] * (nulls - start) + row[0][nulls:row[9]]


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
