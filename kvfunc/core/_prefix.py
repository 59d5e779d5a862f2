"""Prefix caching: look up a request's cached prefix; check the caching arguments.

Theory of operation
-------------------
A state created with ``enable_prefix_caching=True`` counts references and
caches full blocks under their chained hash (:class:`~kvfunc.BlockHashes`).
A scheduler admits a request in two steps, like vLLM's:

1. ``hit = lookup_prefix(state, hashes, max_tokens=len(prompt) - 1)`` finds
   the longest prefix that is cached for *every* group at once;
2. ``allocate_slots(state, rid, hit.num_tokens, len(prompt) - hit.num_tokens,
   block_hashes=hashes, prefix_hit=hit)`` puts the hit blocks in the new
   request's tables (shared, reference counted) and allocates the rest.

Later steps pass the request's hashes too (``block_hashes=``, or a mapping
for a whole step), so that each block is cached once, when it fills.

What a hit of ``L`` tokens needs, per group (``L`` is a multiple of every
group's block size; the policy says which blocks, see
:func:`~kvfunc.core._policy.hit_span`)::

    full attention   every block before L cached         [h0 h1 h2 h3] L = 4 blocks
    sliding window   only the blocks inside the window   [ -  - h2 h3] window 2 blocks
    state (Mamba)    a state saved exactly at L          (copied into a new block)

Full attention hits are prefix-closed, sliding windows and states are not,
so the lookup tries lengths from the full-attention hit downwards until every
group accepts one.  States are saved by copying the running state into a
cached block whenever a request's computed tokens reach a multiple of the
state group's block size; a hit copies the saved state into the new
request's own block (states change in place, so they are never shared).

A sliding-window group keeps only the blocks of its window: a one-shot
prefill of a long prompt never holds the blocks before its last window, so a
later prompt that shares only a prefix of it finds nothing cached for that
group (identical prompts, shorter prompts and chunked prefills do).  A forked
child must hash its *own* tokens: the parent's hashes may name tokens the
child never had.
"""

from __future__ import annotations

from math import lcm
from typing import Any

import attrs

from kvfunc.core._cache import valid_blocks
from kvfunc.core._checks import excerpt
from kvfunc.core._errors import InvalidArgumentError, InvalidTypeError, NotSupportedError
from kvfunc.core._hashing import BlockHashes
from kvfunc.core._policy import hit_span
from kvfunc.core._state import NULL_BLOCK, BlockId, FrozenDict, KVState, check_state

__all__ = ["PrefixHit", "check_hashes", "check_hit", "lookup_prefix", "require_caching"]


def _frozen(value: Any) -> FrozenDict[str, tuple[BlockId, ...]]:
    """A mapping of hit tables as a :class:`~kvfunc.core._state.FrozenDict` (checked on use)."""
    if type(value) is FrozenDict:
        return value
    if not isinstance(value, dict):
        raise InvalidTypeError(f"block_ids must be a dict of tables, got {type(value).__name__}")
    return FrozenDict(value)


@attrs.frozen(slots=True)
class PrefixHit:
    """The cached prefix of a request: what :func:`lookup_prefix` found.

    Attributes:
        num_tokens: tokens whose KV is cached (pass as ``computed_tokens``).
        block_ids: per group, the table the hit gives the request (null
            entries before a sliding window; a state group's saved block).
        query_tokens: tokens that were looked up (for the hit rate).
    """

    num_tokens: int
    block_ids: FrozenDict[str, tuple[BlockId, ...]] = attrs.field(converter=_frozen)
    query_tokens: int


def require_caching(state: Any, what: str) -> None:
    """Raise :class:`~kvfunc.NotSupportedError` unless ``state`` (or a transient) caches."""
    caching = state.prefix_caching if isinstance(state, KVState) else state.caching
    if not caching:
        msg = f"{what} needs a state created with enable_prefix_caching=True"
        raise NotSupportedError(msg)


def _ratio(block_size: int, hashes: BlockHashes, key: str) -> int:
    if block_size % hashes.block_size:
        msg = (f"group {key!r} has block_size {block_size}, not a multiple of the hashes' "
               f"block_size {hashes.block_size}")
        raise InvalidArgumentError(msg)
    return block_size // hashes.block_size


def check_hashes(tr: Any, hashes: object, with_hit: bool) -> None:
    """The caching arguments need a caching state and hashes that fit every group."""
    require_caching(tr, "block_hashes / prefix_hit")
    if hashes is None:
        if with_hit:
            raise InvalidArgumentError("a prefix_hit needs the block_hashes it was looked up with")
        return
    if type(hashes) is not BlockHashes:
        msg = f"block_hashes must be a BlockHashes, got {type(hashes).__name__}"
        raise InvalidTypeError(msg)
    for g in tr.views:
        _ratio(g.policy.block_size, hashes, g.key)


def check_hit(tr: Any, request_id: int | str, computed: int, keys: Any, hashes: BlockHashes,
              hit: object) -> None:
    """A prefix hit admits a new request with every group's hit table, checked for fit."""
    if not isinstance(hit, PrefixHit):
        raise InvalidTypeError(f"prefix_hit must be a PrefixHit, got {type(hit).__name__}")
    if keys is not None:
        raise InvalidArgumentError("a prefix_hit applies to every group: manager_keys must be None")
    n = hit.num_tokens
    if computed != n:
        msg = (f"computed_tokens must equal the hit's num_tokens ({excerpt(n)}) when admitting "
               f"with a prefix_hit, got {computed}")
        raise InvalidArgumentError(msg)
    if not isinstance(hit.block_ids, dict) or set(hit.block_ids) != {g.key for g in tr.views}:
        raise InvalidArgumentError("the prefix_hit was looked up on a state with other groups")
    if type(n) is not int or not 0 <= n <= hashes.num_tokens:
        raise InvalidArgumentError(f"the prefix_hit's {excerpt(n)} tokens are not covered by "
                                   "the block_hashes")
    slot = tr.slots.get(request_id)
    for g in tr.views:
        entries, policy = hit.block_ids[g.key], g.policy
        want = 0 if not n else n // policy.block_size if policy.grows_with_tokens else 1
        if (type(entries) is not tuple or len(entries) != want
                or any(type(b) is not int for b in entries)
                or (entries and not 0 <= min(entries) <= max(entries) < policy.num_blocks)):
            msg = f"the prefix_hit's blocks of {g.key!r} do not fit the state: {excerpt(entries)}"
            raise InvalidArgumentError(msg)
        if slot is not None and slot < len(g.rows) and g.rows[slot] is not None:
            msg = (f"request {excerpt(request_id)} is already registered; a prefix_hit admits "
                   "new requests")
            raise InvalidArgumentError(msg)


def lookup_prefix(state: KVState, block_hashes: BlockHashes, *,
                  max_tokens: int | None = None) -> PrefixHit:
    """The longest prefix of ``block_hashes`` cached in every group (a query).

    ``max_tokens`` caps the hit (pass ``len(prompt) - 1`` so that at least
    one token is computed).

    Raises:
        NotSupportedError: the state has no prefix cache.
        InvalidTypeError, InvalidArgumentError: bad hashes or cap, or a group
            block size that is not a multiple of the hashes' block size.

    >>> from kvfunc.core import BlockHashes, FullAttention, KVState, allocate_slots
    >>> s = KVState.create({"full": FullAttention(num_blocks=8, block_size=4)}, 64,
    ...                    enable_prefix_caching=True)
    >>> h = BlockHashes.of(range(10), 4)
    >>> s = allocate_slots(s, "a", 0, 10, block_hashes=h).state
    >>> hit = lookup_prefix(s, h, max_tokens=9)
    >>> hit.num_tokens, dict(hit.block_ids)
    (8, {'full': (1, 2)})
    """
    check_state(state)
    require_caching(state, "lookup_prefix")
    if type(block_hashes) is not BlockHashes:
        msg = f"block_hashes must be a BlockHashes, got {type(block_hashes).__name__}"
        raise InvalidTypeError(msg)
    if max_tokens is not None and (type(max_tokens) is not int or max_tokens < 0):
        msg = f"max_tokens must be None or a non-negative int, got {excerpt(max_tokens)}"
        raise InvalidArgumentError(msg)
    hashes = block_hashes
    groups = state.groups
    ratios = [_ratio(g.policy.block_size, hashes, g.key) for g in groups]
    step = lcm(*(g.policy.block_size for g in groups))
    limit = hashes.num_blocks * hashes.block_size
    query = limit if max_tokens is None else min(limit, max_tokens)
    scanned = _scan_full(groups, ratios, hashes, query)
    best = min((len(ids) * groups[i].policy.block_size for i, ids in scanned.items()),
               default=query)
    best -= best % step
    best = _longest_accepted(groups, ratios, hashes._digests, best, step)
    tables: dict[str, tuple[BlockId, ...]] = {}
    for i, g in enumerate(groups):
        tables[g.key] = _hit_table(g, ratios[i], hashes._digests, best, scanned.get(i))
    return PrefixHit(best, FrozenDict(tables), query)


def _is_full(policy: Any) -> bool:
    return bool(policy.grows_with_tokens and policy.window is None and not policy.may_skip)


def _scan_full(groups: Any, ratios: list[int], hashes: BlockHashes, query: int
               ) -> dict[int, list[BlockId]]:
    """Full-attention groups: the cached blocks of the longest cached prefix (one scan)."""
    scanned: dict[int, list[BlockId]] = {}
    best = query
    digests = hashes._digests
    for i, g in enumerate(groups):
        if not _is_full(g.policy):
            continue
        cache, bs, m = g.cache, g.policy.block_size, ratios[i]
        index, hash_of = cache.by_hash, cache.hash_of
        ids = scanned[i] = []
        for h in digests[m - 1:best // bs * m:m]:
            found = index.get(h)
            if found is None:
                break
            if len(found) == 1 and hash_of[found[0]] == h:
                ids.append(found[0])
                continue
            valid = valid_blocks(index, hash_of, h)
            if not valid:
                break
            ids.append(valid[0])
        best = len(ids) * bs
    return scanned


def _longest_accepted(groups: Any, ratios: list[int], digests: list[bytes], best: int,
                      step: int) -> int:
    """The longest length ``<= best`` (a multiple of ``step``) that every group accepts."""
    memo: dict[tuple[int, int], bool] = {}

    def cached(i: int, pos: int) -> bool:  # is group i's block at ``pos`` cached?
        got = memo.get((i, pos))
        if got is None:
            cache = groups[i].cache
            got = bool(valid_blocks(cache.by_hash, cache.hash_of,
                                    digests[(pos + 1) * ratios[i] - 1]))
            memo[(i, pos)] = got
        return got

    def accepts(i: int, length: int) -> int:
        """``length`` if group ``i`` accepts it, else a bound below it for the next try."""
        policy = groups[i].policy
        if _is_full(policy):
            return length  # the scan bounded ``best`` already
        first, last = hit_span(policy, length)
        for p in range(last - 1, first - 1, -1):  # lengths whose span holds a miss fail
            if not cached(i, p):
                return p * policy.block_size if policy.grows_with_tokens else length - step
        return length

    while best > 0:
        bound = min(accepts(i, best) for i in range(len(groups)))
        if bound == best:
            break
        best = bound - bound % step
    return max(best, 0)


def _hit_table(g: Any, ratio: int, digests: list[bytes], best: int,
               scanned: list[BlockId] | None) -> tuple[BlockId, ...]:
    """The table a hit of ``best`` tokens gives the request in group ``g``."""
    policy, cache = g.policy, g.cache
    if best == 0:
        return ()
    if scanned is not None:
        return tuple(scanned[:best // policy.block_size])
    first, last = hit_span(policy, best)
    found = tuple(valid_blocks(cache.by_hash, cache.hash_of, digests[(p + 1) * ratio - 1])[0]
                  for p in range(first, last))
    return found if not policy.grows_with_tokens else (NULL_BLOCK,) * first + found
