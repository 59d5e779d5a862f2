"""The cross-tier hit: :func:`lookup_tiers` finds it, :func:`device_entries` checks it.

See :mod:`kvfunc.core._tiers` for the theory of operation.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs

from kvfunc.core._checks import check_count, check_request_id, excerpt, is_request_id
from kvfunc.core._errors import InvalidArgumentError, InvalidTypeError
from kvfunc.core._fold import SlotRequest
from kvfunc.core._hashing import BlockHashes
from kvfunc.core._prefix import PrefixHit, lookup_prefix
from kvfunc.core._state import FrozenDict
from kvfunc.core._tier_state import TieredState, check_tiered

__all__ = ["TieredHit", "device_entries", "lookup_tiers"]


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
        tier_key, groups = state.tier_key, state.keys
        for j in range(n, limit):
            d = digests[(j + 1) * ratio - 1]
            found = len(keys)
            for g in groups:
                tk = tier_key(g, d)
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


def _admission(state: TieredState, e: tuple[Any, ...], cache_loaded: bool) -> SlotRequest:
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
    if lower and not cache_loaded:  # cached once the request computes it (see _tiers)
        hashes = BlockHashes.of_digests(digests[:first * ratio], None, hashes.block_size)
    return SlotRequest(rid, hit.device.num_tokens, new + lower * bs, e[3], e[4], e[5], hashes,
                       hit.device)


def device_entries(state: TieredState, requests: Iterable[Any], cache_loaded: bool = False
                   ) -> tuple[list[Any], dict[Any, TieredHit]]:
    """The device's entries of a tiered step, and the admissions with a :class:`TieredHit`.

    Each admission with a ``TieredHit`` becomes its device entry (checked
    against the tiers; ``cache_loaded``: see :func:`~kvfunc.allocate_tiered`).
    An entry for a request with loads in flight, or with a device hit sharing
    a block a load is still writing, is refused.

    Raises:
        InvalidArgumentError, InvalidTypeError: as :func:`~kvfunc.allocate_tiered`.
    """
    if isinstance(requests, str | bytes) or not isinstance(requests, Iterable):
        raise InvalidTypeError(f"requests must be an iterable of entries, got {excerpt(requests)}")
    entries: list[Any] = []
    admits: dict[Any, TieredHit] = {}
    for e in requests:
        if isinstance(e, tuple) and len(e) == 8 and type(e[7]) is TieredHit:
            entries.append(_admission(state, e, cache_loaded))
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
    return entries, admits
