"""Planning and committing one delta's edits to a :class:`BlockTableBuffer`.

A :class:`DeltaPlan` walks the delta's column families in replay order
(nulls, releases, registrations, appends, copy-on-write copies), checking
every row, position and width against the buffer and collecting the writes
in plain lists;
nothing in the buffer changes until :meth:`DeltaPlan.commit`, which cannot
fail.  That is what makes :meth:`BlockTableBuffer.apply` all-or-nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvfunc.core._delta import BlocksChanged
from kvfunc.core._errors import ReplayMismatchError
from kvfunc.core._state import RequestId

if TYPE_CHECKING:
    from kvfunc.shell._buffer import BlockTableBuffer

__all__ = ["DeltaPlan", "mismatch"]


def mismatch(msg: str) -> ReplayMismatchError:
    """The error for a delta that was not made from the buffer's state."""
    return ReplayMismatchError(f"delta does not fit the block-table buffer: {msg}")


class DeltaPlan:
    """The edits one delta makes to a buffer, checked before any is written.

    Call :meth:`null`, then (when the delta changes membership)
    :meth:`release` and :meth:`register`, then :meth:`append`, then
    (when the delta copies blocks) :meth:`copy`, then :meth:`commit`.
    Rows of groups the buffer does not track are skipped.
    """

    __slots__ = ("buf", "changed", "holes", "order", "puts", "rows", "zeros")

    def __init__(self, buf: BlockTableBuffer) -> None:
        self.buf = buf
        self.rows = buf._rows
        self.order = buf._order
        self.changed: dict[tuple[int, int], int] = {}  # (group, row) -> new length
        self.zeros: list[list[int]] = [[] for _ in buf._specs]
        self.puts: list[tuple[list[int], list[int]]] = [([], []) for _ in buf._specs]
        self.holes: list[int] = []

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

    def null(self, d: BlocksChanged) -> None:
        """Plan null writes at the recycled positions."""
        index, specs = self.buf._index, self.buf._specs
        for key, rid, pos in zip(d.nulled_keys, d.nulled_request_ids, d.nulled_positions,
                                 strict=True):
            i = index.get(key)
            if i is None:
                continue
            row = self.row(rid, "a nulled position")
            if not 0 <= pos < self.length(i, row):
                raise mismatch(f"position {pos} of {rid!r} in {key!r} is past its table")
            self.zeros[i].append(row * specs[i].width + pos)

    def release(self, d: BlocksChanged) -> None:
        """Plan clearing released tables; rows registered nowhere any more become holes."""
        index, specs = self.buf._index, self.buf._specs
        self.rows, self.order = dict(self.rows), list(self.order)
        for key, rid in zip(d.released_keys, d.released_request_ids, strict=True):
            i = index.get(key)
            if i is None:
                continue
            row = self.row(rid, "a release")
            n = self.length(i, row)
            if n < 0:
                raise mismatch(f"release of {rid!r}, which is not registered in {key!r}")
            start = row * specs[i].width
            self.zeros[i].extend(range(start, start + n))
            self.changed[(i, row)] = -1
            if all(self.length(j, row) < 0 for j in range(len(specs))):
                del self.rows[rid]
                self.holes.append(row)

    def register(self, d: BlocksChanged) -> None:
        """Plan empty tables for registrations; new requests take a hole or a new row."""
        index = self.buf._index
        for key, rid in zip(d.registered_keys, d.registered_request_ids, strict=True):
            i = index.get(key)
            if i is None:
                continue
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
                raise mismatch(f"request {rid!r} is already registered in {key!r}")
            self.changed[(i, row)] = 0

    def append(self, d: BlocksChanged) -> None:
        """Plan writing each appended id after its table's last entry (width checked)."""
        index, specs, changed = self.buf._index, self.buf._specs, self.changed
        lens = self.buf._lens
        for key, rid, block in zip(d.appended_keys, d.appended_request_ids,
                                   d.appended_block_ids, strict=True):
            i = index.get(key)
            if i is None:
                continue
            row = self.rows.get(rid)
            if row is None:
                raise mismatch(f"an append names request {rid!r}, which has no row")
            n = changed.get((i, row))
            if n is None:
                n = lens[i][row]
            if n < 0:
                raise mismatch(f"append to {rid!r}, which is not registered in {key!r}")
            self.buf._check_width(i, rid, n + 1)
            changed[(i, row)] = n + 1
            width = specs[i].width
            cols, vals = self.puts[i]
            cols.append(row * width + n)
            vals.append(block)

    def copy(self, d: BlocksChanged) -> None:
        """Plan the copy-on-write rows: the copy replaces its source in the request's table.

        Rows with a negative position (a state seeding a block appended in
        the same delta, a state saved into the cache) and plain copies
        without request ids change no table.
        """
        if not d.copied_request_ids:
            return
        n = len(d.copied_keys)
        if len(d.copied_request_ids) != n or len(d.copied_positions) != n:
            raise mismatch("copied_request_ids and copied_positions are not parallel to "
                           "copied_keys")
        index, specs = self.buf._index, self.buf._specs
        where: list[tuple[dict[int, int], set[int]] | None] = [None] * len(specs)
        for key, rid, pos, src, dst in zip(d.copied_keys, d.copied_request_ids,
                                           d.copied_positions, d.copied_src_block_ids,
                                           d.copied_dst_block_ids, strict=True):
            i = index.get(key)
            if i is None or pos < 0:
                continue
            row = self.row(rid, "a copy-on-write")
            if not pos < self.length(i, row):
                raise mismatch(f"copy-on-write position {pos} of {rid!r} in {key!r} is past "
                               "its table")
            cols, vals = self.puts[i]
            planned = where[i]
            if planned is None:  # the planned writes (the last one wins) and clears
                planned = where[i] = ({c: j for j, c in enumerate(cols)}, set(self.zeros[i]))
            at, cleared = planned
            col = row * specs[i].width + pos
            j = at.get(col)
            if j is not None:
                held = vals[j]
            else:
                held = 0 if col in cleared else int(self.buf._flat[i][col])
            if held != src:
                raise mismatch(f"copy-on-write of position {pos} of {rid!r} in {key!r} "
                               f"replaces block {src}, but the table holds {held}")
            if j is None:
                at[col] = len(cols)
                cols.append(col)
                vals.append(dst)
            else:
                vals[j] = dst

    def commit(self) -> None:
        """Write the planned edits, then condense the rows; nothing here can fail."""
        buf = self.buf
        if buf._copy_event is not None:  # the last host-to-device copy reads these pages
            buf._copy_event.synchronize()
            buf._copy_event = None
        for flat, zeros, (cols, vals) in zip(buf._flat, self.zeros, self.puts, strict=True):
            if zeros:
                flat[zeros] = 0
            if cols:
                flat[cols] = vals
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
        if self.changed or self.holes or any(self.zeros) or any(c for c, _ in self.puts):
            buf._dirty = True
