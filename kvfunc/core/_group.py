"""Working copies: what one transition (or the compat facade) edits, then freezes.

Transitions never touch a published :class:`~kvfunc.KVState`.  They open a
:class:`Transient` on it; a group's :class:`GroupCopy` is made on its first
write (the rows turn into a vector evolver, the ring into a
:class:`~kvfunc.core._pool.RingCopy`), and :meth:`Transient.freeze` hands the
edits over to a new state.  Freezing marks the working copies shared again,
so the same transient can go on being edited: the compat facade keeps one
between calls and materialises a state only when asked.

A :class:`GroupCopy` offers the *primitives* of every transition: register,
drop, take, free, recycle, append.  Each one records its rows in the
transition's :class:`~kvfunc.core._delta.DeltaBuilder` (when there is one)
in the order it acts, so the delta is the transition's exact log and replay
runs the same primitives.  Prefix caching is a strategy of the group: the
caching working copy (``_cache_group``) overrides how blocks are taken,
freed and shared (reference counts, the hash store, the eviction order)
and adds storing; the step in ``_step`` calls the same primitives either way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvfunc.core._delta import DeltaBuilder
from kvfunc.core._policy import Policy
from kvfunc.core._pool import RingCopy
from kvfunc.core._rows import EMPTY_ROW, Row, SlotMap, extend_row, row_of, row_table
from kvfunc.core._state import GroupState, KVState, find_group, reslot

__all__ = ["CACHING_KIND", "GroupCopy", "Transient"]

_new = tuple.__new__
_set = object.__setattr__


class GroupCopy:
    """The working copy of one group (see the module docstring)."""

    __slots__ = ("block_size", "changed", "count", "detached", "grows", "key", "num_rows",
                 "policy", "ring", "rows", "sink", "slots", "src", "window")

    caching = False

    def __init__(self, group: GroupState, sink: DeltaBuilder | None) -> None:
        policy: Policy = group.policy
        self.src = group
        self.key = group.key
        self.policy = policy
        self.block_size: int = policy.block_size
        self.window: int | None = policy.window
        self.grows: bool = policy.grows_with_tokens
        self.slots: SlotMap = group.slots
        self.rows: Any = group.rows.evolver()  # kept for the copy's life (freezing reuses it)
        self.num_rows = group.num_rows
        self.ring = RingCopy(group.free_ring, group.free_head)
        self.count = group.num_free
        self.detached = group.num_detached
        self.sink = sink
        self.changed = False

    # -- rows -------------------------------------------------------------------
    def row(self, slot: int) -> Row | None:
        """The row at ``slot`` (None: not registered here)."""
        rows = self.rows
        return rows[slot] if slot < len(rows) else None

    def put(self, slot: int, row: Row) -> None:
        """Bind the row at ``slot``."""
        rows = self.rows
        if slot >= len(rows):
            rows.extend([None] * (slot + 1 - len(rows)))
        if rows[slot] is None:
            self.num_rows += 1
        rows[slot] = row
        self.changed = True

    def register(self, request_id: int | str) -> Row:
        """Record a registration; the caller puts the request's row."""
        if self.sink is not None:
            self.sink.registered.append((self.key, request_id))
            self.sink.order.append("R")
        return EMPTY_ROW

    def drop(self, slot: int, request_id: int | str) -> Row:
        """Remove and return the row at ``slot`` (its blocks are the caller's to free)."""
        rows = self.rows
        row: Row = rows[slot]
        rows[slot] = None
        self.num_rows -= 1
        self.changed = True
        if self.sink is not None:
            self.sink.released.append((self.key, request_id))
            self.sink.order.append("L")
        return row

    # -- blocks -------------------------------------------------------------------
    def take(self, n: int) -> list[int]:
        """Pop ``n`` ids from the head of the free queue (the caller checked ``n <= count``)."""
        self.count -= n
        self.changed = True
        return self.ring.pop(n)

    def free(self, ids: Sequence[int]) -> None:
        """Return blocks nobody holds to the free queue (the seed's tail), in order."""
        if not ids:
            return
        ring = self.ring
        ring.write((ring.head + self.count) % ring.cap, ids)
        self.count += len(ids)
        self.changed = True
        sink = self.sink
        if sink is not None:
            key = self.key
            sink.freed.extend([(key, b) for b in ids])
            sink.order.append("F" * len(ids))

    def release(self, ids: Sequence[int]) -> None:
        """Drop one holder of each block; free those nobody holds (all of them, here)."""
        self.free(ids)

    def free_ids(self) -> list[int]:
        """Every free block in hand-out order (O(free); for checks and the compat pool)."""
        return self.ring.entries(self.count)

    def table(self, request_id: int | str) -> tuple[int, ...] | None:
        """The request's block ids (null entries 0), or None when it is not registered here."""
        row = row_of(self.rows, self.slots, request_id)
        return None if row is None else row_table(row)

    def reclaimable(self, row: Row, upto: int) -> int:
        """Blocks that recycling positions ``row.nulls .. upto - 1`` returns to the queue."""
        return upto - row.nulls

    def release_order(self, row: Row) -> list[int]:
        """A dropped row's blocks in the order they are freed: logical order (the seed's)."""
        return row.ids[row.nulls:row.length]

    def release_row(self, row: Row) -> None:
        """Free a dropped row's blocks (see :meth:`release_order`)."""
        self.release(self.release_order(row))

    def recycle(self, request_id: int | str, row: Row, upto: int) -> Row:
        """Null positions ``row.nulls .. upto - 1`` and free their blocks, highest index first."""
        lo = row.nulls
        sink = self.sink
        if sink is not None:
            key = self.key
            sink.nulled.extend([(key, request_id, p) for p in range(lo, upto)])
            sink.order.append("N" * (upto - lo))
        new = _new(Row, (row.ids, row.length, upto, row.shared, row.stored))
        self.release(row.ids[upto - 1:lo - 1 if lo else None:-1])
        return new

    def grow(self, request_id: int | str, row: Row, need: int, nulls: int = 0) -> Row:
        """Append ``nulls`` null entries, then ``need`` blocks taken from the free queue."""
        ids = self.take(need) if need else []
        sink = self.sink
        if sink is not None:
            key = self.key
            if nulls:
                rows = [(key, request_id, 0)] * nulls
                rows.extend([(key, request_id, b) for b in ids])
                sink.appended.extend(rows)
                sink.order.append("A" * len(rows))
            elif need == 1:  # the common decode step
                sink.appended.append((key, request_id, ids[0]))
                sink.order.append("A")
            else:
                sink.appended.extend([(key, request_id, b) for b in ids])
                sink.order.append("A" * need)
        return extend_row(row, ids, nulls)

    # -- freezing -------------------------------------------------------------------
    def freeze(self) -> GroupState:
        """The group as an immutable value; the working copies become shared again."""
        if not self.changed:
            return self.src
        ring = self.ring
        self.src = GroupState(self.key, self.policy, self.rows.persistent(), self.num_rows,
                              self.slots,
                              ring.frozen(), ring.head, self.count, self.detached,
                              self._frozen_cache())
        self.changed = False
        return self.src

    def _frozen_cache(self) -> Any:
        return None


# The caching working copy registers itself here (``_cache_group`` imports this module).
CACHING_KIND: list[type[GroupCopy]] = []


class Transient:
    """The working copy of a whole :class:`~kvfunc.KVState`; group copies made on first write.

    ``views[i]`` is what group ``i`` reads from: the published group until
    :meth:`copy` makes its working copy.
    """

    __slots__ = ("caching", "checked", "copies", "lane", "max_model_len", "sink", "slots", "src",
                 "views")

    def __init__(self, state: KVState, sink: DeltaBuilder | None = None) -> None:
        self.src = state
        self.max_model_len = state.max_model_len
        self.sink = sink
        groups = state.groups
        self.caching = state.prefix_caching
        self.views: list[Any] = list(groups)
        self.copies: list[GroupCopy | None] = [None] * len(groups)
        self.slots: SlotMap = groups[0].slots if groups else SlotMap()
        self.lane: Any = state._lane  # the fold's lane over the state's rows
        self.checked: set[int] = set()  # hash block sizes the fold checked against the groups

    def copy(self, i: int) -> GroupCopy:
        """The working copy of group ``i`` (made on first use)."""
        g = self.copies[i]
        if g is None:
            kind = CACHING_KIND[0] if self.caching else GroupCopy
            g = self.copies[i] = self.views[i] = kind(self.views[i], self.sink)
            self.lane = None  # it reads this group's rows from the copy from now on
        return g

    def all_copies(self) -> list[GroupCopy]:
        """Every group's working copy."""
        return [self.copy(i) for i in range(len(self.views))]

    def group(self, key: str) -> GroupCopy:
        """The working copy of ``key``'s group."""
        i = self.views.index(find_group(self.views, key))
        return self.copy(i)

    def freeze(self) -> KVState:
        """The current state as a value (the input state when nothing changed)."""
        src = self.src
        changed = False
        frozen: list[GroupState] = []
        for copy, before in zip(self.copies, src.groups, strict=True):
            after = before if copy is None else copy.freeze()
            changed = changed or after is not before
            frozen.append(after)
        if not changed:
            return src
        groups = tuple(frozen)
        live = 0
        for group in groups:
            live = group.num_rows if group.num_rows > live else live
        if len(self.slots) > live + live // 4 + 64:  # mostly finished requests: a fresh map
            groups = reslot(groups)
            for i, group in enumerate(groups):  # the copies now edit the fresh rows
                copy = self.copies[i]
                if copy is not None:
                    copy.src, copy.rows, copy.slots = group, group.rows.evolver(), group.slots
                else:
                    self.views[i] = group
            self.slots, self.lane = groups[0].slots, None
        self.src = state = object.__new__(KVState)  # its groups share one slot map: no check
        _set(state, "max_model_len", self.max_model_len)
        _set(state, "groups", groups)
        _set(state, "_lane", None)
        return state
