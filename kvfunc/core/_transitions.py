"""Transitions: ``(state, request) -> (new state, delta)``, never mutating the input.

Theory of operation
-------------------
``allocate_slots`` is the seed's two-phase allocation made strictly atomic.
Phase 1 visits every selected group and asks its policy, without changing
anything, how many leading blocks slid out of the window (they will be
recycled), how many null entries and new blocks the table needs, and how
many blocks must stay free for other requests; the request is refused as a
value as soon as one group cannot serve it, and the input state is returned
unchanged.  Phase 2 applies the plans group by group: recycled blocks go
back to the free queue first (highest logical index first, as in the seed),
then the new blocks are taken from its head.  The recycled blocks count as
free in phase 1, so every accepted call hands out exactly the seed's ids.
Most decode steps change nothing (the request writes into a block it holds
alone, nothing slides out of a window, nothing is left to cache); such a
step is recognised on the published state and answered with the input state
and an empty delta, without opening a transient.

``allocate_batch`` (in ``_batch``) runs the same step for a whole scheduler
step over one transient.
"""

from __future__ import annotations

from collections.abc import Collection
from itertools import repeat
from typing import TYPE_CHECKING, Any

import attrs

from kvfunc.core._delta import EMPTY_DELTA, BlocksChanged, DeltaBuilder
from kvfunc.core._errors import InvalidArgumentError, InvalidTypeError
from kvfunc.core._prefix import (
    allocate_cached,
    check_prefix_args,
    finish_cached,
    quiet,
    uncached_full_block,
)
from kvfunc.core._state import (
    NULL_BLOCK,
    BlockId,
    KVState,
    RequestId,
    find_group,
    usage_string,
)
from kvfunc.core._steps import apply_plan, plan_group, recycle_into
from kvfunc.core._transient import GroupTransient, Transient

if TYPE_CHECKING:
    from kvfunc.core._hashing import BlockHashes
    from kvfunc.core._prefix import PrefixHit

__all__ = [
    "AllocationResult",
    "allocate_slots",
    "format_usage",
    "free_request",
    "get_block_ids",
    "num_free_blocks",
    "recycle_skipped_blocks",
]


@attrs.frozen(slots=True)
class AllocationResult:
    """Outcome of :func:`allocate_slots`; when refused, ``state`` is the input."""

    ok: bool
    state: KVState
    delta: BlocksChanged


# ----------------------------------------------------------------------------
# argument checks (shared by the pure API and the compat facade)

def check_request_id(request_id: object) -> None:
    """Request ids are ``str`` or ``int`` (the seed uses ``-1`` for dummies)."""
    if not isinstance(request_id, str | int):
        msg = f"request_id must be a str or an int, but got {request_id!r}"
        raise InvalidTypeError(msg)


def check_manager_keys(manager_keys: object) -> None:
    """``None`` or a collection of str; a bare string would match substrings."""
    if manager_keys is None:
        return
    if isinstance(manager_keys, str | bytes) or not isinstance(manager_keys, Collection):
        msg = f"manager_keys must be None or a collection of str, but got {manager_keys!r}"
        raise InvalidTypeError(msg)


def check_counts(computed: object, new: object, lookahead: object, reserved: object) -> None:
    for name, value in (("computed_tokens", computed), ("num_new_tokens", new),
                        ("lookahead_tokens", lookahead), ("reserved_tokens", reserved)):
        if type(value) is not int:
            msg = f"{name} must be an int, but got {value!r}"
            raise InvalidTypeError(msg)
    if reserved < 0:  # type: ignore[operator]
        msg = f"reserved_tokens must be non-negative, but got {reserved!r}"
        raise InvalidArgumentError(msg)


# ----------------------------------------------------------------------------
# the per-request step (policy combinator); edits a transient in place


def allocate_into(tr: Transient, request_id: RequestId, computed: int, new: int,
                  lookahead: int, reserved: int, manager_keys: Collection[str] | None,
                  sink: DeltaBuilder | None, hashes: Any = None, hit: Any = None) -> bool:
    """Allocate for one request on ``tr``; on refusal ``tr`` is left untouched.

    On a caching transient the step is :func:`kvfunc.core._prefix.allocate_cached`
    (``sink`` is then required) and the caller runs ``finish_cached`` before
    freezing (it moves the evictions into the delta).
    """
    try:
        total = computed + new + lookahead
    except TypeError:
        total = None
    if type(total) is not int or (reserved and (type(reserved) is not int or reserved < 0)):
        check_counts(computed, new, lookahead, reserved)
        raise InvalidTypeError(f"token counts must be ints, got {(computed, new, lookahead)!r}")
    if new < 0:
        raise InvalidArgumentError("num_new_tokens must be non-negative")
    limit = tr.max_model_len
    if computed > limit:
        computed = limit
    if total > limit:
        total = limit
    groups = tr.groups if manager_keys is None else [
        g for g in tr.groups if g.key in manager_keys]
    if total < 0 and groups:
        raise InvalidArgumentError("num_tokens must be non-negative")
    if tr.caching:
        assert sink is not None
        if computed < 0:  # a caching step reads the block at ``computed``: it must exist
            msg = f"computed_tokens must be non-negative with prefix caching, got {computed}"
            raise InvalidArgumentError(msg)
        written = computed + new if computed + new < limit else limit
        return allocate_cached(tr, groups, request_id, computed, written, total, reserved, sink,
                               hashes, hit)
    plans: list[tuple[GroupTransient, tuple[BlockId, ...] | None, int, int, int, int]] | None
    plans = None
    for g in groups:  # phase 1: decide, change nothing
        table = g.tables.get(request_id)
        if (table and not reserved and g.grows
                and quiet(g.block_size, g.window, g.may_skip, None, table, computed, total)):
            continue  # the common decode step: no growth, no new skip
        lo, k, nulls, need = plan_group(g, table, computed, total)
        if reserved:
            if need > g.count + (k - lo) - g.policy.num_reserved_blocks(reserved, len(g.tables)):
                return False
        elif need > g.count + (k - lo):
            return False
        if need or nulls or k > lo or table is None:
            if plans is None:
                plans = []
            plans.append((g, table, lo, k, nulls, need))
    if plans is None:
        return True
    for g, table, lo, k, nulls, need in plans:  # phase 2: apply
        apply_plan(g, request_id, table, lo, k, nulls, need, sink)
    return True


def free_into(tr: Transient, request_id: RequestId, manager_keys: Collection[str] | None,
              sink: DeltaBuilder | None) -> None:
    """Release ``request_id`` in the selected groups; unknown ids are a no-op."""
    for g in tr.groups:
        if manager_keys is not None and g.key not in manager_keys:
            continue
        if request_id not in g.tables:
            continue
        table = g.drop_table(request_id)
        ids = [b for b in table if b != NULL_BLOCK] if NULL_BLOCK in table else table
        if g.counts_refs:  # the tail of a prefix is evicted before its head (LRU)
            ids = g.release_blocks(ids[::-1])
        else:
            g.give(ids)
        if sink is not None:
            sink.released.append((g.key, request_id))
            sink.freed.extend(zip(repeat(g.key), ids))


# ----------------------------------------------------------------------------
# the pure API

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
    False and ``state`` is the input object itself.

    With prefix caching (see :func:`lookup_prefix`), ``block_hashes`` lets
    the request's full blocks be cached, and ``prefix_hit`` admits a new
    request with its cached prefix (``computed_tokens`` must equal
    ``prefix_hit.num_tokens``); a hit whose blocks were evicted since the
    lookup is refused.

    >>> from kvfunc.core import FullAttention, KVState
    >>> s = KVState.create({"full": FullAttention(num_blocks=4, block_size=16)}, 1024)
    >>> r = allocate_slots(s, "a", 0, 40)
    >>> r.ok, get_block_ids(r.state, "a")
    (True, {'full': (1, 2, 3)})
    >>> refused = allocate_slots(r.state, "b", 0, 1)
    >>> refused.ok, refused.state is r.state
    (False, True)
    """
    check_request_id(request_id)
    check_manager_keys(manager_keys)
    check_counts(computed_tokens, num_new_tokens, lookahead_tokens, reserved_tokens)
    if block_hashes is not None or prefix_hit is not None:
        check_prefix_args(state, request_id, computed_tokens, manager_keys, block_hashes,
                          prefix_hit)
    if (prefix_hit is None and manager_keys is None and not reserved_tokens
            and _unchanged(state, request_id, computed_tokens, num_new_tokens, lookahead_tokens,
                           block_hashes)):
        return AllocationResult(True, state, EMPTY_DELTA)  # what the full step would give
    tr = Transient(state)
    sink = DeltaBuilder()
    if not allocate_into(tr, request_id, computed_tokens, num_new_tokens, lookahead_tokens,
                         reserved_tokens, manager_keys, sink, block_hashes, prefix_hit):
        return AllocationResult(False, state, EMPTY_DELTA)
    if tr.caching:
        finish_cached(tr, sink)
    return AllocationResult(True, tr.freeze(), sink.build())


def _unchanged(state: KVState, request_id: RequestId, computed: int, new: int,
               lookahead: int, hashes: BlockHashes | None) -> bool:
    """True when the step changes nothing in any group: the common decode step.

    Every group already holds the request's blocks, grows with tokens, has
    nothing slide out of its window, writes no shared block and (with
    ``hashes``) leaves no full block to cache; the full step would return
    the input state and an empty delta.  Read on the published state, so the
    step needs no transient.
    """
    total = computed + new + lookahead
    if new < 0 or total < 0 or computed < 0 or not state.groups:
        return False  # the full step raises the precise error (or does what the seed does)
    limit = state.max_model_len
    written = computed + new if computed + new < limit else limit
    if computed > limit:
        computed = limit
    if total > limit:
        total = limit
    for g in state.groups:
        table = g.tables.get(request_id)
        policy = g.policy
        if not table or not policy.grows_with_tokens:
            return False
        cache = g.cache
        bs = policy.block_size
        if not quiet(bs, policy.window, policy.may_skip, None if cache is None else cache.refs,
                     table, computed, total):
            return False
        if (hashes is not None and cache is not None
                and uncached_full_block(bs, cache.hash_of, table, written, hashes)):
            return False
    return True


def free_request(state: KVState, request_id: RequestId, *,
                 manager_keys: Collection[str] | None = None) -> tuple[KVState, BlocksChanged]:
    """Return every block of a request to the tail of its pool, in logical order.

    Freeing an unknown or already freed request changes nothing.

    >>> from kvfunc.core import FullAttention, KVState
    >>> s = KVState.create({"full": FullAttention(num_blocks=4, block_size=16)}, 1024)
    >>> s2, d = free_request(allocate_slots(s, "a", 0, 20).state, "a")
    >>> d.freed_block_ids, num_free_blocks(s2, "full")
    ((1, 2), 3)
    """
    check_request_id(request_id)
    check_manager_keys(manager_keys)
    tr = Transient(state)
    sink = DeltaBuilder()
    free_into(tr, request_id, manager_keys, sink)
    return tr.freeze(), sink.build()


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
    check_request_id(request_id)
    check_manager_keys(manager_keys)
    if type(computed_tokens) is not int:
        msg = f"computed_tokens must be an int, but got {computed_tokens!r}"
        raise InvalidTypeError(msg)
    computed = min(computed_tokens, state.max_model_len)
    tr = Transient(state)
    sink = DeltaBuilder()
    for g in tr.groups:
        if manager_keys is not None and g.key not in manager_keys:
            continue
        recycle_into(g, request_id, computed, sink)
    return tr.freeze(), sink.build()


def get_block_ids(state: KVState, request_id: RequestId) -> dict[str, tuple[BlockId, ...]]:
    """``{manager_key: block ids}`` of a request in manager order (``()`` when unknown).

    >>> from kvfunc.core import FullAttention, KVState
    >>> get_block_ids(KVState.create({"f": FullAttention(num_blocks=2, block_size=4)}, 8), 7)
    {'f': ()}
    """
    return {g.key: g.tables.get(request_id, ()) for g in state.groups}


def num_free_blocks(state: KVState, manager_key: str) -> int:
    """Free blocks of a group (the null block never counts).

    >>> from kvfunc.core import FullAttention, KVState
    >>> num_free_blocks(KVState.create({"f": FullAttention(num_blocks=5, block_size=4)}, 8), "f")
    4
    """
    return find_group(state.groups, manager_key).num_free


def format_usage(state: KVState) -> str:
    """``"key:used/num_blocks,..."`` in manager order; the null block counts as used.

    >>> from kvfunc.core import FullAttention, KVState
    >>> format_usage(KVState.create({"FullAttention": FullAttention(num_blocks=12,
    ...                                                            block_size=4)}, 8))
    'FullAttention:1/12'
    """
    return usage_string((g.key, g.policy.num_blocks, g.num_free) for g in state.groups)

