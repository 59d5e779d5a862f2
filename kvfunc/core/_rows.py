"""Block tables as rows: cheap to extend, cheap to keep.

Theory of operation
-------------------
A group keeps one :class:`Row` per registered request.  A row's entries are
the first ``length`` items of ``ids``, the first ``nulls`` of them read as the
null block (null entries only ever form a prefix: a sliding window's head).
``ids`` is a plain list that the successive rows of one request *share*: a
row owns its first ``length`` items and never reads past them, and extending
a row appends to the list in place when nothing was appended after its own
items (otherwise it copies them first).  Appending a block therefore costs
O(1) and a new row record, not a copy of the table, and a state kept as a
snapshot costs only the rows that changed since.

Rows live in a persistent vector per group, indexed by a *slot*.  A
:class:`SlotMap` gives each request id its slot; it is shared by every group
and every state of one lineage and only ever grows (an id keeps its slot for
good, freed or not), so a state finds a request's row with one dict read and
one vector read, and a transition never copies a per-request dict.  A state
reads only the slots its vectors cover; a slot past a vector's end is an
unregistered request.  The map is rebuilt, with only the live requests, when
dead ids outnumber live ones (see ``_state``).

Two counters serve prefix caching (both 0 without it) so that the common
decode step reads no per-block vector:

* ``shared``: positions at or past it hold blocks no other table holds, so a
  write there needs no copy-on-write;
* ``stored``: positions before ``max(stored, nulls)`` are cached or null, so
  a step whose written tokens end before it has nothing to cache.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

from kvfunc.core._errors import InvalidArgumentError

__all__ = ["EMPTY_ROW", "Row", "SlotMap", "TablesView", "extend_row", "leading_nulls",
           "replace_entry", "row_of", "row_table"]

NULL = 0
_new = tuple.__new__


class Row(NamedTuple):
    """One request's block table in one group (see the module docstring)."""

    ids: list[int]
    length: int
    nulls: int
    shared: int = 0
    stored: int = 0


EMPTY_ROW = Row([], 0, 0, 0, 0)


def row_table(row: Row) -> tuple[int, ...]:
    """The row's entries as a tuple, null entries as block 0.

    >>> row_table(Row([7, 8, 9], 3, 1))
    (0, 8, 9)
    """
    nulls = row.nulls
    if not nulls:
        return tuple(row.ids[:row.length])
    return (NULL,) * nulls + tuple(row.ids[nulls:row.length])


def leading_nulls(entries: Sequence[int]) -> int:
    """How many entries of a table open it as null entries (block 0).

    >>> leading_nulls((0, 0, 5, 0)), leading_nulls(())
    (2, 0)
    """
    n = 0
    while n < len(entries) and not entries[n]:
        n += 1
    return n


def extend_row(row: Row, blocks: Sequence[int], nulls: int = 0) -> Row:
    """``row`` with ``nulls`` null entries, then ``blocks``, appended (a new row).

    Null entries may only be appended to a row of null entries.  The shared
    list is extended in place when this row owns its end; after appending,
    the items must read back as ``blocks`` (another row of the lineage may
    have appended first, or at the same moment from another thread), else
    the row takes a copy of its own items.

    >>> a = Row([1, 2], 2, 0)
    >>> b = extend_row(a, [5])
    >>> b.ids is a.ids, row_table(b), row_table(a)
    (True, (1, 2, 5), (1, 2))
    >>> c = extend_row(a, [6])              # a sibling: copies, a is untouched
    >>> c.ids is a.ids, row_table(c), row_table(b)
    (False, (1, 2, 6), (1, 2, 5))
    """
    ids, n = row.ids, row.length
    if nulls:
        if n != row.nulls:
            raise InvalidArgumentError("null entries only ever form a prefix of a table")
        added = [NULL] * nulls
        added.extend(blocks)
    elif len(blocks) == 1:  # the common decode step: one block
        b = blocks[0]
        if len(ids) == n:
            ids.append(b)
            if ids[n] != b:  # another row of the lineage went on first
                ids = ids[:n] + [b]
        else:
            ids = ids[:n] + [b]
        return _new(Row, (ids, n + 1, row.nulls, row.shared, row.stored))
    else:
        added = blocks if type(blocks) is list else list(blocks)
    k = len(added)
    if len(ids) == n:
        ids.extend(added)
        if ids[n:n + k] != added:  # another row of the lineage went on first
            ids = ids[:n] + added
    else:
        ids = ids[:n] + added
    return _new(Row, (ids, n + k, row.nulls + nulls, row.shared, row.stored))


def replace_entry(row: Row, position: int, block: int) -> Row:
    """``row`` with the entry at ``position`` replaced by ``block`` (its own copy of the list).

    >>> row_table(replace_entry(Row([1, 2, 3], 3, 0), 1, 9))
    (1, 9, 3)
    """
    ids = row.ids[:row.length]
    ids[position] = block
    return _new(Row, (ids, row.length, row.nulls, row.shared, row.stored))


class SlotMap:
    """Request id -> slot, shared by a lineage of states; it only ever grows.

    A slot is drawn once per id and kept for good.  ``slot_of`` is safe to
    call from several threads at once: ``dict.setdefault`` and the counter
    are atomic, so two threads registering one new id agree on its slot.

    >>> m = SlotMap()
    >>> m.slot_of("a"), m.slot_of("b"), m.slot_of("a"), m.get("c")
    (0, 1, 0, None)
    """

    __slots__ = ("_next", "slots")

    def __init__(self) -> None:
        self.slots: dict[int | str, int] = {}
        self._next = itertools.count()

    def slot_of(self, request_id: int | str) -> int:
        """The slot of ``request_id``, drawing a new one the first time."""
        slot = self.slots.get(request_id)
        if slot is None:
            slot = self.slots.setdefault(request_id, next(self._next))
        return slot

    def get(self, request_id: int | str) -> int | None:
        """The slot of ``request_id``, or None if it never had one."""
        return self.slots.get(request_id)

    def __len__(self) -> int:
        return len(self.slots)

    def __repr__(self) -> str:
        return f"SlotMap({len(self.slots)} ids)"


def row_of(rows: Any, slots: SlotMap, request_id: object) -> Row | None:
    """The row of ``request_id`` in ``rows`` (a vector of rows or its evolver), or None.

    A request without a slot, or whose slot lies past the vector, has no row.

    >>> m = SlotMap()
    >>> m.slot_of("a")
    0
    >>> row_of([Row([4], 1, 0)], m, "a"), row_of([], m, "a"), row_of([Row([4], 1, 0)], m, "b")
    (Row(ids=[4], length=1, nulls=0, shared=0, stored=0), None, None)
    """
    slot = slots.slots.get(request_id)  # type: ignore[call-overload]
    if slot is None or slot >= len(rows):
        return None
    row: Row | None = rows[slot]
    return row


class TablesView(Mapping[int | str, tuple[int, ...]]):
    """A group's block tables as a read-only mapping (built on access; not the hot path)."""

    __slots__ = ("_rows", "_slots")

    def __init__(self, rows: Any, slots: SlotMap) -> None:
        self._rows = rows
        self._slots = slots

    def __getitem__(self, request_id: int | str) -> tuple[int, ...]:
        row = row_of(self._rows, self._slots, request_id)
        if row is None:
            raise KeyError(request_id)
        return row_table(row)

    def __contains__(self, request_id: object) -> bool:
        return row_of(self._rows, self._slots, request_id) is not None

    def __iter__(self) -> Iterator[int | str]:
        rows, n = self._rows, len(self._rows)
        for rid, slot in list(self._slots.slots.items()):
            if slot < n and rows[slot] is not None:
                yield rid

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __repr__(self) -> str:
        return f"TablesView({dict(self)!r})"
