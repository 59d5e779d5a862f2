"""A deliberately simple, mutable model of the tiers below the device.

Theory of operation
-------------------
:class:`NaiveTiers` restates the tiers' rules (see :mod:`kvfunc.core._tiers`)
with plain ``dict`` and ``list`` values: a host tier is a dict from hash to
``[block, priority, last_use, pins]`` and a stack of free blocks, the
remote tier a dict from hash to ``[priority, last_use, pins]``, moves a dict
from id to a plain record.  The eviction victim is found by scanning every
entry for the smallest ``(priority, last_use)`` among the unpinned ones.

The device is not modelled here (the allocator's own model covers it): the
model reads what the device did from its deltas (the ``Stored`` and
``Evicted`` operations) and its tables, as the tiers do.  With several
device groups (``keys``), a tier keeps each group's block of a hash apart:
under the hash followed by the group's position in ``keys``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvfunc import BlocksChanged, Evicted, Stored

__all__ = ["NaiveTiers"]


class _Index:
    """hash -> [slot, priority, last_use, pins]; a clock ticks when an entry is (re)used."""

    def __init__(self) -> None:
        self.entries: dict[bytes, list[int]] = {}
        self.clock = 0

    def add(self, digest: bytes, slot: int, priority: int) -> None:
        self.entries[digest] = [slot, priority, self.clock, 0]
        self.clock += 1

    def unpin(self, digest: bytes) -> None:
        e = self.entries[digest]
        e[3] -= 1
        if not e[3]:
            e[2] = self.clock
            self.clock += 1

    def victim(self) -> bytes | None:
        unpinned = [(e[1], e[2], d) for d, e in self.entries.items() if not e[3]]
        return min(unpinned)[2] if unpinned else None


class NaiveTiers:
    """The host and remote tiers as plain mutable values (see the module docstring).

    >>> m = NaiveTiers(host_blocks=2, remote=False, remote_blocks=None,
    ...                write_policy="write-back", keys=("f",))
    >>> m.store_host(b"a", 5, 0); m.store_host(b"b", 6, 0); sorted(m.moves)
    [0, 1]
    >>> m.settle([0, 1], []); m.store_host(b"c", 7, 0); m.host_view()
    {b'b': (1, 0)}
    """

    def __init__(self, *, host_blocks: int, remote: bool, remote_blocks: int | None,
                 write_policy: str, keys: Sequence[str]) -> None:
        self.write_back = write_policy == "write-back"
        self.keys = tuple(keys)
        self.host = _Index() if host_blocks else None
        self.free = list(range(host_blocks - 1, -1, -1))  # a stack: the last item goes first
        self.host_writes: dict[bytes, int] = {}
        self.remote = _Index() if remote else None
        self.remote_blocks = remote_blocks
        self.remote_writes: dict[bytes, int] = {}
        self.moves: dict[int, dict[str, Any]] = {}
        self.next_id = 0
        self.priorities: dict[Any, int] = {}
        self.block_priority: dict[int, int] = {}
        self.loading: dict[int, int] = {}  # device block -> load id

    # -- queries -------------------------------------------------------------------------
    def key_of(self, group: str, digest: bytes) -> bytes:
        """The tier key of group ``group``'s block of hash ``digest``."""
        return digest if len(self.keys) == 1 else digest + bytes([self.keys.index(group)])

    def first_loading(self, tables: Mapping[str, Sequence[int]]) -> int | None:
        """The first table position, in any group, of a device block a load is writing."""
        return min((p for t in tables.values() for p, b in enumerate(t) if b in self.loading),
                   default=None)

    def lookup(self, n: int, digests: Sequence[bytes], limit: int
               ) -> tuple[list[str], list[int], list[bytes]]:
        """(sources, host blocks, tier keys) of the lower blocks after ``n`` device blocks."""
        sources: list[str] = []
        blocks: list[int] = []
        keys: list[bytes] = []
        for j in range(n, limit):
            row = []
            for g in self.keys:
                k = self.key_of(g, digests[j])
                if self.host is not None and k in self.host.entries:
                    row.append(("host", self.host.entries[k][0], k))
                elif self.remote is not None and k in self.remote.entries:
                    row.append(("remote", -1, k))
            if len(row) < len(self.keys):
                break
            for src, block, k in row:
                sources.append(src)
                blocks.append(block)
                keys.append(k)
        return sources, blocks, keys

    def host_view(self) -> dict[bytes, tuple[int, int]]:
        """hash -> (host block, priority) of every host block that is a hit."""
        return {} if self.host is None else {d: (e[0], e[1]) for d, e in self.host.entries.items()}

    def remote_view(self) -> dict[bytes, int]:
        """hash -> priority of every hash the remote directory holds."""
        return {} if self.remote is None else {d: e[1] for d, e in self.remote.entries.items()}

    def moves_view(self) -> dict[int, tuple[str, bytes, int, int]]:
        """move id -> (direction, hash, src, dst) of every pending move."""
        return {i: (m["direction"], m["digest"], m["src"], m["dst"])
                for i, m in self.moves.items()}

    # -- what happens ----------------------------------------------------------------------
    def _start(self, direction: str, digest: bytes, src: int, dst: int, rid: Any,
               priority: int) -> None:
        i = self.next_id
        self.next_id += 1
        pinned = True
        if direction == "device->host":
            assert self.free.pop() == dst
            self.host_writes[digest] = dst
        elif direction == "host->remote":
            self.remote_writes[digest] = i
            pinned = (self.host is not None and digest in self.host.entries
                      and self.host.entries[digest][0] == src)
            if pinned:
                self.host.entries[digest][3] += 1  # type: ignore[union-attr]
        else:
            tier = self.host if direction == "host->device" else self.remote
            tier.entries[digest][3] += 1  # type: ignore[union-attr]
            self.loading[dst] = i
        self.moves[i] = {"direction": direction, "digest": digest, "src": src, "dst": dst,
                         "rid": rid, "priority": priority, "pinned": pinned}

    def store_host(self, digest: bytes, src: int, priority: int) -> None:
        """Store device block ``src`` down, evicting the host's victim if it is full."""
        host = self.host
        if host is None or digest in self.host_writes or digest in host.entries:
            return
        if not self.free:
            victim = host.victim()
            if victim is None:
                return
            block, p = host.entries.pop(victim)[:2]
            self.free.append(block)
            if self.write_back:
                self.store_remote(victim, block, p)
        self._start("device->host", digest, src, self.free[-1], None, priority)

    def store_remote(self, digest: bytes, src: int, priority: int) -> None:
        """Store host block ``src`` remotely, dropping the directory's victim if it is full."""
        remote = self.remote
        if remote is None or digest in self.remote_writes or digest in remote.entries:
            return
        if (self.remote_blocks is not None
                and len(remote.entries) + len(self.remote_writes) >= self.remote_blocks):
            victim = remote.victim()
            if victim is None:
                return
            del remote.entries[victim]
        self._start("host->remote", digest, src, -1, None, priority)

    def device_did(self, delta: BlocksChanged) -> None:
        """Follow one device delta: priorities of cached blocks, then the write policy."""
        evicted_priority: dict[int, int] = {}
        for op in delta.operations():
            if type(op) is Stored:
                p = self.priorities.get(op.request_id, 0)
                if p:
                    self.block_priority[op.block_id] = p
                else:
                    self.block_priority.pop(op.block_id, None)
            elif type(op) is Evicted:
                evicted_priority[op.block_id] = self.block_priority.pop(op.block_id, 0)
        self._pending_follow = (delta, evicted_priority)

    def follow(self) -> None:
        """Start the stores the write policy asks for after :meth:`device_did`."""
        delta, evicted_priority = self._pending_follow
        if self.host is None:
            return
        stored_here: set[int] = set()
        for op in delta.operations():
            if type(op) is Stored:
                stored_here.add(op.block_id)
                if not self.write_back and op.block_id not in self.loading:
                    self.store_host(self.key_of(op.key, op.block_hash), op.block_id,
                                    self.priorities.get(op.request_id, 0))
            elif type(op) is Evicted and self.write_back and op.block_id not in stored_here:
                self.store_host(self.key_of(op.key, op.block_hash), op.block_id,
                                evicted_priority[op.block_id])

    def admitted(self, rid: Any, tables: Mapping[str, Sequence[int]], first: int,
                 sources: Sequence[str], host_blocks: Sequence[int], keys: Sequence[bytes]
                 ) -> None:
        """Loads for an admitted hit: each group's lower blocks into the device blocks after
        ``first``, position after position."""
        p = self.priorities.get(rid, 0)
        lower = iter(zip(sources, host_blocks, keys, strict=True))
        for j in range(len(keys) // len(self.keys)):
            for g in self.keys:
                src, block, k = next(lower)
                direction = "host->device" if src == "host" else "remote->device"
                self._start(direction, k, block, tables[g][first + j], rid, p)

    def hold(self, sources: Sequence[str], keys: Sequence[bytes], by: int) -> None:
        """Pin (``by`` 1) or unpin (-1) a hit's lower entries while the stores of evicted
        blocks start before its loads (the loads' own pins outlast these)."""
        for src, k in zip(sources, keys, strict=True):
            tier = self.host if src == "host" else self.remote
            tier.entries[k][3] += by  # type: ignore[union-attr]

    def settle(self, done: Sequence[int], failed: Sequence[int]) -> None:
        """Report moves done, then moves failed."""
        for i in done:
            m = self.moves.pop(i)
            d = m["digest"]
            if m["direction"] == "device->host":
                assert self.host is not None
                del self.host_writes[d]
                self.host.add(d, m["dst"], m["priority"])
                if not self.write_back:
                    self.store_remote(d, m["dst"], m["priority"])
            else:
                self._unpin_source(m)
                if m["direction"] == "host->remote":
                    assert self.remote is not None
                    del self.remote_writes[d]
                    self.remote.add(d, -1, m["priority"])
        for i in failed:
            m = self.moves.pop(i)
            d = m["digest"]
            if m["direction"] == "device->host":
                del self.host_writes[d]
                self.free.append(m["dst"])
            else:
                self._unpin_source(m)
                if m["direction"] == "host->remote":
                    del self.remote_writes[d]
                elif m["direction"] == "remote->device":
                    assert self.remote is not None
                    if not self.remote.entries[d][3]:
                        del self.remote.entries[d]

    def _unpin_source(self, m: Mapping[str, Any]) -> None:
        d = m["digest"]
        if m["direction"] in ("host->device", "remote->device"):
            del self.loading[m["dst"]]
            (self.host if m["direction"] == "host->device" else self.remote).unpin(d)  # type: ignore[union-attr]
        elif m["pinned"]:
            self.host.unpin(d)  # type: ignore[union-attr]
