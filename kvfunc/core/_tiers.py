"""Tiers behind the device pool: a host tier and a remote tier, as pure transitions.

Theory of operation
-------------------
A :class:`~kvfunc.core._tier_state.TieredState` wraps a device
:class:`~kvfunc.KVState` (prefix caching, one pool: one full-attention group,
or full-attention and sliding-window groups sharing a pool, of one block
size) and adds up to two lower tiers, keyed by the same block hashes as the
device's cache (with several groups, each hash followed by its group's
byte, as the shared pool keys its own index: the groups' blocks of one hash
hold different layers)::

    device  KVState: its pool, hash index and eviction order (untouched here)
      |  ^
      v  |  device->host stores, host->device loads
    host    HostTier: host blocks 0..n-1, hash -> block, free blocks,
      |  ^        eviction: lowest retention priority, then least recent
      v  |  host->remote stores, remote->device loads
    remote  RemoteTier: hashes believed stored remotely (a hint), LRU by priority

The device goes through its own public transitions (``allocate_batch``,
``free_request``, ``evict_blocks``); the tiers read what it did from its
delta: the blocks it cached (``Stored`` rows) and evicted (``Evicted``
rows).  A state with neither tier runs the device exactly as before.

**Lookup** (:func:`~kvfunc.core._tier_lookup.lookup_tiers`): the device's own hit first, cut before
the first block a load is still writing; then position by position, each
group's block from the host tier if it holds it, else the remote tier,
until a position where some group's block is in neither.

**Windows.** Past the device hit, a sliding window's blocks are loaded at
every position, also those that slide out of the window at once (the
request's next step nulls them without caching them; vLLM leaves them null
from the start).  That keeps a hit one block per group and position, at the
price of those loads: the lower part of a hit needs every group's block at
each position, and ends where a window's block is missing below the device,
even on a position the window would not read.  With ``"write-back"`` that
happens when a window's block is still cached on the device while the
full-attention block of the same position went down; ``"write-through"``
keeps both below.

**Admission** (:func:`allocate_tiered`): an entry whose hit is a
:class:`~kvfunc.TieredHit` asks the device for its device hit plus new blocks for the
rest of the hit and its chunk; the lower-tier blocks count as computed once
loaded.  The device caches none of those new blocks at admission (the
admission's hashes stop at the device hit, as vLLM delays caching while a
connector loads): a request with loads in flight cannot compute, so until
it runs again, its new blocks hold no KV, and a failed load leaves its later
blocks unfilled.  Its next step, with its whole hashes, caches them as
blocks it computes, and with ``"write-through"`` stores them then.  A caller
whose step runs the loads and then the forward pass before any other request
reads them (the simulator, whose copies take no time) passes
``cache_loaded=True`` to cache them at admission; a failed load then makes
the device forget the request's blocks from the failed one on.  Each
lower block becomes a load: ``host->device`` from its host block, or
``remote->device`` (source ``-1``: the shell fetches the block by hash,
staging it through host memory of its own).

**Write policy**, chosen at creation:

* ``"write-back"``: a block the device evicts is stored to the host
  (``device->host``); the shell runs these stores *before* the step's
  forward pass, since the delta hands their blocks out again, and before the
  step's loads, which may write the same blocks: their rows come first (the
  loads' lower sources are pinned meanwhile, so no store evicts them).  A
  block the host evicts is stored to the remote tier (``host->remote``), read
  before the store that reuses its host block.
* ``"write-through"``: a block the device caches is stored to the host at
  once; the shell runs these stores *after* the step's forward pass fills
  them.  Once a host store is done, the block is stored remotely too.

**Two-phase moves**: each move has an id and is pending until
:func:`~kvfunc.core._tier_moves.complete_moves` reports it done or failed.
A pending move's destination is no hit and cannot be evicted: a host block
being written is out of the index, a device block being loaded is held by
its request (which cannot be freed until its loads settle), not cached (see
Admission), and a device hit that holds one anyway (a stale one) is cut or
refused; a move's source is pinned (out of the eviction order).  A failed
store drops the lower copy; a failed load makes the device forget the block
(``evict_blocks``, in case it was cached) and reports where its request must
recompute from.  A
request with loads in flight must not compute: :func:`allocate_tiered`
refuses an entry for it with :class:`~kvfunc.InvalidArgumentError`.

**Retention priority**: ``priorities={request_id: p}`` (``|p| <=
MAX_PRIORITY``, default 0) gives a request's cached blocks priority ``p`` in
every tier, and each tier evicts lower priorities first.  In the host and
remote tiers a block keeps the priority of the request that cached it on
the device (the ``Stored`` row's request); a later hit does not change it.
On the device, :func:`free_tiered` frees a request's blocks at its
priority (``free_request(priority=)``): a cached block waits in the device
pool's free queue at the priority of the request that freed it last.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from kvfunc.core._checks import (
    check_priority,
    check_request_id,
    excerpt,
)
from kvfunc.core._delta import BlocksChanged
from kvfunc.core._errors import InvalidArgumentError, InvalidTypeError
from kvfunc.core._hashing import BlockHashes
from kvfunc.core._ops import Evicted, Stored
from kvfunc.core._state import RequestId
from kvfunc.core._tier_delta import TierDelta
from kvfunc.core._tier_lookup import TieredHit, device_entries
from kvfunc.core._tier_state import (
    HOST_TO_DEVICE,
    REMOTE_TO_DEVICE,
    TieredState,
    check_tiered,
)
from kvfunc.core._tier_work import TierWork
from kvfunc.core._transitions import allocate_batch, free_request, get_block_ids

__all__ = ["TieredResult", "allocate_tiered", "free_tiered"]


class TieredResult(NamedTuple):
    """Outcome of :func:`allocate_tiered`: the state, the delta, the refused requests.

    >>> from kvfunc.core import FullAttention, KVState, TieredState
    >>> dev = KVState.create({"f": FullAttention(num_blocks=2, block_size=4)}, 64,
    ...                      enable_prefix_caching=True)
    >>> allocate_tiered(TieredState.create(dev), [("a", 0, 9)]).refused
    ('a',)
    """

    state: TieredState
    delta: TierDelta
    refused: tuple[RequestId, ...]


def _check_priorities(priorities: Any) -> dict[Any, int]:
    if priorities is None:
        return {}
    if not isinstance(priorities, Mapping):
        raise InvalidTypeError(f"priorities must be a mapping, got {excerpt(priorities)}")
    out = {}
    for rid, p in priorities.items():
        check_request_id(rid)
        out[rid] = check_priority(p)
    return out


def allocate_tiered(state: TieredState, requests: Iterable[Any], *,
                    block_hashes: Mapping[RequestId, BlockHashes] | None = None,
                    lookahead_tokens: int = 0,
                    priorities: Mapping[RequestId, int] | None = None,
                    cache_loaded: bool = False) -> TieredResult:
    """One step, as :func:`~kvfunc.allocate_batch`, with loads for hits below the device.

    An entry is any form ``allocate_batch`` takes; an admission whose hit
    (the eighth field) is a :class:`~kvfunc.TieredHit` loads the hit's lower blocks.
    ``priorities`` gives requests their retention priority.

    An admission that loads caches its new blocks once its request computes
    them (its next step), unless ``cache_loaded``: then at once, as a step
    that runs its loads and then its forward pass before any other request
    can read them would (a simulation whose copies take no time).

    Raises:
        InvalidArgumentError: an entry for a request with loads in flight; a
            stale or foreign hit; anything ``allocate_batch`` refuses to take.
        InvalidTypeError: a bad priority or entry.

    >>> from kvfunc.core import BlockHashes, FullAttention, KVState, TieredState
    >>> dev = KVState.create({"f": FullAttention(num_blocks=4, block_size=4)}, 64,
    ...                      enable_prefix_caching=True)
    >>> t = TieredState.create(dev, host_blocks=8)
    >>> h = BlockHashes.of(range(12), 4)
    >>> t = allocate_tiered(t, [("a", 0, 12)], block_hashes={"a": h}).state
    >>> t, _ = free_tiered(t, "a")
    >>> t = allocate_tiered(t, [("b", 0, 12)]).state      # evicts a's blocks: written back
    >>> [(m.direction, m.src, m.dst) for m in t.moves.values()]
    [('device->host', 3, 0), ('device->host', 2, 1), ('device->host', 1, 2)]
    """
    check_tiered(state)
    prio = _check_priorities(priorities)
    if type(cache_loaded) is not bool:
        raise InvalidTypeError(f"cache_loaded must be a bool, got {excerpt(cache_loaded)}")
    entries, admits = device_entries(state, requests, cache_loaded)
    res = allocate_batch(state.device, entries, block_hashes=block_hashes,
                         lookahead_tokens=lookahead_tokens)
    work = TierWork(state)
    work.device = res.state
    refused = set(res.refused)
    for rid, p in prio.items():
        if rid not in refused and res.state.groups[0].row(rid) is not None:
            work.prioritize(rid, p)
    evicted = work.note_device(res.delta)
    loading = [(rid, hit) for rid, hit in admits.items() if rid not in refused and hit.hashes]
    _start_moves(work, res.delta, evicted, loading)
    return TieredResult(work.freeze(), work.sink.build(res.delta), res.refused)


def _start_moves(work: TierWork, delta: BlocksChanged, evicted: dict[int, int],
                 loading: list[tuple[RequestId, TieredHit]]) -> None:
    """The step's loads and the stores its write policy asks for, in the order a shell runs
    them (module docstring: write-back stores of evicted blocks before the loads)."""
    if work.src.write_policy == "write-back" and loading and delta.evicted_block_ids:
        # The stores of evicted blocks read them before the loads into them write them, so
        # their rows come first; the loads' sources are held meanwhile (no store evicts them).
        held = [(src == "host", d) for _, hit in loading
                for src, d in zip(hit.sources, hit.hashes, strict=True)]
        _hold(work, held, True)
        _follow_device(work, delta, evicted)
        for rid, hit in loading:
            _start_loads(work, rid, hit)
        _hold(work, held, False)
    else:  # write-through: the stores of blocks just cached leave out those being loaded
        for rid, hit in loading:
            _start_loads(work, rid, hit)
        _follow_device(work, delta, evicted)


def _hold(work: TierWork, held: list[tuple[bool, bytes]], on: bool) -> None:
    """Pin (``on``) or unpin the lower entries ``held`` names (host: True), recording nothing:
    the pins of one transition cancel out, and the loads' own pins stay."""
    for host, d in held:
        if host:
            work.h_index = work.h_index.pin(d) if on else work.h_index.unpin(d)
        else:
            work.r_index = work.r_index.pin(d) if on else work.r_index.unpin(d)


def _start_loads(work: TierWork, rid: RequestId, hit: TieredHit) -> None:
    """One load per lower block of an admitted hit, into the device blocks it was given."""
    tables, keys = get_block_ids(work.device, rid), work.src.keys
    first, p = hit.device.num_tokens // work.src.block_size, work.priorities.get(rid, 0)
    for k, (src, block, d) in enumerate(zip(hit.sources, hit.host_block_ids, hit.hashes,
                                            strict=True)):
        position, g = divmod(k, len(keys))
        work.start(HOST_TO_DEVICE if src == "host" else REMOTE_TO_DEVICE, d, block,
                   tables[keys[g]][first + position], rid, p)


def _follow_device(work: TierWork, delta: BlocksChanged, evicted: dict[int, int]) -> None:
    """Start the stores the write policy asks for after the device did ``delta``."""
    if not work.has_host or not (delta.evicted_block_ids or delta.stored_block_ids):
        return
    tier_key = work.tier_key
    if work.src.write_policy == "write-back":
        if not delta.evicted_block_ids:
            return
        stored_here: set[int] = set()
        for op in delta.operations():
            if type(op) is Stored:
                stored_here.add(op.block_id)
            elif type(op) is Evicted and op.block_id not in stored_here:
                work.store_host(tier_key(op.key, op.block_hash), op.block_id,
                                evicted.get(op.block_id, 0))
        return
    for op in delta.operations():
        if type(op) is Stored and op.block_id not in work.device_pending:
            work.store_host(tier_key(op.key, op.block_hash), op.block_id,
                            work.priorities.get(op.request_id, 0))


def free_tiered(state: TieredState, request_id: RequestId, *,
                block_hashes: BlockHashes | None = None) -> tuple[TieredState, TierDelta]:
    """Free a request's device blocks (:func:`~kvfunc.free_request`) and forget its priority.

    Raises:
        InvalidArgumentError: the request has loads in flight.
        UnknownRequestError, InvalidTypeError: as ``free_request``.

    >>> from kvfunc.core import FullAttention, KVState, TieredState
    >>> dev = KVState.create({"f": FullAttention(num_blocks=4, block_size=4)}, 64,
    ...                      enable_prefix_caching=True)
    >>> t = allocate_tiered(TieredState.create(dev), [("a", 0, 5)], priorities={"a": 3}).state
    >>> dict(t.priorities), dict(free_tiered(t, "a")[0].priorities)
    ({'a': 3}, {})
    """
    check_tiered(state)
    check_request_id(request_id)
    if request_id in state.loads:
        msg = f"request {excerpt(request_id)} has loads in flight: settle them first"
        raise InvalidArgumentError(msg)
    device, delta = free_request(state.device, request_id, block_hashes=block_hashes,
                                 priority=state.priorities.get(request_id, 0))
    work = TierWork(state)
    work.device = device
    _follow_device(work, delta, work.note_device(delta))
    if request_id in state.priorities:
        work.forget(request_id)
    return work.freeze(), work.sink.build(delta)
