"""Caching transitions besides allocation: forks, cache resets; cache queries and metrics."""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from kvfunc.core._builder import DeltaBuilder
from kvfunc.core._checks import check_request_id, excerpt
from kvfunc.core._delta import BlocksChanged
from kvfunc.core._errors import InvalidArgumentError, UnknownRequestError
from kvfunc.core._prefix import require_caching
from kvfunc.core._rows import remade, row_table
from kvfunc.core._state import KVState, RequestId, check_state, find_group
from kvfunc.core._transient import Transient

__all__ = ["PrefixCacheStats", "fork_request", "num_cached_blocks", "reset_prefix_cache"]

_new = tuple.__new__


def fork_request(state: KVState, parent: RequestId, child: RequestId
                 ) -> tuple[KVState, BlocksChanged]:
    """A new request ``child`` that shares every block of ``parent`` (copy-on-write).

    For parallel sampling and beam search.  Nothing is copied now: the first
    allocation of either request that writes into a block both hold gives
    the writer its own copy (a copy row in that delta, which the shell
    performs before the step runs).  Give the child's allocations hashes of
    the child's own tokens: the parent's may name tokens the child never had.

    Raises:
        NotSupportedError: the state has no reference counts (create it with
            ``enable_prefix_caching=True``).
        UnknownRequestError: ``parent`` is not registered.
        InvalidArgumentError: ``child`` is already registered.

    >>> from kvfunc.core import FullAttention, KVState, allocate_slots, get_block_ids
    >>> s = KVState.create({"full": FullAttention(num_blocks=8, block_size=4)}, 64,
    ...                    enable_prefix_caching=True)
    >>> s, _ = fork_request(allocate_slots(s, "p", 0, 6).state, "p", "c")
    >>> get_block_ids(s, "c")
    {'full': (1, 2)}
    >>> r = allocate_slots(s, "c", 6, 1)      # writes into the shared block 2
    >>> get_block_ids(r.state, "c"), r.delta.copied_src_block_ids, r.delta.copied_dst_block_ids
    ({'full': (1, 3)}, (2,), (3,))
    """
    check_state(state)
    require_caching(state, "fork_request")
    check_request_id(parent)
    check_request_id(child)
    if not any(g.row(parent) is not None for g in state.groups):
        raise UnknownRequestError(f"cannot fork unknown request {excerpt(parent)}")
    if any(g.row(child) is not None for g in state.groups):
        msg = f"cannot fork into {excerpt(child)}: it is already registered"
        raise InvalidArgumentError(msg)
    sink = DeltaBuilder()
    tr = Transient(state, sink)
    seq, tr.seq = tr.seq, tr.seq + 1
    try:
        for i, view in enumerate(state.groups):
            row = view.row(parent)
            if row is None:
                continue
            g = tr.copy(i)
            g.put(parent, remade(row, row.nulls, row.stored, row.length))
            g.put(child, g.share(child, g.register(child, seq), row_table(row)))
    except BaseException:
        tr.abort()
        raise
    return tr.freeze(), sink.build()


def reset_prefix_cache(state: KVState) -> tuple[KVState, BlocksChanged]:
    """Forget every cached block (``AllBlocksCleared``); requests keep their blocks.

    Blocks of running requests are cached again as their requests go on
    (their next allocation with ``block_hashes`` stores them).

    Raises:
        NotSupportedError: the state has no prefix cache.

    >>> from kvfunc.core import BlockHashes, FullAttention, KVState, allocate_slots
    >>> s = KVState.create({"full": FullAttention(num_blocks=8, block_size=4)}, 64,
    ...                    enable_prefix_caching=True)
    >>> s = allocate_slots(s, "a", 0, 8, block_hashes=BlockHashes.of(range(8), 4)).state
    >>> num_cached_blocks(s, "full"), num_cached_blocks(reset_prefix_cache(s)[0], "full")
    (2, 0)
    """
    check_state(state)
    require_caching(state, "reset_prefix_cache")
    sink = DeltaBuilder()
    tr = Transient(state, sink)
    try:
        for g in tr.all_copies():
            g.pool.clear()
            g.unstore_all()
            sink.rows.append((g.key,))
            sink.codes.append("Z")
    except BaseException:
        tr.abort()
        raise
    return tr.freeze(), sink.build()


def num_cached_blocks(state: KVState, manager_key: str) -> int:
    """Blocks of a group that hold a cached full block (held or evictable); 0 without caching.

    >>> from kvfunc.core import FullAttention, KVState
    >>> num_cached_blocks(KVState.create({"f": FullAttention(num_blocks=4, block_size=4)}, 8),
    ...                   "f")
    0
    """
    check_state(state)
    pool = state.pools[find_group(state.groups, manager_key).pool]
    if len(pool.members) == 1:
        return pool.num_cached
    return sum(len(blocks) for blocks in pool.cached(manager_key).values())


@attrs.frozen(slots=True)
class PrefixCacheStats:
    """Prefix-cache metrics accumulated from deltas (a value; :meth:`add` returns a new one).

    >>> from kvfunc.core import BlocksChanged
    >>> d = BlocksChanged(order="HH", hit_request_ids=("a", "b"), hit_tokens=(0, 48),
    ...                   hit_query_tokens=(64, 64))
    >>> s = PrefixCacheStats().add(d)
    >>> s.queries, s.hits, s.hit_tokens, s.hit_rate
    (2, 1, 48, 0.375)
    """

    queries: int = 0
    hits: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    stored_blocks: int = 0
    evicted_blocks: int = 0
    resets: int = 0

    @property
    def hit_rate(self) -> float:
        """Hit tokens over looked-up tokens (0.0 before any lookup)."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def add(self, delta: BlocksChanged) -> PrefixCacheStats:
        """These metrics plus what ``delta`` did."""
        return PrefixCacheStats(
            self.queries + len(delta.hit_request_ids),
            self.hits + sum(1 for t in delta.hit_tokens if t),
            self.query_tokens + sum(delta.hit_query_tokens),
            self.hit_tokens + sum(delta.hit_tokens),
            self.stored_blocks + len(delta.stored_keys),
            self.evicted_blocks + len(delta.evicted_keys),
            self.resets + (1 if delta.cleared_keys else 0))

    @classmethod
    def of(cls, deltas: Iterable[BlocksChanged]) -> PrefixCacheStats:
        """Metrics of a sequence of deltas."""
        stats = cls()
        for d in deltas:
            stats = stats.add(d)
        return stats
