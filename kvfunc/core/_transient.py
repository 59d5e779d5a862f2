"""The working copy of a state: what one transition (or the compat facade) edits.

Theory of operation
-------------------
A :class:`Transient` opens on a :class:`~kvfunc.core._state.KVState`; a
group's :class:`~kvfunc.core._group.GroupCopy` and its pool's
:class:`~kvfunc.core._pool.PoolCopy` are made on first write, and
:meth:`Transient.freeze` builds the new state from the groups the transition
wrote to.  The input state is never touched, so a refusal returns it and an
error leaves it as it was.

The working copy a transition used is left with the state it made
(:meth:`Transient.settle`): its copies read exactly that state, so the next
transition on it (the newest of its lineage, which is what an engine
drives) goes on with them instead of copying again (:meth:`Transient.open`).
A transition on any other state starts a fresh working copy.

A linked pool's working copy claims its store when the transient opens
(:mod:`kvfunc.core._lineage`), so that everything the transition reads is
its own; :meth:`freeze` gives every store back, and :meth:`abort` gives them
back with the transition's writes undone.
"""

from __future__ import annotations

from typing import Any

from kvfunc.core._builder import DeltaBuilder
from kvfunc.core._group import GroupCopy
from kvfunc.core._pool_copy import PoolCopy
from kvfunc.core._state import KVState, find_group

__all__ = ["Transient"]

_set = object.__setattr__


class Transient:
    """The working copy of a :class:`KVState` (see the module docstring).

    ``views[i]`` is what group ``i`` reads from and ``pools[j]`` what pool
    ``j`` reads from: the published value until :meth:`copy` / :meth:`pool`
    makes its working copy.  Nothing is copied before the first write, and a
    transition only freezes the groups it wrote to (``touched``), so one that
    changes nothing costs a few attribute reads.
    """

    __slots__ = ("caching", "checked", "copies", "epoch", "group_pool", "max_model_len",
                 "pool_copies", "pools", "seq", "sink", "src", "touched", "views")

    def __init__(self, state: KVState, sink: DeltaBuilder | None = None) -> None:
        self.src = state
        self.max_model_len = state.max_model_len
        self.sink = sink
        self.seq = state.seq
        shape = state._shape
        if shape is None:
            shape = (tuple(g.pool for g in state.groups), state.prefix_caching, set())
            _set(state, "_shape", shape)
        self.group_pool, self.caching, self.checked = shape
        self.views: Any = state.groups
        self.pools: Any = state.pools
        self.copies: list[GroupCopy | None] | None = None
        self.pool_copies: list[PoolCopy | None] | None = None
        self.touched: list[int] = []  # the groups this transition wrote to, in order
        self.epoch = 0  # counts the working copies made (what ``views`` reads from changed)
        if state.pools and state.pools[0].ver is not None:  # claim every store at once
            for j in range(len(state.pools)):
                self.pool(j)

    @classmethod
    def open(cls, state: KVState, sink: DeltaBuilder | None) -> Transient:
        """A working copy of ``state`` for one transition recording into ``sink`` (None: no delta).

        When ``state`` is the one the last transition of its lineage made, that
        transition's working copy goes on: its copies already read exactly
        ``state``, so nothing is copied again.
        """
        cont = state._cont
        if cont:
            try:
                tr: Transient = cont.pop()
            except IndexError:  # another transition took it first
                return cls(state, sink)
            tr.sink = sink  # parked by :meth:`settle`: it reads exactly ``state``
            for p in tr.pool_copies or ():
                if p is not None:
                    p.reopen()
            return tr
        return cls(state, sink)

    def settle(self) -> KVState:
        """:meth:`freeze`, and leave this working copy with the new state for the next one."""
        state = self.freeze()
        cont = state._cont
        if cont is None:
            _set(state, "_cont", [self])
        else:  # two transitions that changed nothing may both park here: either will do
            cont.append(self)
        return state

    def abort(self) -> None:
        """Give every store claimed back with this transition's writes undone (it raised)."""
        for p in self.pool_copies or ():
            if p is not None:
                p.abort()

    def copy(self, i: int) -> GroupCopy:
        """The working copy of group ``i``, to write to (made on first use, with its pool's)."""
        copies = self.copies
        if copies is None:
            copies = self.copies = [None] * len(self.views)
            self.views = list(self.views)
        g = copies[i]
        if g is None:
            g = copies[i] = self.views[i] = GroupCopy(self.views[i], self.pool(self.group_pool[i]),
                                                      self.sink)
            g.pool.sink = self.sink  # a pool another group copied earlier records here too
            self.epoch += 1
            self.touched.append(i)
        elif i not in self.touched:  # first write of this transition: record into its delta
            g.sink = g.pool.sink = self.sink
            self.touched.append(i)
        return g

    def pool(self, j: int) -> PoolCopy:
        """The working copy of pool ``j`` (made on first use; written through a group's)."""
        copies = self.pool_copies
        if copies is None:
            copies = self.pool_copies = [None] * len(self.pools)
            self.pools = list(self.pools)
        p = copies[j]
        if p is None:
            p = copies[j] = self.pools[j] = PoolCopy(self.pools[j], self.sink)
        return p

    def free_count(self, j: int) -> int:
        """Free blocks of pool ``j`` now."""
        pool = self.pools[j]
        count: int = pool.queue.count
        return count

    def all_copies(self) -> list[GroupCopy]:
        """Every group's working copy."""
        return [self.copy(i) for i in range(len(self.views))]

    def index(self, key: str) -> int:
        """The position of ``key``'s group."""
        return list(self.views).index(find_group(self.views, key))

    def group(self, key: str) -> GroupCopy:
        """The working copy of ``key``'s group."""
        return self.copy(self.index(key))

    def freeze(self) -> KVState:
        """The current state as a value (the input state when nothing changed); every
        store claimed is given back."""
        touched = self.touched
        src = self.src
        copies, pool_copies, group_pool = self.copies, self.pool_copies, self.group_pool
        if not touched and (pool_copies is None or all(
                p is None or p.freeze() is src.pools[j] for j, p in enumerate(pool_copies))):
            return src  # every store given back, nothing changed
        self.touched = []
        groups = list(src.groups)
        pools = list(src.pools)
        changed = False
        for i in touched:
            g = groups[i] = copies[i].freeze(group_pool[i])  # type: ignore[index,union-attr]
            changed = changed or g is not src.groups[i]
        for j, p in enumerate(pool_copies or ()):  # every pool, written to or not
            if p is not None:
                pools[j] = p.freeze()
                changed = changed or pools[j] is not src.pools[j]
        if not changed:
            return src
        state = object.__new__(KVState)
        _set(state, "max_model_len", self.max_model_len)
        _set(state, "pools", tuple(pools))
        _set(state, "groups", tuple(groups))
        _set(state, "seq", self.seq)
        _set(state, "_shape", src._shape)
        _set(state, "_cont", None)
        self.src = state
        return state
