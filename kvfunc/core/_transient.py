"""A transient: the mutable working copy one transition (or a compat facade) edits.

Transitions never touch a published :class:`KVState`.  They open a
:class:`Transient` on it, edit the transient's per-group working copies
(copy-on-write: a group's tables are copied on its first write, its ring is
edited through a few dirty chunk lists), then :meth:`Transient.freeze` it into a
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

from kvfunc.core._state import (
    FREE_CHUNK,
    BlockId,
    FrozenDict,
    GroupState,
    KVState,
    RequestId,
    find_group,
)

__all__ = ["GroupTransient", "Transient"]


class GroupTransient:
    """Working copy of one :class:`GroupState`."""

    __slots__ = (
        "block_size", "cap", "changed", "count", "detached", "dirty", "grows", "head", "key",
        "may_skip", "owned", "policy", "ring", "src", "tables", "window",
    )

    counts_refs = False  # the caching subclass counts references per block

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
        self.ring: PVector[tuple[BlockId, ...]] = group.free_ring
        self.dirty: dict[int, list[BlockId]] | None = None
        self.cap = len(group.free_ring) * FREE_CHUNK
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
    def _chunk(self, index: int) -> Any:
        dirty = self.dirty
        if dirty is not None:
            chunk = dirty.get(index)
            if chunk is not None:
                return chunk
        return self.ring[index]

    def take(self, n: int) -> tuple[BlockId, ...]:
        """Pop ``n`` ids from the head (caller checked ``n <= count``)."""
        out, h = self._read(self.head, n)
        self.head = h
        self.count -= n
        self.changed = True
        return out

    def _read(self, h: int, n: int) -> tuple[tuple[BlockId, ...], int]:
        """``n`` ring entries from position ``h`` and the position after them."""
        cap = self.cap
        index, off = divmod(h, FREE_CHUNK)
        if off + n <= FREE_CHUNK:  # the common case: one chunk
            out = tuple(self._chunk(index)[off:off + n])
            h += n
        else:
            parts: list[BlockId] = []
            while len(parts) < n:
                index, off = divmod(h, FREE_CHUNK)
                m = min(n - len(parts), FREE_CHUNK - off)
                parts.extend(self._chunk(index)[off:off + m])
                h += m
                if h == cap:
                    h = 0
            out = tuple(parts)
        return out, (h if h != cap else 0)

    def give(self, ids: Iterable[BlockId]) -> None:
        """Append ids at the tail, in the order given (chunks copied on first write)."""
        new = ids if isinstance(ids, list | tuple) else list(ids)
        if not new:
            return
        self._write((self.head + self.count) % self.cap, new)
        self.count += len(new)
        self.changed = True

    def release_blocks(self, ids: list[BlockId] | tuple[BlockId, ...]
                       ) -> list[BlockId] | tuple[BlockId, ...]:
        """Drop one reference to each block; return (and free) those nobody holds.

        Without reference counts every block has one holder: all are freed.
        """
        self.give(ids)
        return ids

    def _write(self, pos: int, new: list[BlockId] | tuple[BlockId, ...]) -> None:
        """Write ``new`` into the ring from position ``pos`` on."""
        dirty = self.dirty
        if dirty is None:
            dirty = self.dirty = {}
        cap = self.cap
        i = 0
        while i < len(new):
            index, off = divmod(pos, FREE_CHUNK)
            m = min(len(new) - i, FREE_CHUNK - off)
            chunk = dirty.get(index)
            if chunk is None:
                chunk = dirty[index] = list(self.ring[index])
            chunk[off:off + m] = new[i:i + m]
            i += m
            pos += m
            if pos == cap:
                pos = 0

    def free_ids(self) -> list[BlockId]:
        """Free ids in hand-out order (O(free); for checks, not the hot path)."""
        h, cap = self.head, self.cap
        out = []
        for i in range(self.count):
            p = (h + i) % cap
            out.append(self._chunk(p // FREE_CHUNK)[p % FREE_CHUNK])
        return out

    def freeze(self) -> GroupState:
        """The group as an immutable value; the working copies become shared."""
        if not self.changed:
            return self.src
        if self.dirty:
            ev = self.ring.evolver()
            for index, chunk in self.dirty.items():
                ev[index] = tuple(chunk)
            self.ring = ev.persistent()
        self.dirty = None
        self.owned = False
        self.changed = False
        self.src = GroupState(self.key, self.policy, self.tables, self.ring, self.head,
                              self.count, self.detached,
                              self._frozen_cache() if self.counts_refs else None)
        return self.src

    def _frozen_cache(self) -> Any:
        return None


# The caching subclass registers itself here (``_cache_transient`` imports this module).
CACHING_KIND: list[type[GroupTransient]] = []


class Transient:
    """Working copy of a whole :class:`KVState`."""

    __slots__ = ("caching", "groups", "max_model_len", "src")

    def __init__(self, state: KVState) -> None:
        self.src = state
        self.max_model_len = state.max_model_len
        groups = state.groups
        self.caching = groups[0].cache is not None if groups else False
        kind = CACHING_KIND[0] if self.caching else GroupTransient
        self.groups: tuple[GroupTransient, ...] = tuple(kind(g) for g in groups)

    def group(self, key: str) -> GroupTransient:
        """The working copy of ``key``'s group."""
        return find_group(self.groups, key)

    def freeze(self) -> KVState:
        """The current state as a value (the input state when nothing changed)."""
        src = self.src
        groups = tuple(g.freeze() for g in self.groups)
        if all(a is b for a, b in zip(groups, src.groups, strict=True)):
            return src
        self.src = KVState(self.max_model_len, groups)
        return self.src

