"""Transitions for a caller inside kvfunc that may read no delta (``kvfunc.vllm``).

The public transitions (``_transitions``) always build their delta.  These
take ``record``: False opens the working copy with no sink, every primitive
skips its rows, and the outcome's ``delta`` is None (:data:`EMPTY_DELTA`
when nothing changed); the state is the same either way.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, NamedTuple

from kvfunc.core._builder import DeltaBuilder
from kvfunc.core._checks import check_request_id
from kvfunc.core._delta import EMPTY_DELTA, BlocksChanged
from kvfunc.core._errors import InvalidTypeError
from kvfunc.core._owed import pay_into
from kvfunc.core._state import KVState, RequestId, check_state
from kvfunc.core._transitions import _batch, _folded, _freed, _served, allocate_slots

if TYPE_CHECKING:
    from kvfunc.core._hashing import BlockHashes

__all__ = ["Outcome", "busy_slots", "run_batch", "run_free", "run_owed"]


class Outcome(NamedTuple):
    """A transition's outcome for a caller inside kvfunc that may ask for no delta
    (:func:`busy_slots`, :func:`run_batch`, :func:`run_free`): ``delta`` is None when it was
    not recorded; ``refused`` lists a batch's refused requests (a refused call: ``ok`` False).
    """

    ok: bool
    state: KVState
    delta: BlocksChanged | None
    refused: tuple[RequestId, ...] = ()


def busy_slots(state: KVState, request_id: RequestId, computed_tokens: int, num_new_tokens: int,
               lookahead_tokens: int, block_hashes: BlockHashes | None,
               record: bool = True) -> Outcome:
    """:func:`allocate_slots` of a plain call (no reservation, keys or hit) without its quiet
    check, for a caller whose rows usually said already that the call has work
    (``_fold.work_of``; a call with none returns ``state`` all the same).

    ``state`` must be a :class:`KVState`; the entry is checked as the fold checks any, and a
    lookahead that is not an int takes :func:`allocate_slots`' checked path.  With ``record``
    False the transition builds no delta: the outcome's ``delta`` is None (EMPTY_DELTA when
    nothing changed), for a caller that reads none.

    >>> from kvfunc.core import FullAttention, KVState
    >>> s = KVState.create({"full": FullAttention(num_blocks=4, block_size=16)}, 1024)
    >>> r = allocate_slots(s, "a", 0, 20)
    >>> busy_slots(s, "a", 0, 20, 0, None)[:3] == r
    True
    >>> quiet = busy_slots(s, "a", 0, 20, 0, None, record=False)
    >>> quiet.delta, quiet.state.groups == r.state.groups
    (None, True)
    """
    if lookahead_tokens.__class__ is not int:
        r = allocate_slots(state, request_id, computed_tokens, num_new_tokens, lookahead_tokens,
                           block_hashes=block_hashes)
        return _new(Outcome, (r.ok, r.state, r.delta if record or r.state is state else None,
                              ()))
    sink = DeltaBuilder() if record else None
    new = _folded(state, ((request_id, computed_tokens, num_new_tokens),), lookahead_tokens,
                  block_hashes, sink)
    if new is None:
        return _new(Outcome, (False, state, EMPTY_DELTA, ()))
    return _new(Outcome, (True, new, _delta(state, new, sink), ()))


def run_batch(state: KVState, requests: Iterable[Any], record: bool) -> Outcome:
    """:func:`allocate_batch` of ``requests`` (no lookahead, no hash mapping), for a caller
    inside kvfunc; with ``record`` False it builds no delta (the outcome's ``delta`` is None,
    EMPTY_DELTA when nothing changed, as :func:`busy_slots`').

    >>> from kvfunc.core import FullAttention, KVState, get_block_ids
    >>> s = KVState.create({"full": FullAttention(num_blocks=4, block_size=16)}, 1024)
    >>> r = run_batch(s, [("a", 0, 20), ("b", 0, 40)], False)
    >>> r.delta, r.refused, get_block_ids(r.state, "a")
    (None, ('b',), {'full': (1, 2)})
    """
    check_state(state)
    if not isinstance(requests, Iterable):
        msg = f"requests must be an iterable of step entries, got {type(requests).__name__}"
        raise InvalidTypeError(msg)
    sink = DeltaBuilder() if record else None
    new, refused = _batch(state, requests, None, 0, sink)
    return _new(Outcome, (True, new, _delta(state, new, sink), refused))


def run_owed(state: KVState, owed: Iterable[tuple[Any, Any]], record: bool) -> Outcome:
    """:func:`run_batch` of calls owed by ``kvfunc.vllm``, each ``(request, tables)``:
    ``tables`` None for a call that takes nothing (it caches what it fills, lets a window's
    blocks go, or both), else per group the blocks promised to a call that only takes (see
    :mod:`kvfunc.core._owed`).

    The calls whose rows agree skip the step's planning; the others take the fold.  The
    outcome is :func:`run_batch`'s of the requests, ``delta`` as there.

    >>> from kvfunc.core import FullAttention, KVState, SlotRequest, get_block_ids
    >>> s = KVState.create({"full": FullAttention(num_blocks=6, block_size=4)}, 1024)
    >>> s = run_batch(s, [("a", 0, 4), ("b", 0, 4)], False).state
    >>> r = run_owed(s, [(SlotRequest("a", 4, 1), [[3]]), (SlotRequest("b", 4, 1), [[4]])], False)
    >>> r.delta, get_block_ids(r.state, "a"), get_block_ids(r.state, "b")
    (None, {'full': (1, 3)}, {'full': (2, 4)})
    """
    check_state(state)
    if not isinstance(owed, Iterable):
        raise InvalidTypeError(f"owed must be an iterable of (request, tables), got "
                               f"{type(owed).__name__}")
    sink = DeltaBuilder() if record else None
    new, refused = _served(state, sink, pay_into, owed)
    return _new(Outcome, (True, new, _delta(state, new, sink), refused))


def run_free(state: KVState, request_id: RequestId, record: bool
             ) -> tuple[KVState, BlocksChanged | None]:
    """:func:`free_request` of every group at priority 0, for a caller inside kvfunc; with
    ``record`` False it builds no delta (None; EMPTY_DELTA when nothing changed).

    >>> from kvfunc.core import FullAttention, KVState, num_free_blocks
    >>> s = KVState.create({"full": FullAttention(num_blocks=4, block_size=16)}, 1024)
    >>> s2, d = run_free(allocate_slots(s, "a", 0, 20).state, "a", False)
    >>> d, num_free_blocks(s2, "full")
    (None, 3)
    """
    check_state(state)
    check_request_id(request_id)
    sink = DeltaBuilder() if record else None
    new = _freed(state, request_id, None, None, 0, sink)
    return new, _delta(state, new, sink)


def _delta(state: KVState, new: KVState, sink: DeltaBuilder | None) -> BlocksChanged | None:
    """A transition's delta from ``state`` to ``new``: EMPTY_DELTA when nothing changed, None
    when it was not recorded (no ``sink``)."""
    return EMPTY_DELTA if new is state else None if sink is None else sink.build()


_new = tuple.__new__
