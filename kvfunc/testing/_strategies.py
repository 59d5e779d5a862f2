"""Hypothesis strategies for kvfunc, in one file (like attrs' ``tests/strategies.py``).

Pools are small on purpose: a pool of a dozen blocks runs dry within a few
operations, which is where refusals, reservations and FIFO re-use live.
Token counts are "plausible" (a prefill from 0, then decode steps from the
tokens already computed) with a share of arbitrary jumps, so that sliding
windows slide, tables grow, and the odd request lands past ``max_model_len``.

A *program* is a tuple of operations (plain named tuples, so they print as
valid Python in a falsifying example): :class:`Allocate`, :class:`Batch`,
:class:`Free` and :class:`Recycle`.  :func:`run_program` runs one on the
pure core (here, next to the operations it interprets) and
:func:`kvfunc.testing.apply_to_model` runs an operation on the model.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any, NamedTuple, TypeAlias

import attrs
from hypothesis import strategies as st

from kvfunc import (
    BlocksChanged,
    FullAttention,
    KVState,
    Mamba,
    Policy,
    RequestId,
    SlidingWindow,
    SlotRequest,
    allocate_batch,
    allocate_slots,
    free_request,
    recycle_skipped_blocks,
)

__all__ = [
    "Allocate",
    "Batch",
    "Free",
    "Operation",
    "Recycle",
    "Step",
    "apply_operation",
    "group_configs",
    "kv_states",
    "make_slot_request",
    "manager_key_selections",
    "max_model_lens",
    "policies",
    "programs",
    "request_fields",
    "run_program",
    "slot_requests",
]

#: The built-in attention types.
ATTN_TYPES = ("FullAttention", "SlidingWindow", "Mamba")
#: Manager keys drawn by :func:`group_configs`: the seed's names and free-form ones.
MANAGER_KEYS = ("FullAttention", "SlidingWindow", "Mamba", "full", "swa", "state")
#: A key no generated state has: the seed ignores unknown keys in ``manager_keys``.
UNKNOWN_KEY = "no-such-group"
#: Request ids: the seed uses str ids and ``-1`` for dummy requests.
REQUEST_IDS: tuple[RequestId, ...] = ("a", "b", "c", "d", 0, 1, -1)


class Allocate(NamedTuple):
    """``kvfunc.allocate_slots`` with the fields of one :class:`~kvfunc.SlotRequest`."""

    request: SlotRequest


class Batch(NamedTuple):
    """``kvfunc.allocate_batch`` over one scheduler step."""

    requests: tuple[SlotRequest, ...]


class Free(NamedTuple):
    """``kvfunc.free_request`` (unknown or freed ids are a no-op)."""

    request_id: RequestId
    manager_keys: Collection[str] | None = None


class Recycle(NamedTuple):
    """``kvfunc.recycle_skipped_blocks``."""

    request_id: RequestId
    computed_tokens: int
    manager_keys: Collection[str] | None = None


Operation: TypeAlias = Allocate | Batch | Free | Recycle


def policies(*, max_num_blocks: int = 16, attn_types: Collection[str] = ATTN_TYPES
             ) -> st.SearchStrategy[Policy]:
    """One policy record of one of ``attn_types``, with a small pool.

    ``num_blocks == 1`` (a pool that can never hand out a block) is included.

    >>> from hypothesis import find
    >>> find(policies(), lambda p: p.num_blocks == 1)
    FullAttention(num_blocks=1, block_size=1, compress_ratio=1)
    """
    # A pool of one block (the null block only) refuses everything; keep it
    # possible but rare, or it would refuse most programs of a hybrid state.
    pools = st.integers(2, max(2, max_num_blocks)) | st.integers(1, max_num_blocks)
    block_sizes = st.sampled_from([1, 2, 4, 8, 16])
    full = st.builds(FullAttention, num_blocks=pools, block_size=block_sizes,
                     compress_ratio=st.sampled_from([1, 1, 2, 4]))
    # Windows from 0 (W = 0 works in the seed) to a few blocks.
    swa = st.builds(SlidingWindow, num_blocks=pools, block_size=block_sizes,
                    sliding_window=st.one_of(st.integers(0, 8), st.integers(0, 40)))
    mamba = st.builds(Mamba, num_blocks=pools,
                      block_size=st.sampled_from([1, 1, 4]), next_n=st.integers(0, 3))
    by_type: dict[str, st.SearchStrategy[Any]] = {
        "FullAttention": full, "SlidingWindow": swa, "Mamba": mamba}
    unknown = sorted(set(attn_types) - set(by_type))
    if unknown or not attn_types:
        msg = f"attn_types must be a non-empty subset of {sorted(by_type)}, got {attn_types!r}"
        raise ValueError(msg)
    strategy: st.SearchStrategy[Policy] = st.one_of(
        [by_type[t] for t in by_type if t in attn_types])
    return strategy


def group_configs(*, min_groups: int = 1, max_groups: int = 3, max_num_blocks: int = 16,
                  attn_types: Collection[str] = ATTN_TYPES
                  ) -> st.SearchStrategy[dict[str, Policy]]:
    """``{manager_key: policy}`` with distinct keys and mixed types (hybrid models).

    >>> from hypothesis import given, settings
    >>> @settings(max_examples=20)
    ... @given(group_configs(attn_types=["SlidingWindow"]))
    ... def test_windows(groups):
    ...     assert all(isinstance(p, SlidingWindow) for p in groups.values())
    >>> test_windows()
    """
    pairs = st.tuples(st.sampled_from(MANAGER_KEYS),
                      policies(max_num_blocks=max_num_blocks, attn_types=attn_types))
    return st.lists(pairs, min_size=min_groups, max_size=max_groups,
                    unique_by=lambda pair: pair[0]).map(dict)


def max_model_lens() -> st.SearchStrategy[int]:
    """``max_model_len`` values: mostly roomy, sometimes small enough to clamp.

    >>> from hypothesis import find
    >>> find(max_model_lens(), lambda n: n < 64)
    16
    >>> find(max_model_lens(), lambda n: n < 16)
    0
    """
    return st.one_of(st.just(4096), st.integers(16, 200), st.integers(0, 200))


def layouts() -> st.SearchStrategy[tuple[str, str]]:
    """``(layout, free_order)`` pairs: a pool per type or one shared pool; FIFO or vLLM reuse.

    >>> from hypothesis import find
    >>> find(layouts(), lambda lf: lf[0] == "shared")
    ('shared', 'seed')
    """
    return st.tuples(st.sampled_from(["per-type", "shared"]), st.sampled_from(["seed", "vllm"]))


def shared_sizes(groups: Mapping[str, Policy], layout: str) -> dict[str, Policy]:
    """``groups`` with one ``num_blocks`` (the largest) when they share a pool.

    >>> from kvfunc import FullAttention
    >>> g = shared_sizes({"a": FullAttention(2, 4), "b": FullAttention(5, 4)}, "shared")
    >>> [p.num_blocks for p in g.values()]
    [5, 5]
    """
    if layout != "shared" or not groups:
        return dict(groups)
    n = max(p.num_blocks for p in groups.values())
    return {k: attrs.evolve(p, num_blocks=n) for k, p in groups.items()}  # type: ignore[misc]


def kv_states(groups: st.SearchStrategy[Mapping[str, Policy]] | None = None,
              max_model_len: st.SearchStrategy[int] | None = None,
              layout: st.SearchStrategy[tuple[str, str]] | None = None
              ) -> st.SearchStrategy[KVState]:
    """A fresh :class:`kvfunc.KVState` of :func:`group_configs`, in either layout.

    >>> from hypothesis import given, settings
    >>> @settings(max_examples=20)
    ... @given(kv_states())
    ... def test_fresh(state):
    ...     assert 1 <= len(state.manager_keys) <= 3 and state.request_ids() == ()
    >>> test_fresh()
    """
    def build(g: Mapping[str, Policy], n: int, lf: tuple[str, str]) -> KVState:
        return KVState.create(shared_sizes(g, lf[0]), n, layout=lf[0], free_order=lf[1])

    return st.builds(build, groups if groups is not None else group_configs(),
                     max_model_len if max_model_len is not None else max_model_lens(),
                     layout if layout is not None else layouts())


def manager_key_selections(manager_keys: Sequence[str] = MANAGER_KEYS
                           ) -> st.SearchStrategy[Collection[str] | None]:
    """``manager_keys`` arguments: ``None`` (all), ``()``, subsets, unknown keys.

    >>> from hypothesis import find
    >>> find(manager_key_selections(["full"]), lambda keys: keys is not None and len(keys) == 2)
    ('full', 'no-such-group')
    """
    return _key_selections(tuple(manager_keys))


# True about once in four draws (shrinks to False).
_ONE_IN_FOUR = st.integers(0, 3).map(lambda i: i == 3)

# Strategies are cached per argument tuple: the state machine draws requests
# in every step, and building and validating fresh strategy objects there
# costs more than the allocator under test.
@functools.lru_cache(maxsize=128)
def _key_selections(manager_keys: tuple[str, ...]) -> st.SearchStrategy[Collection[str] | None]:
    names = st.sampled_from([*manager_keys, UNKNOWN_KEY])
    subsets = st.lists(names, max_size=len(manager_keys) + 1, unique=True).map(tuple)
    # Mostly None (every group, the common call): a selection that names no
    # group of the state makes the call a no-op.  (``one_of`` would merge
    # repeated branches, so the weight comes from a separate draw.)
    selection: st.SearchStrategy[Collection[str] | None] = st.tuples(
        _ONE_IN_FOUR, subsets).map(lambda t: t[1] if t[0] else None)
    return selection


RequestFields: TypeAlias = tuple[int, int, int, int, Collection[str] | None]


@functools.lru_cache(maxsize=1024)
def request_fields(manager_keys: tuple[str, ...], max_tokens: int = 96, decode: bool = False
                   ) -> st.SearchStrategy[RequestFields]:
    """``(computed, new, lookahead, reserved, manager_keys)`` for :func:`make_slot_request`.

    A prefill-like draw starts mostly from 0 computed tokens, otherwise
    anywhere (past ``max_model_len`` too); a continuing one (``decode``)
    asks for 0-4 new tokens or a prefill chunk, and its ``computed`` is
    replaced by the request's position.  With no
    ``manager_keys`` the selection is always ``None``.

    >>> from hypothesis import given, settings
    >>> @settings(max_examples=20)
    ... @given(request_fields(("full",), max_tokens=8))
    ... def test_fields(fields):
    ...     computed, new, lookahead, reserved, keys = fields
    ...     assert 0 <= new <= 8 and -2 <= lookahead <= 3 and 0 <= reserved <= 4
    >>> test_fields()
    """
    computed = st.one_of(st.just(0), st.integers(0, max_tokens))
    short = st.integers(0, max_tokens // 4)
    # Short prompts are common so that small pools hold several requests; a
    # continuing request is a decode step (1, or 1 + next_n with MTP) or a
    # chunk of a chunked prefill, which slides a window by several blocks.
    new = st.one_of(st.integers(0, 4), short) if decode else st.one_of(
        short, st.integers(0, max_tokens))
    reserved = st.tuples(_ONE_IN_FOUR, st.integers(0, max(1, max_tokens // 2))).map(
        lambda t: t[1] if t[0] else 0)
    keys = _key_selections(manager_keys) if manager_keys else st.none()
    return st.tuples(computed, new, st.integers(-2, 3), reserved, keys)


def make_slot_request(request_id: RequestId, fields: RequestFields,
                      computed_tokens: int | None = None) -> SlotRequest:
    """A valid request from drawn fields (``computed_tokens`` overrides theirs).

    ``lookahead`` may be negative, but never so much that the total
    ``computed + new + lookahead`` is (that raises, as a negative
    ``num_new_tokens`` does).

    >>> make_slot_request("a", (0, 1, -2, 0, None))
    SlotRequest(request_id='a', computed_tokens=0, num_new_tokens=1, lookahead_tokens=-1,
                reserved_tokens=0, manager_keys=None, block_hashes=None, prefix_hit=None)
    """
    computed, new, lookahead, reserved, keys = fields
    if computed_tokens is not None:
        computed = computed_tokens
    return SlotRequest(request_id, computed, new, max(lookahead, -(computed + new)), reserved,
                       keys)


def slot_requests(request_ids: st.SearchStrategy[RequestId] | None = None,
                  manager_keys: Sequence[str] = (), *, max_tokens: int = 96,
                  computed_tokens: int | None = None) -> st.SearchStrategy[SlotRequest]:
    """A valid :class:`kvfunc.SlotRequest`: it never raises in ``allocate_slots``.

    Pass ``computed_tokens`` to draw a decode-like step from a known position.
    ``manager_keys`` are the state's keys; ``None``, ``()`` and an unknown
    key are drawn too.  Counts are as :func:`request_fields` describes.

    >>> import kvfunc as kf
    >>> from hypothesis import given, settings
    >>> state = kf.KVState.create({"full": kf.FullAttention(num_blocks=8, block_size=4)}, 64)
    >>> @settings(max_examples=20)
    ... @given(slot_requests(manager_keys=state.manager_keys))
    ... def test_never_raises(r):
    ...     kf.allocate_slots(state, r.request_id, r.computed_tokens, r.num_new_tokens,
    ...                       r.lookahead_tokens, reserved_tokens=r.reserved_tokens,
    ...                       manager_keys=r.manager_keys)
    >>> test_never_raises()
    """
    ids = request_ids if request_ids is not None else st.sampled_from(REQUEST_IDS)
    fields = request_fields(tuple(manager_keys), max_tokens, computed_tokens is not None)
    return st.tuples(ids, fields).map(lambda t: make_slot_request(t[0], t[1], computed_tokens))


@st.composite
def programs(draw: st.DrawFn, manager_keys: Sequence[str] = MANAGER_KEYS, *,
             request_ids: Sequence[RequestId] = REQUEST_IDS, max_ops: int = 16,
             max_tokens: int = 96) -> tuple[Operation, ...]:
    """A program: allocations, batches, frees and recycles over a few request ids.

    The draw tracks how many tokens each request has computed, so most
    allocations continue a request like a scheduler would (prefill, then
    decode steps) and recycles happen at its position.  A batch holds each
    request id at most once, as a scheduler step does (``allocate_batch``
    rejects a repeated id).

    >>> from hypothesis import find
    >>> find(programs(["full"], max_ops=2), lambda p: any(isinstance(op, Free) for op in p))
    (Free(request_id='a', manager_keys=None),)
    """
    tokens: dict[RequestId, int] = {}
    ids = st.sampled_from(list(request_ids))
    keys_tuple = tuple(manager_keys)

    def request(rid: RequestId) -> SlotRequest:
        known = tokens.get(rid)
        decode = known is not None and draw(st.booleans())
        fields = draw(request_fields(keys_tuple, max_tokens, decode))
        req = make_slot_request(rid, fields, known if decode else None)
        # Assume the engine computes what it asked for (refusals are rare).
        tokens[rid] = req.computed_tokens + req.num_new_tokens
        return req

    program: list[Operation] = []
    for _ in range(draw(st.integers(0, max_ops))):
        kind = draw(st.sampled_from(["allocate", "allocate", "allocate", "batch", "free",
                                     "recycle"]))
        rid = draw(ids)
        keys = draw(_key_selections(keys_tuple))
        if kind == "allocate":
            program.append(Allocate(request(rid)))
        elif kind == "batch":
            rids = draw(st.lists(ids, max_size=4, unique=True))
            program.append(Batch(tuple(request(r) for r in rids)))
        elif kind == "free":
            tokens.pop(rid, None)
            program.append(Free(rid, draw(st.sampled_from([None, None, keys]))))
        else:
            computed = draw(st.one_of(st.just(tokens.get(rid, 0)),
                                      st.integers(0, max_tokens + 8)))
            program.append(Recycle(rid, computed, keys))
    return tuple(program)


class Step(NamedTuple):
    """One operation of a program on the core: the states around it, its delta."""

    before: KVState
    after: KVState
    delta: BlocksChanged
    refused: tuple[RequestId, ...]


def apply_operation(state: KVState, op: Operation) -> Step:
    """Run one program operation on the pure core.

    >>> import kvfunc as kf
    >>> s = kf.KVState.create({"f": kf.FullAttention(num_blocks=3, block_size=4)}, 64)
    >>> apply_operation(s, Allocate(kf.SlotRequest("a", 0, 9))).refused
    ('a',)
    """
    if isinstance(op, Allocate):
        r = op.request
        res = allocate_slots(state, r.request_id, r.computed_tokens, r.num_new_tokens,
                             r.lookahead_tokens, reserved_tokens=r.reserved_tokens,
                             manager_keys=r.manager_keys)
        return Step(state, res.state, res.delta, () if res.ok else (r.request_id,))
    if isinstance(op, Batch):
        batch = allocate_batch(state, op.requests)
        return Step(state, batch.state, batch.delta, batch.refused)
    if isinstance(op, Free):
        after, delta = free_request(state, op.request_id, manager_keys=op.manager_keys)
        return Step(state, after, delta, ())
    if isinstance(op, Recycle):
        after, delta = recycle_skipped_blocks(state, op.request_id, op.computed_tokens,
                                              manager_keys=op.manager_keys)
        return Step(state, after, delta, ())
    raise TypeError(f"not a program operation: {op!r}")


def run_program(state: KVState, program: Iterable[Operation]) -> list[Step]:
    """Run a program on the core, each operation on the previous one's state.

    >>> import kvfunc as kf
    >>> s = kf.KVState.create({"f": kf.FullAttention(num_blocks=4, block_size=4)}, 64)
    >>> steps = run_program(s, [Allocate(kf.SlotRequest("a", 0, 5)), Free("a")])
    >>> kf.replay(s, [step.delta for step in steps]) == steps[-1].after
    True
    """
    steps = []
    for op in program:
        step = apply_operation(state, op)
        steps.append(step)
        state = step.after
    return steps
