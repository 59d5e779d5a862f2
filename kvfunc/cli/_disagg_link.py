"""The KV hand-over of a disaggregated run: DataDist's registries on both sides, and the links.

Theory of operation
-------------------
Every request's KV moves from its prefill instance to a decode instance the
way LLM-DataDist's guide moves an ordinary cache, on the pure registry
(:mod:`kvfunc.datadist`): one :class:`~kvfunc.datadist.RegistryState` per
instance, PROMPT on the prefill side and DECODER on the decode side.

=================  ======================================================  ==============
when               what                                                    who holds P's
=================  ======================================================  ==============
prefill done       P ``allocate_cache(desc, [CacheKey(p, rid)])``, then     id + key, then
                   ``deallocate_cache``: the engine lets go, the key keeps  the key alone
                   the KV for the pull
decode room found  D ``allocate_cache(desc)``: the pull's destination       the key
transfer starts    ``find_key`` on P; both caches pinned                    key + pin
transfer ends      the pull succeeds: P ``remove_cache_key``, both unpin:   nothing:
                   P's cache is released, and its blocks are freed          released
request finishes   D ``deallocate_cache``                                   (D's released)
=================  ======================================================  ==============

``desc`` is one tensor of the request's KV bytes (:func:`kv_desc`).  A
registry's pool is an address space that no run fills: room is decided by
each instance's block allocator, which holds the KV; the registry counts the
references and the bytes held for pulls.

The link: every instance has one network interface of ``bandwidth`` bytes
per second, full duplex.  A transfer from prefill ``p`` to decode ``d``
needs ``p``'s sending side and ``d``'s receiving side; it starts when both
are free (transfers keep the order in which they found decode room) and
takes ``bytes / bandwidth`` seconds.
"""

from __future__ import annotations

from typing import NamedTuple

import attrs

from kvfunc.cli._units import MAX_BYTES
from kvfunc.datadist import (
    CacheDesc,
    CacheKey,
    DataType,
    LLMRole,
    Placement,
    RegistryState,
    allocate_cache,
    check_registry,
    deallocate_cache,
    find_key,
    pin_cache,
    remove_cache_key,
    unpin_cache,
)

__all__ = ["Flight", "TransferLedger", "kv_desc"]


def kv_desc(nbytes: int) -> CacheDesc:
    """The cache a request's KV is registered as: one tensor of its bytes.

    >>> kv_desc(4096).nbytes
    4096
    """
    return CacheDesc(1, (1, nbytes), DataType.DT_UINT8)


class Flight(NamedTuple):
    """One request's transfer: where from and to, its bytes, its caches and its times."""

    prefill: int
    decode: int
    nbytes: int
    prompt_cache: int
    decode_cache: int
    ready_s: float
    accept_s: float
    start_s: float
    end_s: float


@attrs.define
class _Pending:
    prefill: int
    nbytes: int
    cache_id: int
    ready_s: float


class TransferLedger:
    """Registries and link times of every transfer (see the module docstring).

    >>> ledger = TransferLedger(1, 1, 1e9)
    >>> ledger.offer(7, 0, 2_000_000, 1.0)
    >>> f = ledger.accept(7, 0, 1.5); (f.start_s, f.end_s)
    (1.5, 1.502)
    >>> ledger.start(7); ledger.finish(7), ledger.held_bytes(0)
    (True, 0)
    >>> ledger.leave_decode(7); ledger.check(set(), set())
    """

    def __init__(self, num_prefill: int, num_decode: int, bandwidth: float) -> None:
        space = {Placement.DEVICE: (MAX_BYTES, 1)}
        self.bandwidth = bandwidth
        self.prompt = [RegistryState.create(LLMRole.PROMPT, p, space)
                       for p in range(num_prefill)]
        self.decoder = [RegistryState.create(LLMRole.DECODER, num_prefill + d, space)
                        for d in range(num_decode)]
        self._send_free = [0.0] * num_prefill
        self._recv_free = [0.0] * num_decode
        #: Seconds each prefill (sending) and decode (receiving) side was busy.
        self.send_busy = [0.0] * num_prefill
        self.recv_busy = [0.0] * num_decode
        self._pending: dict[int, _Pending] = {}
        self.flights: dict[int, Flight] = {}
        #: Transfers done, bytes moved, and the most bytes any prefill side held for pulls.
        self.done = self.bytes_moved = self.peak_held_bytes = 0
        self.peak_keys = 0

    def held_bytes(self, prefill: int) -> int:
        """Bytes prefill instance ``prefill`` holds for pulls not yet done."""
        return self.prompt[prefill].used_bytes()

    def offer(self, rid: int, prefill: int, nbytes: int, now: float) -> None:
        """The prefill is done: register its KV under the request's key, then let go of the id."""
        key = CacheKey(prefill, req_id=rid)
        alloc = allocate_cache(self.prompt[prefill], kv_desc(nbytes), [key])
        assert alloc.ok and alloc.record is not None, alloc.reason
        state, released = deallocate_cache(alloc.state, alloc.record.cache_id)
        assert not released, "the key holds the cache until the pull"
        self.prompt[prefill] = state
        self._pending[rid] = _Pending(prefill, nbytes, alloc.record.cache_id, now)
        self.peak_held_bytes = max(self.peak_held_bytes, state.used_bytes())
        self.peak_keys = max(self.peak_keys, len(state.bindings))

    def accept(self, rid: int, decode: int, now: float) -> Flight:
        """Decode instance ``decode`` has room: its destination cache, and the link's slot."""
        pending = self._pending.pop(rid)
        alloc = allocate_cache(self.decoder[decode], kv_desc(pending.nbytes))
        assert alloc.ok and alloc.record is not None, alloc.reason
        self.decoder[decode] = alloc.state
        p = pending.prefill
        start = max(now, self._send_free[p], self._recv_free[decode])
        took = pending.nbytes / self.bandwidth
        self._send_free[p] = self._recv_free[decode] = start + took
        self.send_busy[p] += took
        self.recv_busy[decode] += took
        flight = Flight(p, decode, pending.nbytes, pending.cache_id, alloc.record.cache_id,
                        pending.ready_s, now, start, start + took)
        self.flights[rid] = flight
        return flight

    def start(self, rid: int) -> None:
        """The pull starts: it finds the key on the prefill side; both caches are pinned."""
        f = self.flights[rid]
        record, _ = find_key(self.prompt[f.prefill], CacheKey(f.prefill, req_id=rid))
        self.prompt[f.prefill] = pin_cache(self.prompt[f.prefill], record.cache_id)
        self.decoder[f.decode] = pin_cache(self.decoder[f.decode], f.decode_cache)

    def finish(self, rid: int) -> bool:
        """The pull succeeds; True when the prefill side's cache is released (its blocks go)."""
        f = self.flights[rid]
        prompt, _ = remove_cache_key(self.prompt[f.prefill], CacheKey(f.prefill, req_id=rid))
        self.prompt[f.prefill], released = unpin_cache(prompt, f.prompt_cache)
        self.decoder[f.decode], _ = unpin_cache(self.decoder[f.decode], f.decode_cache)
        self.done += 1
        self.bytes_moved += f.nbytes
        return released == (f.prompt_cache,)

    def leave_decode(self, rid: int) -> None:
        """The request finished on its decode instance: its cache there is released."""
        f = self.flights.pop(rid)
        self.decoder[f.decode], released = deallocate_cache(self.decoder[f.decode],
                                                            f.decode_cache)
        assert released == (f.decode_cache,), released

    def check(self, awaiting_pull: set[int], on_decode: set[int]) -> None:
        """Assert the registries hold exactly these requests: keys for the pulls to come,
        caches for the requests on the decode side (or on their way there)."""
        keys = {key.req_id for s in self.prompt for key in s.bindings
                if isinstance(key, CacheKey)}
        assert keys == awaiting_pull, (keys ^ awaiting_pull)
        held = sum(len(s.caches) for s in self.decoder)
        assert held == len(self.flights) and set(self.flights) == on_decode, (held, on_decode)
        for state in (*self.prompt, *self.decoder):
            check_registry(state)
