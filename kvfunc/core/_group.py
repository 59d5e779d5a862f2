"""A group: one attention type's block tables and policy, drawing blocks from one pool.

Theory of operation
-------------------
A :class:`GroupState` is a value: its manager key, its policy, the index of the pool it
draws from, and its rows (``immutables.Map``, request id -> :class:`~kvfunc.core._rows.Row`).
It holds no block ids of its own: every block comes from and goes back to its pool (``_pool``).

:class:`GroupCopy` is the working copy one transition edits.  It offers the
*primitives* of every transition -- register, release, recycle, grow, share,
copy-on-write, store -- and each one records its delta rows in the order it
acts, asking the pool for blocks as it goes (group -> pool -> delta), so a
delta is the transition's exact log and replay runs the same primitives.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import repeat
from typing import Any, NamedTuple

import immutables

from kvfunc.core._builder import DeltaBuilder, record_stored, stored_row
from kvfunc.core._delta import COPY_SAVED
from kvfunc.core._policy import KEEPS_ALL, Policy, row_limits, skip_mode
from kvfunc.core._pool import cache_key
from kvfunc.core._pool_copy import PoolCopy
from kvfunc.core._rows import (
    Row,
    TablesView,
    append_ids,
    grown,
    leading_nulls,
    make_row,
    remade,
    replaced,
    row_table,
)

__all__ = ["GroupCopy", "GroupState"]

_new = tuple.__new__


class GroupState(NamedTuple):
    """One manager key's block tables and policy (see the module docstring): an immutable record.

    Make one with :meth:`of`; ``traits`` is derived from the policy.
    """

    key: str
    policy: Policy
    pool: int
    rows: immutables.Map[Any, Row]
    #: ``(block_size, grows_with_tokens, skip mode, window)``, read once per step
    traits: tuple[int, bool, int, int | None]

    @classmethod
    def of(cls, key: str, policy: Policy, pool: int, rows: immutables.Map[Any, Row]
           ) -> GroupState:
        """A group with its traits derived from ``policy``."""
        traits = (policy.block_size, policy.grows_with_tokens, skip_mode(policy), policy.window)
        return cls(key, policy, pool, rows, traits)

    @property
    def num_rows(self) -> int:
        """Registered requests."""
        return len(self.rows)

    def row(self, request_id: object) -> Row | None:
        """The request's row, or None when it is not registered here."""
        try:
            return self.rows.get(request_id)
        except TypeError:  # unhashable: never a request id
            return None

    def table(self, request_id: object) -> tuple[int, ...]:
        """The request's block ids in logical order (null entries are 0; ``()`` when unknown)."""
        row = self.row(request_id)
        return () if row is None else row_table(row)

    @property
    def tables(self) -> Mapping[Any, tuple[int, ...]]:
        """Every registered request's table in registration order (a mapping built on access)."""
        return TablesView(self.rows)

    def num_held(self) -> int:
        """Distinct non-null blocks held by this group's tables."""
        return len({b for row in self.rows.values() for b in row.blocks})

    def identity(self) -> tuple[Any, ...]:
        """What equality compares: key, policy, pool and every table (the counters are hints)."""
        rows = {rid: (row.blocks, row.nulls) for rid, row in self.rows.items()}
        return (self.key, self.policy, self.pool, rows)

    def __repr__(self) -> str:
        return (f"GroupState(key={self.key!r}, policy={self.policy!r}, pool={self.pool}, "
                f"tables={dict(self.tables)!r})")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, GroupState):
            return NotImplemented
        return self is other or self.identity() == other.identity()

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        raise TypeError("unhashable type: 'GroupState'")


class GroupCopy:
    """The working copy of one group (see the module docstring)."""

    __slots__ = ("block_size", "caching", "changed", "grows", "key", "member", "mode", "policy",
                 "pool", "rows", "sink", "src", "tag", "traits", "window")

    def __init__(self, group: GroupState, pool: PoolCopy, sink: DeltaBuilder | None) -> None:
        policy = group.policy
        self.src = group
        self.key = group.key
        self.policy = policy
        self.traits = group.traits
        self.block_size, self.grows, self.mode, self.window = group.traits
        self.pool = pool
        self.caching = pool.caching
        self.member = pool.members.index(group.key) if pool.tagged else 0
        self.tag = pool.tag_of(group.key)
        self.rows: Any = group.rows.mutate()
        self.sink = sink
        self.changed = False

    # -- rows ---------------------------------------------------------------------------
    def row(self, request_id: Any) -> Row | None:
        """The request's row (None: not registered here)."""
        found: Row | None = self.rows.get(request_id)
        return found

    def items(self) -> list[tuple[Any, Row]]:
        """Every ``(request id, row)`` now, in registration order (O(rows); not the hot path)."""
        rows = self.rows.finish()
        self.rows = rows.mutate()
        return sorted(rows.items(), key=lambda kv: kv[1].seq)

    def put(self, request_id: Any, row: Row) -> None:
        """Bind the request's row, with its quiet limits (``_policy.row_limits``)."""
        ids, nulls, stored, shared, seq = row[:5]
        length = row[9]
        room, slide, fill, cow_from = row_limits(self.policy, self.traits, self.caching, length,
                                                 nulls, stored, shared)
        self.rows[request_id] = _new(Row, (ids, nulls, stored, shared, seq, room, slide, fill,
                                           cow_from, length))
        self.changed = True

    def register(self, request_id: Any, seq: int) -> Row:
        """An empty row for a new request (the caller puts it); records R."""
        sink = self.sink
        if sink is not None:
            sink.rows.append((self.key, request_id))
            sink.codes.append("R")
        return make_row((), 0, 0, 0, seq)

    def release(self, request_id: Any, priority: int = 0) -> None:
        """Drop the request's row and release its blocks; records L, then the pool's Y, F rows.

        Without reference counts the blocks go back in logical order (the
        seed's); with them, last block first, so a prefix's tail is evicted
        before its head (vLLM's).
        """
        row: Row = self.rows.pop(request_id)
        self.changed = True
        sink = self.sink
        if sink is not None:
            sink.rows.append((self.key, request_id))
            sink.codes.append("L")
        self.pool.release(self.release_order(row), self.key, priority)

    def detach(self, request_id: Any) -> tuple[int, ...]:
        """Drop the request's row, its blocks kept by a holder outside the tables (records D).

        Returns the blocks in logical order (null entries left out); the
        caller lets them go later (:meth:`PoolCopy.drop`), as vLLM's deferred
        frees do.
        """
        row: Row = self.rows.pop(request_id)
        self.changed = True
        sink = self.sink
        if sink is not None:
            sink.rows.append((self.key, request_id))
            sink.codes.append("D")
        self.pool.detach(row.blocks)
        return row.blocks

    def unstore(self, block: int) -> None:
        """Lower the ``stored`` hint of every row holding ``block`` (its hash was evicted)."""
        for rid, row in self.items():
            if block in row.blocks:
                pos = row.nulls + row.blocks.index(block)
                if row.stored > pos:
                    self.put(rid, remade(row, row.nulls, pos, row.shared))

    def release_order(self, row: Row) -> Sequence[int]:
        """A released row's blocks in the order they are released (see :meth:`release`)."""
        return row.blocks[::-1] if self.pool.linked else row.blocks

    def recycle(self, request_id: Any, row: Row, upto: int) -> Row:
        """Null positions ``row.nulls .. upto - 1``; release their blocks highest index first."""
        lo = row.nulls
        sink = self.sink
        if sink is not None:
            sink.run("N", (self.key, request_id), range(lo, upto))
        new = remade(row, upto, row.stored, row.shared)
        self.pool.release(row.ids[lo:upto][::-1], self.key)
        return new

    def grow(self, request_id: Any, row: Row, need: int, nulls: int = 0) -> Row:
        """Append ``nulls`` null entries, then ``need`` blocks taken from the pool; records A."""
        ids = self.pool.take(need) if need else []
        entries = [0] * nulls + ids if nulls else ids
        sink = self.sink
        if sink is not None:
            if len(entries) == 1:  # the common decode step
                sink.rows.append((self.key, request_id, entries[0]))
                sink.codes.append("A")
            else:
                sink.run("A", (self.key, request_id), entries)
        if nulls and row.length > row.nulls:
            raise AssertionError("null entries only ever form a prefix of a table")
        return grown(row, entries, row.nulls + nulls, row.stored, row.shared)

    def extend(self, request_id: Any, row: Row, need: int) -> None:
        """:meth:`grow` by ``need > 0`` blocks, then :meth:`put`: the common decode step.

        The row is built once, with its quiet limits, instead of a
        provisional row that ``put`` takes apart again.
        """
        self.append(request_id, row, self.pool.take(need))

    def append(self, request_id: Any, row: Row, ids: list[int]) -> None:
        """:meth:`extend` by blocks ``ids`` the caller just took from the pool (records A)."""
        sink = self.sink
        if sink is not None:
            if len(ids) == 1:
                sink.rows.append((self.key, request_id, ids[0]))
                sink.codes.append("A")
            else:
                sink.run("A", (self.key, request_id), ids)
        held, nulls, stored, shared, seq = row[:5]
        length = row[9]
        held = append_ids(held, length, ids)
        length += len(ids)
        room, slide, fill, cow_from = row_limits(self.policy, self.traits, self.caching, length,
                                                 nulls, stored, shared)
        self.rows[request_id] = _new(Row, (held, nulls, stored, shared, seq, room, slide, fill,
                                           cow_from, length))
        self.changed = True

    def share(self, request_id: Any, row: Row, entries: Sequence[int]) -> Row:
        """Append ``entries`` by reference (0: a null entry, only as a prefix); records S / A.

        A free cached block leaves the pool's queue.  ``stored`` advances over
        the cached entries that follow the row's cached prefix, and
        ``shared`` covers every entry.
        """
        pool, sink, n = self.pool, self.sink, row.length
        lead = leading_nulls(entries) if n == row.nulls else 0
        stored = max(row.stored, row.nulls + lead)
        pool.share(entries)
        if self.caching and n <= stored < n + len(entries):  # over the entries cached already
            keys = list(map(pool.hash_of.__getitem__, entries[stored - n:]))
            stored += keys.index(None) if None in keys else len(keys)
        if sink is not None:
            key = self.key
            sink.rows.extend(zip(repeat(key), repeat(request_id), entries))
            sink.codes.append("".join(["S" if b else "A" for b in entries]) if 0 in entries
                              else "S" * len(entries))
        return grown(row, list(entries), row.nulls + lead, stored, n + len(entries))

    def copy_on_write(self, request_id: Any, row: Row, position: int) -> Row:
        """Give the request its own copy of the shared block at ``position``; records C."""
        src = row.ids[position]
        (dst,) = self.pool.take(1)
        sink = self.sink
        if sink is not None:
            sink.rows.append((self.key, request_id, position, src, dst))
            sink.codes.append("C")
        self.pool.release((src,), self.key)
        return replaced(row, position, dst, min(row.stored, position))  # the copy: not cached

    # -- the hash store -------------------------------------------------------------------
    def lookup(self, digest: bytes) -> int | None:
        """The first block cached under ``digest`` for this group, or None."""
        return self.pool.find(cache_key(digest, self.tag))

    def store(self, request_id: Any, row: Row, upto: int, hashes: Any) -> Row:
        """Cache the row's full blocks from ``max(stored, nulls)`` to ``upto - 1``; records T.

        ``hashes`` covers them (the caller checked); a block already cached
        (one this request shares) is passed over.
        """
        p = row[2] if row[2] > row[1] else row[1]  # past the stored blocks and the nulls
        pool, m, tag, sink = self.pool, self.block_size // hashes.block_size, self.tag, self.sink
        digests, hash_of = hashes._digests, pool.hash_of
        if upto == p + 1:  # one block completes: the common decode step
            b = row[0][p]
            if hash_of[b] is None:
                h = digests[p] if m == 1 else digests[upto * m - 1]
                pool.store_run((b,), (h if tag is None else h + tag,))
                if sink is not None:
                    sink.rows.append(stored_row(self.key, request_id, p, b, h, hashes, m))
                    sink.codes.append("T")
        else:
            positions = range(p, upto)
            run = tuple(row.ids[p:upto])
            hs = digests[p:upto] if m == 1 else digests[(p + 1) * m - 1:upto * m:m]
            if any(map(hash_of.__getitem__, run)):  # shared blocks, cached already (a key is
                keep = [i for i, b in enumerate(run) if hash_of[b] is None]  # never empty)
                positions = [positions[i] for i in keep]  # type: ignore[assignment]
                run, hs = tuple([run[i] for i in keep]), [hs[i] for i in keep]
            pool.store_run(run, hs if tag is None else list(map(bytes.__add__, hs, repeat(tag))))
            if sink is not None and run:
                record_stored(sink, self.key, request_id, positions, run, hs, hashes, m)
        return remade(row, row[1], upto, row[3] if row[3] > upto else upto)

    def save_state(self, request_id: Any, row: Row, index: int, hashes: Any) -> None:
        """Copy the request's state into a free block cached under hash ``index`` (once)."""
        h = hashes._digests[index]
        if self.lookup(h) is not None:
            return
        pool = self.pool
        (dst,) = pool.take(1)
        sink = self.sink
        if sink is not None:
            sink.rows.append((self.key, request_id, COPY_SAVED, row.ids[row.nulls], dst))
            sink.codes.append("C")
        pool.store_run((dst,), (cache_key(h, self.tag),))
        if sink is not None:
            sink.rows.append((self.key, request_id, COPY_SAVED, dst, h,
                                hashes.parent_hash(index), ()))
            sink.codes.append("T")
        pool.release((dst,), self.key)

    def unstore_all(self) -> None:
        """Reset every row's ``stored`` counter (after the pool forgot what it cached)."""
        for rid, row in self.items():
            if row.stored:
                self.put(rid, remade(row, row.nulls, 0, row.shared))

    # -- freezing -------------------------------------------------------------------------
    def freeze(self, pool: int) -> GroupState:
        """The group as a value; the working copy goes on from it."""
        if not self.changed:
            return self.src
        rows = self.rows.finish()
        new = self.src = _new(GroupState, (self.key, self.policy, pool, rows, self.traits))
        self.rows = rows.mutate()
        self.changed = False
        return new

    @property
    def keeps_every_token(self) -> bool:
        """True when the policy never skips a token (no null entries, nothing slides out)."""
        return self.mode == KEEPS_ALL
