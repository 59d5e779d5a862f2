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

Each lookup takes the first cached copy of a block (vLLM's choice when two
blocks hold one prefix: the one cached first).

With prefix caching a sliding-window group takes a block for every token a
prefill computes (``_policy.blocks_needed`` with ``keep``), so each block is
cached; those that slid out of the window leave the table at the next step,
still cached, as vLLM keeps them.  A later prompt that shares a prefix finds
the window's blocks before its hit point while they stay cached.  A forked
child must hash its *own* tokens: the parent's hashes may name tokens the
child never had.
"""

from __future__ import annotations

from math import lcm
from typing import Any

import attrs

from kvfunc.core._checks import excerpt
from kvfunc.core._errors import InvalidArgumentError, InvalidTypeError, NotSupportedError
from kvfunc.core._hashing import BlockHashes
from kvfunc.core._lineage import LOCK, content
from kvfunc.core._policy import KEEPS_ALL, hit_span
from kvfunc.core._pool import cache_key
from kvfunc.core._state import NULL_BLOCK, BlockId, FrozenDict, KVState, check_state

__all__ = ["PrefixHit", "lookup_prefix", "require_caching"]


def _num_tokens(value: object) -> int:
    return _count("num_tokens", value)


def _query_tokens(value: object) -> int:
    return _count("query_tokens", value)


def _count(name: str, value: object) -> int:
    if type(value) is not int:
        raise InvalidTypeError(f"PrefixHit {name} must be an int, got {excerpt(value)}")
    if value < 0:
        raise InvalidArgumentError(f"PrefixHit {name} must be non-negative, got {excerpt(value)}")
    return value


def _tables(value: Any) -> FrozenDict[str, tuple[BlockId, ...]]:
    """A mapping of hit tables as a checked :class:`~kvfunc.core._state.FrozenDict`."""
    if type(value) is FrozenDict:
        return value
    if not isinstance(value, dict):
        raise InvalidTypeError(f"PrefixHit block_ids must be a dict of tables, got "
                               f"{excerpt(value)}")
    for key, table in value.items():
        if (type(key) is not str or type(table) is not tuple
                or any(type(b) is not int for b in table)):
            msg = (f"PrefixHit block_ids must map manager keys to tuples of block ids, got "
                   f"{excerpt(key)}: {excerpt(table)}")
            raise InvalidTypeError(msg)
        if any(b < 0 for b in table):
            raise InvalidArgumentError(f"PrefixHit block ids must be non-negative, got "
                                       f"{excerpt(table)}")
    return FrozenDict(value)


@attrs.frozen(slots=True)
class PrefixHit:
    """The cached prefix of a request: what :func:`lookup_prefix` found.

    Attributes:
        num_tokens: tokens whose KV is cached (pass as ``computed_tokens``).
        block_ids: per group, the table the hit gives the request (null
            entries before a sliding window; a state group's saved block).
        query_tokens: tokens that were looked up (for the hit rate); at
            least ``num_tokens``.

    >>> PrefixHit(16, {"full": (1, 2)}, 8)
    Traceback (most recent call last):
    ...
    kvfunc.core._errors.InvalidArgumentError: PrefixHit query_tokens (8) must be at least \
num_tokens (16)
    """

    num_tokens: int = attrs.field(converter=_num_tokens)
    block_ids: FrozenDict[str, tuple[BlockId, ...]] = attrs.field(converter=_tables)
    query_tokens: int = attrs.field(converter=_query_tokens)

    def __attrs_post_init__(self) -> None:
        if self.query_tokens < self.num_tokens:
            msg = (f"PrefixHit query_tokens ({excerpt(self.query_tokens)}) must be at least "
                   f"num_tokens ({excerpt(self.num_tokens)})")
            raise InvalidArgumentError(msg)


def require_caching(state: Any, what: str) -> None:
    """Raise :class:`~kvfunc.NotSupportedError` unless ``state`` (or a transient) caches."""
    caching = state.prefix_caching if isinstance(state, KVState) else state.caching
    if not caching:
        msg = f"{what} needs a state created with enable_prefix_caching=True"
        raise NotSupportedError(msg)


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
        msg = f"block_hashes must be a BlockHashes, got {excerpt(block_hashes)}"
        raise InvalidTypeError(msg)
    if max_tokens is not None and type(max_tokens) is not int:
        msg = f"max_tokens must be None or a non-negative int, got {excerpt(max_tokens)}"
        raise InvalidTypeError(msg)
    if max_tokens is not None and max_tokens < 0:
        msg = f"max_tokens must be None or a non-negative int, got {excerpt(max_tokens)}"
        raise InvalidArgumentError(msg)
    hashes = block_hashes
    with LOCK:  # the pools' indexes, kept from any transition while they are read
        indexes = [content(p.ver).by_key for p in state.pools]  # type: ignore[arg-type]
        finders = [_Finder(state, g, hashes, indexes[g.pool]) for g in state.groups]
        step = lcm(*(f.bs for f in finders)) if finders else 1
        limit = hashes.num_blocks * hashes.block_size
        query = limit if max_tokens is None else min(limit, max_tokens)
        best = query
        for f in finders:  # full attention first: one scan bounds every other group
            if f.full:
                best = f.scan(best)
        best = _longest_accepted(finders, best - best % step, step)
        tables = {f.key: f.table(best) for f in finders}
    return PrefixHit(best, FrozenDict(tables), query)


class _Finder:
    """One group's view of the cache during a lookup (its pool, tag and hash stride)."""

    __slots__ = ("bs", "digests", "full", "index", "key", "m", "memo", "policy", "scanned", "tag")

    def __init__(self, state: KVState, g: Any, hashes: BlockHashes, index: Any) -> None:
        self.key, self.policy, self.bs = g.key, g.policy, g.policy.block_size
        if self.bs % hashes.block_size:
            msg = (f"group {g.key!r} has block_size {self.bs}, not a multiple of the hashes' "
                   f"block_size {hashes.block_size}")
            raise InvalidArgumentError(msg)
        self.m = self.bs // hashes.block_size
        self.index = index
        self.tag = state.pools[g.pool].tag_of(g.key)
        self.full = g.traits[1] and g.traits[2] == KEEPS_ALL
        self.digests = hashes._digests
        self.scanned: list[int] = []
        self.memo: dict[int, int | None] = {}

    def find(self, p: int) -> int | None:
        """The first block cached for this group's block ``p``, or None."""
        got = self.memo.get(p, -1)
        if got == -1:
            found = self.index.get(cache_key(self.digests[(p + 1) * self.m - 1], self.tag))
            got = found if found is None or type(found) is int else found[0]
            self.memo[p] = got
        return None if got is None else int(got)

    def scan(self, best: int) -> int:
        """Full attention: the cached blocks of the longest cached prefix up to ``best``."""
        ids = self.scanned
        index, tag, m = self.index, self.tag, self.m
        for h in self.digests[m - 1:best // self.bs * m:m]:
            found = index.get(h if tag is None else h + tag)
            if found is None:
                break
            ids.append(found if type(found) is int else found[0])
        return len(ids) * int(self.bs)

    def accepts(self, length: int, step: int) -> int:
        """``length`` if this group accepts it, else a bound below it for the next try."""
        if self.full:
            return length  # the scan bounded it already
        first, last = hit_span(self.policy, length)
        for p in range(last - 1, first - 1, -1):  # lengths whose span holds a miss fail
            if self.find(p) is None:
                return p * self.bs if self.policy.grows_with_tokens else length - step
        return length

    def table(self, best: int) -> tuple[BlockId, ...]:
        """The table a hit of ``best`` tokens gives the request in this group."""
        if best == 0:
            return ()
        if self.full:
            return tuple(self.scanned[:best // self.bs])
        first, last = hit_span(self.policy, best)
        found = tuple(int(self.find(p) or 0) for p in range(first, last))  # accepted: all found
        return found if not self.policy.grows_with_tokens else (NULL_BLOCK,) * first + found


def _longest_accepted(finders: list[_Finder], best: int, step: int) -> int:
    """The longest length ``<= best`` (a multiple of ``step``) that every group accepts."""
    while best > 0:
        bound = min(f.accepts(best, step) for f in finders)
        if bound == best:
            break
        best = bound - bound % step
    return max(best, 0)
