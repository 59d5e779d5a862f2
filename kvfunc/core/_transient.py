"""A transient: the mutable working copy one transition (or a compat facade) edits.

Transitions never touch a published :class:`KVState`.  They open a
:class:`Transient` on it, edit the transient's per-group working copies
(copy-on-write: a group's tables are copied on its first write, its ring is
edited through a pyrsistent evolver), then :meth:`Transient.freeze` it into a
new state.  Freezing hands the working copies over to the new state and marks
them shared again, so the same transient can go on being edited afterwards:
the seed-compatible facade keeps one between calls and materialises a state
only when asked, which keeps its per-call cost at mutable-code speed.

All allocation *policy* lives in ``_transitions`` (and the per-type policies);
this module only knows how to edit tables and the FIFO ring.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pyrsistent import PVector

from kvfunc.core._errors import UnknownRequestError
from kvfunc.core._state import BlockId, FrozenDict, GroupState, KVState, RequestId

__all__ = ["GroupTransient", "Transient"]


class GroupTransient:
    """Working copy of one :class:`GroupState`."""

    __slots__ = (
        "block_size", "cap", "changed", "count", "detached", "evolver", "grows", "head", "key",
        "may_skip", "owned", "policy", "ring", "src", "tables", "window",
    )

    def __init__(self, group: GroupState) -> None:
        policy = group.policy
        self.src = group
        self.key = group.key
        self.policy = policy
        self.block_size = policy.block_size
        self.window = policy.window
        self.may_skip = policy.may_skip
        self.grows = policy.grows_with_tokens
        self.tables: FrozenDict[RequestId, tuple[BlockId, ...]] = group.tables
        self.owned = False
        self.ring: PVector[BlockId] = group.free_ring
        self.evolver: Any = None
        self.cap = len(group.free_ring)
        self.head = group.free_head
        self.count = group.num_free
        self.detached = group.num_detached
        self.changed = False

    # -- tables ---------------------------------------------------------------
    def set_table(self, request_id: RequestId, table: tuple[BlockId, ...]) -> None:
        """Bind ``request_id``'s table (copying the shared dict on first write)."""
        if not self.owned:
            self.tables = FrozenDict(self.tables)
            self.owned = True
        dict.__setitem__(self.tables, request_id, table)
        self.changed = True

    def drop_table(self, request_id: RequestId) -> tuple[BlockId, ...]:
        """Remove and return ``request_id``'s table."""
        if not self.owned:
            self.tables = FrozenDict(self.tables)
            self.owned = True
        self.changed = True
        table: tuple[BlockId, ...] = dict.pop(self.tables, request_id)
        return table

    # -- the FIFO ring ---------------------------------------------------------
    def take(self, n: int) -> list[BlockId]:
        """Pop ``n`` ids from the head (caller checked ``n <= count``)."""
        src = self.evolver if self.evolver is not None else self.ring
        h, cap = self.head, self.cap
        if h + n <= cap:
            ids = [src[i] for i in range(h, h + n)]
        else:
            ids = [src[(h + i) % cap] for i in range(n)]
        self.head = (h + n) % cap
        self.count -= n
        self.changed = True
        return ids

    def give(self, ids: Iterable[BlockId]) -> None:
        """Append ids at the tail, in the order given."""
        ev = self.evolver
        if ev is None:
            ev = self.evolver = self.ring.evolver()
        cap = self.cap
        pos = (self.head + self.count) % cap
        n = 0
        for b in ids:
            ev[pos] = b
            pos += 1
            if pos == cap:
                pos = 0
            n += 1
        self.count += n
        self.changed = True

    def free_ids(self) -> list[BlockId]:
        """Free ids in hand-out order (O(free); for checks, not the hot path)."""
        src = self.evolver if self.evolver is not None else self.ring
        h, cap = self.head, self.cap
        return [src[(h + i) % cap] for i in range(self.count)]

    def freeze(self) -> GroupState:
        """The group as an immutable value; the working copies become shared."""
        if not self.changed:
            return self.src
        if self.evolver is not None:
            self.ring = self.evolver.persistent()
        self.owned = False
        self.changed = False
        self.src = GroupState(self.key, self.policy, self.tables, self.ring, self.head,
                              self.count, self.detached)
        return self.src


class Transient:
    """Working copy of a whole :class:`KVState`."""

    __slots__ = ("groups", "max_model_len", "src")

    def __init__(self, state: KVState) -> None:
        self.src = state
        self.max_model_len = state.max_model_len
        self.groups = tuple(GroupTransient(g) for g in state.groups)

    def group(self, key: str) -> GroupTransient:
        """The working copy of ``key``'s group."""
        for g in self.groups:
            if g.key == key:
                return g
        msg = f"unknown manager_key {key!r}; known keys: {[g.key for g in self.groups]}"
        raise UnknownRequestError(msg)

    def freeze(self) -> KVState:
        """The current state as a value (the input state when nothing changed)."""
        src = self.src
        groups = tuple(g.freeze() for g in self.groups)
        if all(a is b for a, b in zip(groups, src.groups, strict=True)):
            return src
        self.src = KVState(self.max_model_len, groups)
        return self.src
