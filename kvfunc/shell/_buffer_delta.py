"""Planning and committing one delta's edits to a :class:`BlockTableBuffer`.

A :class:`DeltaPlan` folds over the delta's operations in the order the
transition performed them (:meth:`~kvfunc.BlocksChanged.operations`), checking
every row, position and width against the buffer and collecting the writes
(the last write to a cell wins); nothing in the buffer changes until
:meth:`DeltaPlan.commit`, which cannot fail.  That is what makes
:meth:`BlockTableBuffer.apply` all-or-nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvfunc.core import (
    Appended,
    BlocksChanged,
    Copied,
    Detached,
    Nulled,
    Registered,
    Released,
    ReplayMismatchError,
    RequestId,
    Shared,
)

if TYPE_CHECKING:
    from kvfunc.shell._buffer import BlockTableBuffer

__all__ = ["DeltaPlan", "mismatch"]


def mismatch(msg: str) -> ReplayMismatchError:
    """The error for a delta that was not made from the buffer's state."""
    return ReplayMismatchError(f"delta does not fit the block-table buffer: {msg}")


class DeltaPlan:
    """The edits one delta makes to a buffer, checked before any is written.

    Call :meth:`plan` with the delta, then :meth:`commit`.  Operations of
    groups the buffer does not track are skipped.
    """

    __slots__ = ("buf", "changed", "holes", "order", "rows", "writes")

    def __init__(self, buf: BlockTableBuffer) -> None:
        self.buf = buf
        self.rows = buf._rows
        self.order = buf._order
        self.changed: dict[tuple[int, int], int] = {}  # (group, row) -> new length
        self.writes: list[dict[int, int]] = [{} for _ in buf._specs]  # column -> block
        self.holes: list[int] = []

    def plan(self, delta: BlocksChanged) -> None:
        """Plan every operation of ``delta`` in order (see the module docstring)."""
        index = self.buf._index
        handlers: dict[type[Any], Any] = {
            Registered: self.register, Released: self.release, Detached: self.release,
            Nulled: self.null,
            Appended: self.append, Shared: self.append, Copied: self.copy}
        for op in delta.operations():
            handler = handlers.get(type(op))
            if handler is not None:
                i = index.get(op.key)  # type: ignore[union-attr]
                if i is not None:
                    handler(i, op)

    def length(self, i: int, row: int) -> int:
        """Planned table length of ``row`` in group ``i`` (-1: not registered there)."""
        n = self.changed.get((i, row))
        return self.buf._lens[i][row] if n is None else n

    def row(self, rid: RequestId, what: str) -> int:
        """The planned row of ``rid``; a delta naming a request without one raises."""
        row = self.rows.get(rid)
        if row is None:
            raise mismatch(f"{what} names request {rid!r}, which has no row")
        return row

    def cell(self, i: int, row: int, position: int) -> int:
        """The planned block at ``position`` of ``row`` in group ``i``."""
        col = row * self.buf._specs[i].width + position
        held = self.writes[i].get(col)
        return int(self.buf._flat[i][col]) if held is None else held

    def null(self, i: int, op: Nulled) -> None:
        """Plan a null write at the recycled position."""
        row = self.row(op.request_id, "a nulled position")
        if not 0 <= op.position < self.length(i, row):
            raise mismatch(f"position {op.position} of {op.request_id!r} in {op.key!r} is past "
                           "its table")
        self.writes[i][row * self.buf._specs[i].width + op.position] = 0

    def release(self, i: int, op: Released) -> None:
        """Plan clearing a released table; a row registered nowhere any more becomes a hole."""
        rid, specs = op.request_id, self.buf._specs
        if self.rows is self.buf._rows:
            self.rows, self.order = dict(self.rows), list(self.order)
        row = self.row(rid, "a release")
        n = self.length(i, row)
        if n < 0:
            raise mismatch(f"release of {rid!r}, which is not registered in {op.key!r}")
        start = row * specs[i].width
        self.writes[i].update(dict.fromkeys(range(start, start + n), 0))
        self.changed[(i, row)] = -1
        if all(self.length(j, row) < 0 for j in range(len(specs))):
            del self.rows[rid]
            self.holes.append(row)

    def register(self, i: int, op: Registered) -> None:
        """Plan an empty table; a new request takes a hole or a new row."""
        rid = op.request_id
        if self.rows is self.buf._rows:
            self.rows, self.order = dict(self.rows), list(self.order)
        row = self.rows.get(rid)
        if row is None:
            if self.holes:
                row = min(self.holes)
                self.holes.remove(row)
                self.order[row] = rid
            else:
                row = self.buf._new_row(len(self.order), rid)
                self.order.append(rid)
            self.rows[rid] = row
        if self.length(i, row) >= 0:
            raise mismatch(f"request {rid!r} is already registered in {op.key!r}")
        self.changed[(i, row)] = 0

    def append(self, i: int, op: Appended | Shared) -> None:
        """Plan writing the appended id after its table's last entry (width checked)."""
        row = self.row(op.request_id, "an append")
        n = self.length(i, row)
        if n < 0:
            raise mismatch(f"append to {op.request_id!r}, which is not registered in {op.key!r}")
        self.buf._check_width(i, op.request_id, n + 1)
        self.changed[(i, row)] = n + 1
        self.writes[i][row * self.buf._specs[i].width + n] = op.block_id

    def copy(self, i: int, op: Copied) -> None:
        """Plan a copy-on-write: the copy replaces its source in the request's table.

        A copy with a negative position (a state seeding the request's new
        block, a state saved into the cache) changes no table.
        """
        if op.position < 0:
            return
        row = self.row(op.request_id, "a copy-on-write")
        if not op.position < self.length(i, row):
            raise mismatch(f"copy-on-write position {op.position} of {op.request_id!r} in "
                           f"{op.key!r} is past its table")
        held = self.cell(i, row, op.position)
        if held != op.src_block_id:
            raise mismatch(f"copy-on-write of position {op.position} of {op.request_id!r} in "
                           f"{op.key!r} replaces block {op.src_block_id}, but the table holds "
                           f"{held}")
        self.writes[i][row * self.buf._specs[i].width + op.position] = op.dst_block_id

    def commit(self) -> None:
        """Write the planned edits, then condense the rows; nothing here can fail."""
        buf = self.buf
        if buf._copy_event is not None:  # the last host-to-device copy reads these pages
            buf._copy_event.synchronize()
            buf._copy_event = None
        for flat, writes in zip(buf._flat, self.writes, strict=True):
            if writes:
                flat[list(writes)] = list(writes.values())
        for (i, row), n in self.changed.items():
            buf._lens[i][row] = n
        order = self.order
        if self.holes:
            live = len(self.rows)
            holes = sorted(h for h in self.holes if h < live)
            movers = [r for r in range(len(order) - 1, live - 1, -1) if r not in self.holes]
            for dst, src in zip(holes, movers, strict=True):
                rid = order[src]
                order[dst] = rid
                self.rows[rid] = dst
            if holes:
                dst_rows, src_rows = holes, movers[:len(holes)]
                for i, (spec, flat) in enumerate(zip(buf._specs, buf._flat, strict=True)):
                    table = flat.reshape(buf.max_num_requests, spec.width)
                    table[dst_rows] = table[src_rows]
                    table[src_rows] = 0
                    lens = buf._lens[i]
                    for dst, src in zip(dst_rows, src_rows, strict=True):
                        lens[dst], lens[src] = lens[src], -1
            del order[live:]
        buf._rows, buf._order = self.rows, order
        if self.changed or self.holes or any(self.writes):
            buf._dirty = True
