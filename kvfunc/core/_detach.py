"""Transitions outside a step: deferred frees and explicit eviction.

An engine that frees a request's blocks only once the device is done with
them (vLLM's ``pop_blocks_for_free`` and ``block_pool.free_blocks``) detaches
the request first: :func:`detach_request` drops its tables and keeps its
blocks held, outside the tables, so nothing can hand them out; later
:func:`free_detached` lets them go.  :func:`evict_blocks` forgets what
blocks cache (vLLM's ``evict_blocks``: a KV connector found their contents
invalid).  Each is one transition with its delta (families D, X and E).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from kvfunc.core._builder import DeltaBuilder
from kvfunc.core._checks import check_request_id, excerpt
from kvfunc.core._delta import BlocksChanged
from kvfunc.core._errors import BlockIndexError, InvalidArgumentError, InvalidTypeError
from kvfunc.core._state import BlockId, KVState, RequestId, check_state
from kvfunc.core._transient import Transient

__all__ = ["DetachResult", "detach_request", "evict_blocks", "free_detached"]


@attrs.frozen(slots=True)
class DetachResult:
    """Outcome of :func:`detach_request`: the state, the delta, the blocks now detached."""

    state: KVState
    delta: BlocksChanged
    block_ids: dict[str, tuple[BlockId, ...]]


def detach_request(state: KVState, request_id: RequestId) -> DetachResult:
    """Drop a request's tables but keep its blocks held until :func:`free_detached`.

    ``block_ids`` gives, per group the request was registered in, its
    blocks in logical order (null entries left out).  An unknown request
    changes nothing.

    >>> from kvfunc.core import FullAttention, allocate_slots, num_free_blocks
    >>> s = KVState.create({"f": FullAttention(num_blocks=8, block_size=4)}, 64)
    >>> d = detach_request(allocate_slots(s, "a", 0, 9).state, "a")
    >>> d.block_ids, num_free_blocks(d.state, "f")
    ({'f': (1, 2, 3)}, 4)
    >>> s2, _ = free_detached(d.state, {"f": (3, 2, 1)})
    >>> num_free_blocks(s2, "f")
    7
    """
    check_state(state)
    check_request_id(request_id)
    sink = DeltaBuilder()
    tr = Transient(state, sink)
    out = {}
    try:
        for i, view in enumerate(state.groups):
            if view.rows.get(request_id) is not None:
                out[view.key] = tr.copy(i).detach(request_id)
    except BaseException:
        tr.abort()
        raise
    return DetachResult(tr.freeze(), sink.build(), out)


def free_detached(state: KVState, block_ids: Mapping[str, Sequence[BlockId]]
                  ) -> tuple[KVState, BlocksChanged]:
    """Let detached blocks go, per group in the order given (vLLM frees them last first).

    Blocks nobody holds then return to their pool's free queue.  Every id is
    checked first: a block that is not detached that often is a typed error
    and nothing changes.
    """
    check_state(state)
    if not isinstance(block_ids, Mapping):
        msg = f"block_ids must map manager keys to block ids, got {excerpt(block_ids)}"
        raise InvalidTypeError(msg)
    sink = DeltaBuilder()
    tr = Transient(state, sink)
    left: dict[int, dict[int, int]] = {}
    try:
        for key, ids in block_ids.items():
            i = tr.index(key)
            j = tr.group_pool[i]
            counts = left.setdefault(j, dict(state.pools[j].detached.items()))
            ids = _block_list(ids, state.pools[j].num_blocks)
            for b in ids:
                if counts.get(b, 0) < 1:
                    raise InvalidArgumentError(f"block {b} of {key!r} is not detached")
                counts[b] -= 1
            if ids:
                tr.copy(i).pool.drop(ids, key)
    except BaseException:
        tr.abort()
        raise
    return tr.freeze(), sink.build()


def evict_blocks(state: KVState, block_ids: Sequence[BlockId], *,
                 manager_key: str | None = None) -> tuple[KVState, BlocksChanged]:
    """Forget what the given blocks cache, held or free (vLLM's ``evict_blocks``).

    A held block stays with its requests (only later hits miss it); a free
    one keeps its place in the free queue.  Blocks that cache nothing are
    passed over.  With several pools, ``manager_key`` names the group whose
    pool the ids belong to.

    Raises:
        NotSupportedError: the state has no prefix cache.
        BlockIndexError: an id outside the pool.
    """
    from kvfunc.core._prefix import require_caching  # the query module: no cycle

    check_state(state)
    require_caching(state, "evict_blocks")
    if manager_key is None:
        if len(state.pools) != 1:
            raise InvalidArgumentError("a state with several pools needs manager_key")
        i = 0
    else:
        i = list(state.manager_keys).index(state.group(manager_key).key)
    ids = _block_list(block_ids, state.pools[state.groups[i].pool].num_blocks)
    sink = DeltaBuilder()
    tr = Transient(state, sink)
    try:
        pool = tr.copy(i).pool
        members = [tr.copy(k) for k, g in enumerate(state.groups)
                   if g.pool == state.groups[i].pool]
        for b in dict.fromkeys(ids):
            held = pool.refs[b] > 0
            if pool.evict(b) and held:
                for g in members:
                    g.unstore(b)
    except BaseException:
        tr.abort()
        raise
    return tr.freeze(), sink.build()


def _block_list(ids: Any, num_blocks: int) -> list[int]:
    """``ids`` as a list of block ids of a pool of ``num_blocks``, each checked."""
    if isinstance(ids, str | bytes) or not isinstance(ids, Sequence | set | frozenset):
        raise InvalidTypeError(f"block ids must be a sequence of ints, got {excerpt(ids)}")
    out = list(ids)
    for b in out:
        if type(b) is not int:
            raise InvalidTypeError(f"a block id must be an int, got {excerpt(b)}")
        if not 0 < b < num_blocks:
            raise BlockIndexError(f"block id {b} is out of range [1, {num_blocks})")
    return out
