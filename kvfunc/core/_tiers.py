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

**Lookup** (:func:`lookup_tiers`): the device's own hit first, cut before
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
:class:`TieredHit` asks the device for its device hit plus new blocks for the
rest of the hit and its chunk; the lower-tier blocks count as computed once
loaded.  The device caches none of those new blocks at admission (the
admission's hashes stop at the device hit, as vLLM delays caching while a
connector loads): a request with loads in flight cannot compute, so until
it runs again, its new blocks hold no KV, and a failed load leaves its later
blocks unfilled.  Its next step, with its whole hashes, caches them as
blocks it computes, and with ``"write-through"`` stores them then.  Each
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

import attrs

from kvfunc.core._checks import (
    check_count,
    check_priority,
    check_request_id,
    excerpt,
    is_request_id,
)
from kvfunc.core._delta import BlocksChanged
from kvfunc.core._errors import InvalidArgumentError, InvalidTypeError
from kvfunc.core._fold import SlotRequest
from kvfunc.core._hashing import BlockHashes
from kvfunc.core._ops import Evicted, Stored
from kvfunc.core._pool import cache_key
from kvfunc.core._prefix import PrefixHit, lookup_prefix
from kvfunc.core._state import FrozenDict, RequestId
from kvfunc.core._tier_delta import TierDelta
from kvfunc.core._tier_state import (
    HOST_TO_DEVICE,
    REMOTE_TO_DEVICE,
    TieredState,
    check_tiered,
)
from kvfunc.core._tier_work import TierWork
from kvfunc.core._transitions import allocate_batch, free_request, get_block_ids

__all__ = ["TieredHit", "TieredResult", "allocate_tiered", "free_tiered", "lookup_tiers"]


@attrs.frozen(slots=True)
class TieredHit:
    """A prefix hit across tiers: what :func:`lookup_tiers` found.

    A lower block is one group's block at one position of the prefix: the
    lower part of the hit holds, for each position after the device part, a
    block of every group (in manager order), so the three per-block tuples
    below list position after position, group after group.

    Attributes:
        device: the device part, a :class:`~kvfunc.PrefixHit`.
        sources: per lower block, ``"host"`` or ``"remote"``.
        host_block_ids: per lower block, its host block (``-1`` for remote).
        hashes: per lower block, its tier key (:meth:`~kvfunc.TieredState.tier_key`).
        num_tokens: tokens of the whole hit (pass as ``computed_tokens``).
        query_tokens: tokens looked up.

    >>> from kvfunc.core import PrefixHit
    >>> hit = TieredHit(PrefixHit(4, {"f": (1,)}, 11), ("host", "remote"), (7, -1),
    ...                 (b"h1", b"h2"), 12, 11)
    >>> hit.host_blocks, hit.remote_blocks
    (1, 1)
    """

    device: PrefixHit
    sources: tuple[str, ...]
    host_block_ids: tuple[int, ...]
    hashes: tuple[bytes, ...]
    num_tokens: int
    query_tokens: int

    @property
    def host_blocks(self) -> int:
        """Blocks the hit loads from the host tier."""
        return self.sources.count("host")

    @property
    def remote_blocks(self) -> int:
        """Blocks the hit loads from the remote tier."""
        return self.sources.count("remote")

    @property
    def position_sources(self) -> tuple[str, ...]:
        """Per position of the lower part, the slowest tier it loads from.

        ``"remote"`` when any group's block at that position comes from the
        remote tier, else ``"host"`` (one item per ``block_size`` tokens).

        >>> from kvfunc.core import PrefixHit
        >>> TieredHit(PrefixHit(0, {"f": (), "w": ()}, 9), ("host", "remote", "host", "host"),
        ...           (1, -1, 2, 3), (b"a0", b"a1", b"b0", b"b1"), 8, 9).position_sources
        ('remote', 'host')
        """
        g = len(self.device.block_ids) or 1
        return tuple("remote" if "remote" in self.sources[i:i + g] else "host"
                     for i in range(0, len(self.sources), g))


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


def lookup_tiers(state: TieredState, block_hashes: BlockHashes, *,
                 max_tokens: int | None = None) -> TieredHit:
    """The longest prefix of ``block_hashes`` held by the device, then the host, then remote.

    The device's own hit comes first (cut before any block a load is still
    writing).  Each block after it must be held below the device in every
    group, by the host tier or else the remote tier; the hit ends at the
    first block that is not.

    Raises:
        InvalidTypeError, InvalidArgumentError: as :func:`~kvfunc.lookup_prefix`.

    >>> from kvfunc.core import BlockHashes, FullAttention, KVState, TieredState
    >>> dev = KVState.create({"f": FullAttention(num_blocks=8, block_size=4)}, 64,
    ...                      enable_prefix_caching=True)
    >>> t = TieredState.create(dev, host_blocks=8)
    >>> h = BlockHashes.of(range(12), 4)
    >>> hit = lookup_tiers(t, h, max_tokens=11)
    >>> hit.num_tokens, hit.sources, hit.query_tokens
    (0, (), 11)
    """
    check_tiered(state)
    dev = lookup_prefix(state.device, block_hashes, max_tokens=max_tokens)
    if state.device_pending:
        dev = _without_pending(state, block_hashes, dev)
    bs = state.block_size
    n = dev.num_tokens // bs
    ratio = bs // block_hashes.block_size
    limit = dev.query_tokens // bs
    host, remote = state.host, state.remote
    sources: list[str] = []
    blocks: list[int] = []
    keys: list[bytes] = []
    if host is not None or remote is not None:
        digests = block_hashes.hashes
        tags = [state.device.pools[0].tag_of(k) for k in state.keys]
        for j in range(n, limit):
            d = digests[(j + 1) * ratio - 1]
            found = len(keys)
            for tag in tags:
                tk = cache_key(d, tag)
                entry = None if host is None else host.index.get(tk)
                if entry is not None:
                    sources.append("host")
                    blocks.append(entry.block)
                elif remote is not None and remote.index.get(tk) is not None:
                    sources.append("remote")
                    blocks.append(-1)
                else:
                    break
                keys.append(tk)
            else:
                continue
            del sources[found:], blocks[found:], keys[found:]  # a group lacks block j
            break
    lower = len(keys) // len(state.keys)
    return TieredHit(dev, tuple(sources), tuple(blocks), tuple(keys), (n + lower) * bs,
                     dev.query_tokens)


def _without_pending(state: TieredState, block_hashes: BlockHashes, dev: PrefixHit
                     ) -> PrefixHit:
    """The device hit ``dev``, shortened until it holds no block a load is still writing."""
    pending, query = state.device_pending, dev.query_tokens
    while True:
        cut = min((p for table in dev.block_ids.values() for p, b in enumerate(table)
                   if b in pending), default=None)
        if cut is None:
            return dev
        dev = lookup_prefix(state.device, block_hashes, max_tokens=cut * state.block_size)
        dev = PrefixHit(dev.num_tokens, dev.block_ids, query)


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


def _admission(state: TieredState, e: tuple[Any, ...]) -> SlotRequest:
    """The device entry of an admission with a :class:`TieredHit` (checked against the tiers)."""
    hit: TieredHit = e[7]
    rid, computed, new = e[0], e[1], e[2]
    check_request_id(rid)
    if (type(hit.device) is not PrefixHit or type(hit.sources) is not tuple
            or type(hit.host_block_ids) is not tuple or type(hit.hashes) is not tuple):
        raise InvalidTypeError(f"a TieredHit of malformed fields: {excerpt(hit)}")
    check_count("num_new_tokens", new)
    if type(computed) is not int or computed != hit.num_tokens:
        msg = (f"computed_tokens must equal the hit's num_tokens ({hit.num_tokens}) when "
               f"admitting with a TieredHit, got {excerpt(computed)}")
        raise InvalidArgumentError(msg)
    hashes = e[6]
    if type(hashes) is not BlockHashes:
        raise InvalidTypeError(f"a TieredHit needs its BlockHashes, got {excerpt(hashes)}")
    bs, first, keys = state.block_size, hit.device.num_tokens // state.block_size, state.keys
    ratio = bs // hashes.block_size if bs % hashes.block_size == 0 else 0
    lower, rest = divmod(len(hit.hashes), len(keys))
    if (not ratio or rest or hit.device.num_tokens % bs
            or first * bs + lower * bs != hit.num_tokens
            or not len(hit.sources) == len(hit.host_block_ids) == len(hit.hashes)
            or hashes.num_blocks < (first + lower) * ratio):
        raise InvalidArgumentError(f"the TieredHit of {excerpt(rid)} does not fit its hashes")
    if (any(type(x) is not str for x in hit.sources)
            or any(type(x) is not int for x in hit.host_block_ids)
            or any(type(x) is not bytes for x in hit.hashes)):
        raise InvalidTypeError(f"the TieredHit of {excerpt(rid)} has a cell of a wrong type")
    digests = hashes.hashes
    for k, (src, block, d) in enumerate(zip(hit.sources, hit.host_block_ids, hit.hashes,
                                            strict=True)):
        position, g = divmod(k, len(keys))
        entry = None if state.host is None else state.host.index.get(d)
        ok = d == state.tier_key(keys[g], digests[(first + position + 1) * ratio - 1]) and (
            (src == "host" and entry is not None and entry.block == block) or
            (src == "remote" and block == -1 and state.remote is not None
             and state.remote.index.get(d) is not None))
        if not ok:
            msg = f"the TieredHit of {excerpt(rid)} is stale or foreign at block {first + position}"
            raise InvalidArgumentError(msg)
    if lower:  # the device caches the rest once the request computes it (module docstring)
        hashes = BlockHashes.of_digests(digests[:first * ratio], None, hashes.block_size)
    return SlotRequest(rid, hit.device.num_tokens, new + lower * bs, e[3], e[4], e[5], hashes,
                       hit.device)


def allocate_tiered(state: TieredState, requests: Iterable[Any], *,
                    block_hashes: Mapping[RequestId, BlockHashes] | None = None,
                    lookahead_tokens: int = 0,
                    priorities: Mapping[RequestId, int] | None = None) -> TieredResult:
    """One step, as :func:`~kvfunc.allocate_batch`, with loads for hits below the device.

    An entry is any form ``allocate_batch`` takes; an admission whose hit
    (the eighth field) is a :class:`TieredHit` loads the hit's lower blocks.
    ``priorities`` gives requests their retention priority.

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
    if isinstance(requests, str | bytes) or not isinstance(requests, Iterable):
        raise InvalidTypeError(f"requests must be an iterable of entries, got {excerpt(requests)}")
    entries: list[Any] = []
    admits: dict[Any, TieredHit] = {}
    for e in requests:
        if isinstance(e, tuple) and len(e) == 8 and type(e[7]) is TieredHit:
            entries.append(_admission(state, e))
            if e[0] in admits:
                raise InvalidArgumentError(f"request {excerpt(e[0])} is admitted twice")
            admits[e[0]] = e[7]
        else:
            entries.append(e)
    if state.loads:
        for e in entries:
            if isinstance(e, tuple) and e and is_request_id(e[0]) and e[0] in state.loads:
                msg = f"request {excerpt(e[0])} has loads in flight: settle them first"
                raise InvalidArgumentError(msg)
            hit = e[7] if isinstance(e, tuple) and len(e) == 8 else None
            if type(hit) is PrefixHit and type(hit.block_ids) in (dict, FrozenDict) and any(
                    type(b) is int and b in state.device_pending
                    for t in hit.block_ids.values() if type(t) is tuple for b in t):
                msg = (f"the hit of {excerpt(e[0])} shares a device block a load is still "
                       f"writing: look it up again (lookup_tiers)")
                raise InvalidArgumentError(msg)
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
    if state.write_policy == "write-back" and loading and res.delta.evicted_block_ids:
        # The stores of evicted blocks read them before the loads into them write them, so
        # their rows come first; the loads' sources are held meanwhile (no store evicts them).
        held = [(src == "host", d) for _, hit in loading
                for src, d in zip(hit.sources, hit.hashes, strict=True)]
        _hold(work, held, True)
        _follow_device(work, res.delta, evicted)
        for rid, hit in loading:
            _start_loads(work, rid, hit)
        _hold(work, held, False)
    else:  # write-through: the stores of blocks just cached leave out those being loaded
        for rid, hit in loading:
            _start_loads(work, rid, hit)
        _follow_device(work, res.delta, evicted)
    return TieredResult(work.freeze(), work.sink.build(res.delta), res.refused)


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
