"""Transitions: ``(state, request) -> (new state, delta)``, never mutating the input.

Each public transition checks its arguments once (``_checks``), opens a
:class:`~kvfunc.core._group.Transient` on the input state, folds the one
step (``_step``, through ``_fold``) or a release over it, and freezes the
result.  A refusal returns the input state object itself; an error leaves it
untouched (the transient is discarded).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from kvfunc.core._builder import DeltaBuilder
from kvfunc.core._checks import (
    check_count,
    check_manager_keys,
    check_priority,
    check_request_id,
)
from kvfunc.core._delta import EMPTY_DELTA, BlocksChanged
from kvfunc.core._errors import InvalidTypeError
from kvfunc.core._fold import check_hashes, check_lookahead, fold, quiet
from kvfunc.core._policy import slid_out
from kvfunc.core._rows import row_table
from kvfunc.core._state import BlockId, KVState, RequestId, check_state, find_group, usage_string
from kvfunc.core._transient import Transient

if TYPE_CHECKING:
    from kvfunc.core._hashing import BlockHashes
    from kvfunc.core._prefix import PrefixHit

__all__ = [
    "AllocationResult", "BatchResult", "allocate_batch", "allocate_slots", "format_usage",
    "free_into", "free_request", "get_block_ids", "num_free_blocks", "recycle_into",
    "recycle_skipped_blocks",
]


class AllocationResult(NamedTuple):
    """Outcome of :func:`allocate_slots`; when refused, ``state`` is the input."""

    ok: bool
    state: KVState
    delta: BlocksChanged


class BatchResult(NamedTuple):
    """Outcome of :func:`allocate_batch`: one state and one delta for the step."""

    state: KVState
    delta: BlocksChanged
    refused: tuple[RequestId, ...]


def allocate_slots(state: KVState, request_id: RequestId, computed_tokens: int,
                   num_new_tokens: int, lookahead_tokens: int = 0, *, reserved_tokens: int = 0,
                   manager_keys: Collection[str] | None = None,
                   block_hashes: BlockHashes | None = None,
                   prefix_hit: PrefixHit | None = None) -> AllocationResult:
    """Make room for ``computed + new + lookahead`` tokens of a request, atomically.

    Token counts are clamped to ``max_model_len``; ``reserved_tokens`` keeps
    ``ceil(reserved / block_size)`` blocks per registered request free in
    full-attention groups; ``manager_keys`` restricts the groups (unknown
    keys are ignored, as in the seed).  A refusal is a value: ``ok`` is
    False and ``state`` is the input object itself.  Counts must be
    non-negative ints; a bad argument raises and changes nothing.

    With prefix caching (see :func:`lookup_prefix`), ``block_hashes`` lets
    the request's full blocks be cached as they fill, and ``prefix_hit``
    admits a new request with its cached prefix (``computed_tokens`` must
    equal ``prefix_hit.num_tokens``); a hit whose blocks were evicted since
    the lookup is refused.

    >>> from kvfunc.core import FullAttention, KVState
    >>> s = KVState.create({"full": FullAttention(num_blocks=4, block_size=16)}, 1024)
    >>> r = allocate_slots(s, "a", 0, 40)
    >>> r.ok, get_block_ids(r.state, "a")
    (True, {'full': (1, 2, 3)})
    >>> refused = allocate_slots(r.state, "b", 0, 1)
    >>> refused.ok, refused.state is r.state
    (False, True)
    """
    if type(state) is not KVState:
        check_state(state)
    elif (prefix_hit is None and manager_keys is None and type(reserved_tokens) is int
          and not reserved_tokens and state._shape is not None
          and quiet(state.groups, state.max_model_len, state._shape[2], request_id,
                    computed_tokens, num_new_tokens, lookahead_tokens, block_hashes)):
        same = _QUIET[0]  # the lane, before opening: the state itself, as last time if it was
        if same is None or same[1] is not state:
            same = _QUIET[0] = _new(AllocationResult, (True, state, EMPTY_DELTA))
        return same
    if (lookahead_tokens.__class__ is int and reserved_tokens.__class__ is int
            and not reserved_tokens and manager_keys is None and prefix_hit is None):
        return _settled(state, ((request_id, computed_tokens, num_new_tokens),),
                        lookahead_tokens, block_hashes)
    return _settled(state, ((request_id, computed_tokens, num_new_tokens, lookahead_tokens,
                             reserved_tokens, manager_keys, block_hashes, prefix_hit),))


def _settled(state: KVState, entries: tuple[Any, ...], lookahead: int = 0,
             own: BlockHashes | None = None) -> AllocationResult:
    """The fold of one request's ``entries`` on a working copy of ``state``, settled."""
    sink = DeltaBuilder()
    new = _folded(state, entries, lookahead, own, sink)
    if new is None:
        return _new(AllocationResult, (False, state, EMPTY_DELTA))
    return _new(AllocationResult, (True, new, sink.build() if new is not state else EMPTY_DELTA))


def _folded(state: KVState, entries: tuple[Any, ...], lookahead: int, own: BlockHashes | None,
            sink: DeltaBuilder | None) -> KVState | None:
    """The new state after one request's ``entries`` (recorded into ``sink`` unless None),
    or None when refused."""
    tr = Transient.open(state, sink)
    try:
        refused = fold(tr, entries, None, lookahead, own)
    except BaseException:
        tr.abort()
        raise
    if refused:
        kept = tr.settle()  # a refusal changed nothing: the working copy still reads ``state``
        assert kept is state, "a refused allocation changed the state"
        return None
    return tr.settle()


_new = tuple.__new__
#: The last quiet call's result: the next quiet call on the same state returns it as it is
#: (a result costs more to make than the lane's whole check).  One entry, no cycle.
_QUIET: list[AllocationResult | None] = [None]


def allocate_batch(state: KVState, requests: Iterable[Any], *, lookahead_tokens: int = 0,
                   block_hashes: Mapping[RequestId, BlockHashes] | None = None) -> BatchResult:
    """One transition for a scheduler step: :func:`allocate_slots` for each request in order.

    ``requests`` holds one entry per request: the natural and fastest form is
    a plain tuple ``(request_id, computed_tokens, num_new_tokens)``; a
    :class:`SlotRequest` carries the optional arguments (its own lookahead,
    a reservation, a manager-key subset, block hashes, a prefix hit).
    ``lookahead_tokens`` applies to every plain 3-tuple.  With prefix
    caching, ``block_hashes`` maps request ids to their current
    :class:`BlockHashes`; it is read only for requests whose step completes a
    block (or that a ``SlotRequest`` gives no hashes).

    Refused requests change nothing and are listed in ``refused``; the
    result equals calling :func:`allocate_slots` one entry at a time, and
    the step's delta is the log of all of it.  An invalid entry raises and
    the input state stays as it was.

    >>> from kvfunc.core import FullAttention, KVState, SlotRequest
    >>> s = KVState.create({"full": FullAttention(num_blocks=4, block_size=16)}, 1024)
    >>> r = allocate_batch(s, [("a", 0, 20), SlotRequest("b", 0, 40)])
    >>> get_block_ids(r.state, "a"), r.refused
    ({'full': (1, 2)}, ('b',))
    """
    check_state(state)
    check_lookahead(lookahead_tokens)
    if block_hashes is not None and not isinstance(block_hashes, Mapping):
        msg = f"block_hashes must be a mapping of request ids, got {type(block_hashes).__name__}"
        raise InvalidTypeError(msg)
    if not isinstance(requests, Iterable):
        msg = f"requests must be an iterable of step entries, got {type(requests).__name__}"
        raise InvalidTypeError(msg)
    sink = DeltaBuilder()
    new, refused = _batch(state, requests, block_hashes, lookahead_tokens, sink)
    return BatchResult(new, sink.build(), refused)


def _batch(state: KVState, requests: Iterable[Any], block_hashes: Any, lookahead: int,
           sink: DeltaBuilder | None) -> tuple[KVState, tuple[RequestId, ...]]:
    """The fold of a step's ``requests`` on a working copy of ``state``, settled."""
    return _served(state, sink, fold, requests, block_hashes, lookahead)


def _served(state: KVState, sink: DeltaBuilder | None, serve: Any, *args: Any
            ) -> tuple[KVState, tuple[RequestId, ...]]:
    """``serve(tr, *args)`` on a working copy ``tr`` of ``state`` (it returns the refused
    ids), settled; the copy given back untouched if it raised."""
    tr = Transient.open(state, sink)
    try:
        refused = serve(tr, *args)
    except BaseException:
        tr.abort()
        raise
    return tr.settle(), tuple(refused)


def free_into(tr: Transient, request_id: RequestId, keys: frozenset[str] | None,
              hashes: Any = None, priority: int = 0) -> None:
    """Release ``request_id`` in the selected groups of ``tr``; unknown ids are a no-op.

    In the seed's free order the blocks return to the tail in logical order;
    in vLLM's (prefix caching or ``free_order="vllm"``), last block first,
    so that a prefix's tail is evicted before its head.  With ``hashes`` (checked by the caller) the
    full blocks they cover are cached first; cached blocks wait at retention ``priority``.
    """
    for i, view in enumerate(tr.views):
        if keys is not None and view.key not in keys:
            continue
        row = view.rows.get(request_id)
        if row is None:
            continue
        g = tr.copy(i)
        if hashes is not None and g.grows:
            bs = g.block_size
            upto = min(row.length, hashes.num_tokens // bs)
            if upto > row.stored and upto > row.nulls:
                g.put(request_id, g.store(request_id, row, upto, hashes))
        g.release(request_id, priority)


def free_request(state: KVState, request_id: RequestId, *,
                 manager_keys: Collection[str] | None = None,
                 block_hashes: BlockHashes | None = None,
                 priority: int = 0) -> tuple[KVState, BlocksChanged]:
    """Return every block of a request to its pool.

    In the seed's free order (the default without prefix caching) the blocks
    go to the tail of the free queue in logical order. With prefix caching,
    or ``free_order="vllm"``, the blocks are released last block first, as
    vLLM frees them: those that hold nothing cached re-enter the
    free queue at its front (reused first), cached ones at its back (evicted
    last), so that a prefix's tail is evicted before its head.

    With prefix caching, ``block_hashes`` (the request's hashes, covering its
    tokens so far) caches the full blocks it covers that are not cached yet,
    before they are released: an engine that does not hash while decoding
    passes the request's hashes once, here, and its output blocks are
    cached like its prompt's.  Pass hashes of computed tokens only (those
    whose KV is written): every full block they cover is cached.

    ``priority`` is the retention priority its cached blocks wait at (from
    ``-MAX_PRIORITY`` to ``MAX_PRIORITY``; vLLM's order is priority 0): the
    pool hands out, and so evicts, the cached blocks of the lowest priority
    first, least recently freed first within one priority.  A block shared
    by several requests waits at the priority of the one that frees it last.
    Blocks that cache nothing when freed go to the front whatever the
    priority; other frees (a window's slid-out blocks, deferred frees) wait
    at priority 0, and a free block evicted on request keeps its place.

    Freeing an unknown or already freed request changes nothing.

    >>> from kvfunc.core import FullAttention, KVState
    >>> s = KVState.create({"full": FullAttention(num_blocks=4, block_size=16)}, 1024)
    >>> s2, d = free_request(allocate_slots(s, "a", 0, 20).state, "a")
    >>> d.freed_block_ids, num_free_blocks(s2, "full")
    ((1, 2), 3)
    """
    check_state(state)
    check_request_id(request_id)
    keys = check_manager_keys(manager_keys)
    check_priority(priority)
    sink = DeltaBuilder()
    return _freed(state, request_id, keys, block_hashes, priority, sink), sink.build()


def _freed(state: KVState, request_id: RequestId, keys: frozenset[str] | None,
           block_hashes: BlockHashes | None, priority: int, sink: DeltaBuilder | None
           ) -> KVState:
    """The state with ``request_id`` released (:func:`free_into`), recorded into ``sink``."""
    tr = Transient.open(state, sink)
    try:
        if block_hashes is not None:
            check_hashes(tr, block_hashes, False)
        free_into(tr, request_id, keys, block_hashes, priority)
    except BaseException:
        tr.abort()
        raise
    return tr.settle()


def recycle_into(tr: Transient, request_id: RequestId, computed: int,
                 keys: frozenset[str] | None) -> None:
    """Recycle whatever slid out of ``request_id``'s windows in the selected groups."""
    for i, view in enumerate(tr.views):
        if keys is not None and view.key not in keys:
            continue
        row = view.rows.get(request_id)
        if row is None:
            continue
        upto = slid_out(view.policy, view.traits[2], computed, row.length)
        if upto > row.nulls:
            g = tr.copy(i)
            g.put(request_id, g.recycle(request_id, row, upto))


def recycle_skipped_blocks(state: KVState, request_id: RequestId, computed_tokens: int, *,
                           manager_keys: Collection[str] | None = None
                           ) -> tuple[KVState, BlocksChanged]:
    """Null and free the blocks that slid out of a request's window.

    This is the seed's ``remove_skipped_blocks`` as its own transition
    (``allocate_slots`` does it too, but only when it succeeds).
    ``computed_tokens`` is clamped to ``max_model_len``.

    >>> from kvfunc.core import KVState, SlidingWindow
    >>> s = KVState.create({"swa": SlidingWindow(num_blocks=9, block_size=4,
    ...                                          sliding_window=8)}, 1024)
    >>> s = allocate_slots(s, "a", 0, 12).state
    >>> get_block_ids(s, "a")
    {'swa': (1, 2, 3)}
    >>> get_block_ids(recycle_skipped_blocks(s, "a", 12)[0], "a")
    {'swa': (0, 2, 3)}
    """
    check_state(state)
    check_request_id(request_id)
    computed = check_count("computed_tokens", computed_tokens)
    keys = check_manager_keys(manager_keys)
    sink = DeltaBuilder()
    tr = Transient(state, sink)
    try:
        recycle_into(tr, request_id, min(computed, state.max_model_len), keys)
    except BaseException:
        tr.abort()
        raise
    return tr.freeze(), sink.build()


def get_block_ids(state: KVState, request_id: RequestId) -> dict[str, tuple[BlockId, ...]]:
    """``{manager_key: block ids}`` of a request in manager order (``()`` when unknown).

    >>> from kvfunc.core import FullAttention, KVState
    >>> get_block_ids(KVState.create({"f": FullAttention(num_blocks=2, block_size=4)}, 8), 7)
    {'f': ()}
    """
    check_state(state)
    check_request_id(request_id)
    out = {}
    for g in state.groups:
        row = g.rows.get(request_id)
        out[g.key] = () if row is None else row_table(row)
    return out


def num_free_blocks(state: KVState, manager_key: str) -> int:
    """Free blocks of the pool a group draws from (the null block never counts).

    >>> from kvfunc.core import FullAttention, KVState
    >>> num_free_blocks(KVState.create({"f": FullAttention(num_blocks=5, block_size=4)}, 8), "f")
    4
    """
    check_state(state)
    return state.pools[find_group(state.groups, manager_key).pool].num_free


def format_usage(state: KVState) -> str:
    """``"key:used/num_blocks,..."`` in manager order; the null block counts as used.

    >>> from kvfunc.core import FullAttention, KVState
    >>> format_usage(KVState.create({"FullAttention": FullAttention(num_blocks=12,
    ...                                                            block_size=4)}, 8))
    'FullAttention:1/12'
    """
    check_state(state)
    pools = state.pools
    return usage_string((g.key, pools[g.pool].num_blocks, pools[g.pool].num_free)
                        for g in state.groups)
