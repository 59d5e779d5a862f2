"""The pure core and the naive model, driven side by side by Hypothesis.

Theory of operation
-------------------
:class:`KVStateMachine` keeps the current :class:`kvfunc.KVState` and a
:class:`~kvfunc.testing.NaiveAllocator` built from the same groups.  Every
rule performs one operation on both (``allocate_slots``, ``allocate_batch``,
``free_request``, ``recycle_skipped_blocks``), and the invariants, checked
after every step, compare everything observable: registrations, block ids,
free counts, free-queue order, ``format_usage``.  On top of the model they
check what only a pure function promises: the state a transition started
from is unchanged (its plain-tuple :func:`state_snapshot` is taken when it
becomes current and compared afterwards), a refusal returns the very input
object, and the deltas are a complete log (``replay(initial, deltas)`` is
the current state).

Engine integrators reuse it: subclass it, override the ``*_strategy`` class
attributes to use their own groups, and :meth:`KVStateMachine.after_transition`
to check their own layer (for example that applying each delta to their
cache tensors keeps them consistent); then run ``MyMachine.TestCase`` under
pytest or :func:`run_state_machine`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from hypothesis import HealthCheck, event, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import kvfunc as kf
from kvfunc import BlocksChanged, KVState, Policy, RequestId, SlotRequest
from kvfunc.testing._model import NaiveAllocator
from kvfunc.testing._strategies import (
    group_configs,
    layouts,
    make_slot_request,
    manager_key_selections,
    max_model_lens,
    request_fields,
    shared_sizes,
)

__all__ = [
    "KVStateMachine",
    "run_state_machine",
    "state_snapshot",
    "token_budget",
]

Snapshot = tuple[Any, ...]


def state_snapshot(state: KVState) -> Snapshot:
    """Everything observable about ``state`` as plain nested tuples (a frozen copy).

    Two snapshots are equal when the states hold the same tables (in the same
    order), the same free queue and ring, the same row counters, and print the
    same usage; a snapshot cannot change when the state is later (wrongly)
    mutated.

    >>> s = kf.KVState.create({"f": kf.FullAttention(num_blocks=4, block_size=4)}, 64)
    >>> snap = state_snapshot(s)
    >>> _ = kf.allocate_slots(s, "a", 0, 9)
    >>> state_snapshot(s) == snap, snap[2][0][3]
    (True, (1, 2, 3))
    """
    groups = tuple((g.key, g.policy, g.pool, tuple(g.tables.items()),
                    tuple((rid, row[1:4]) for rid, row in sorted(g.rows.items(),
                                                                 key=lambda kv: kv[1].seq)))
                   for g in state.groups)
    pools = tuple((p.name, p.members, p.num_blocks, p.free_block_ids(), p.num_free,
                   _queue_cells(p), None if p.refs is None else tuple(p.refs),
                   None if p.hash_of is None else tuple(p.hash_of),
                   tuple(sorted(p.detached.items())))
                  for p in state.pools)
    return state.max_model_len, groups, pools, kf.format_usage(state)


def _queue_cells(pool: Any) -> tuple[Any, ...]:
    """Every cell of a pool's free queue, so that a mutation of any of them shows."""
    queue = pool.queue
    if not pool.linked:
        return tuple(queue.chunks), queue.head, queue.count
    with pool.reading() as store:
        return tuple(store.prev), tuple(store.next), queue.count, queue.levels


def token_budget(state: KVState, max_tokens: int = 96) -> int:
    """Largest prompt worth drawing for ``state``: about what its tightest pool holds.

    Token counts far beyond every pool only produce refusals, so the machine
    scales them to the smallest token capacity of a group whose tables grow
    (a sliding window whose window fits its pool is not a limit), between 8
    and ``max_tokens``.

    >>> s = kf.KVState.create({"f": kf.FullAttention(num_blocks=5, block_size=4),
    ...                        "m": kf.Mamba(num_blocks=3)}, 4096)
    >>> token_budget(s)
    16
    """
    budget = max_tokens
    for g in state.groups:
        p = g.policy
        if not p.grows_with_tokens:
            continue
        usable = p.num_blocks - 1
        window = p.window
        if window is not None and window // p.block_size + 2 <= usable:
            continue  # a prefill needs at most this many blocks, whatever its length
        budget = min(budget, usable * p.block_size)
    return max(8, budget)


def _outcome(call: Callable[[], Any]) -> tuple[Any, ValueError | None]:
    """``(result, None)``, or ``(None, error)`` when ``call()`` raises a ValueError."""
    try:
        return call(), None
    except ValueError as exc:  # every caller error the spec names is a ValueError
        return None, exc


class KVStateMachine(RuleBasedStateMachine):
    """Runs :mod:`kvfunc`'s pure core and :class:`NaiveAllocator` side by side.

    Class attributes are the knobs a subclass sets: ``groups_strategy``,
    ``max_model_len_strategy`` and ``layout_strategy`` (the configurations to
    explore: ``(layout, free_order)`` pairs),
    ``max_tokens`` (token counts per request), ``replay_every`` (how often
    the whole delta log is replayed; always at teardown),
    and ``check_batches_sequentially`` (each batch also equals
    ``allocate_slots`` one request at a time).
    """

    groups_strategy: ClassVar[st.SearchStrategy[Mapping[str, Policy]]] = group_configs()
    max_model_len_strategy: ClassVar[st.SearchStrategy[int]] = max_model_lens()
    layout_strategy: ClassVar[st.SearchStrategy[tuple[str, str]]] = layouts()
    max_tokens: ClassVar[int] = 96
    replay_every: ClassVar[int] = 8
    check_batches_sequentially: ClassVar[bool] = True

    request_ids: Bundle[RequestId] = Bundle("request_ids")

    def __init__(self) -> None:
        super().__init__()
        self.initial = self.state = KVState.create({}, 0)
        self.model = NaiveAllocator({}, 0)
        self.snapshot = state_snapshot(self.state)
        self.previous: tuple[KVState, Snapshot] | None = None
        self.history: list[tuple[KVState, Snapshot]] = []
        self.deltas: list[BlocksChanged] = []
        self.tokens: dict[RequestId, int] = {}  # tokens each live request has computed
        self.seen: dict[RequestId, None] = {}
        self.num_steps = 0
        self.token_budget = self.max_tokens

    # -- hooks ----------------------------------------------------------------
    def after_transition(self, before: KVState, after: KVState, delta: BlocksChanged) -> None:
        """Called after every accepted transition; override to check your own layer."""

    # -- bookkeeping ------------------------------------------------------------
    def _fresh_id(self) -> RequestId:
        n = len(self.seen)
        rid: RequestId = f"r{n}" if n % 3 else n  # str and int ids, as the seed allows
        self.seen[rid] = None
        return rid

    def _commit(self, after: KVState, delta: BlocksChanged) -> None:
        before = self.state
        if delta.is_empty:
            assert before == after, f"an empty delta changed the state: {before!r} -> {after!r}"
        self.previous = (before, self.snapshot)
        self.state, self.snapshot = after, state_snapshot(after)
        self.history.append((after, self.snapshot))
        self.deltas.append(delta)
        self.num_steps += 1
        # Coverage notes: ``pytest --hypothesis-show-statistics`` shows how often
        # the interesting cases happen (a strategy change can silently lose them).
        if len(delta.nulled_positions) > 1:
            event("recycled several blocks at once")
        if any(p.num_free == 0 and p.num_blocks > 1 for p in after.pools):
            event("a pool ran dry")
        self.after_transition(before, after, delta)

    def _keys(self, data: st.DataObject) -> Any:
        return data.draw(manager_key_selections(self.state.manager_keys), label="manager_keys")

    def _request(self, data: st.DataObject, rid: RequestId, decode: bool) -> SlotRequest:
        known = self.tokens.get(rid) if decode else None
        fields = data.draw(request_fields(self.state.manager_keys, self.token_budget,
                                          known is not None), label=f"request {rid!r}")
        req = make_slot_request(rid, fields, known)
        note(repr(req))  # a failing example then shows the exact call
        return req

    def _allocate(self, req: SlotRequest) -> None:
        before = self.state
        self.seen[req.request_id] = None
        res, error = _outcome(lambda: kf.allocate_slots(
            before, req.request_id, req.computed_tokens, req.num_new_tokens,
            req.lookahead_tokens, reserved_tokens=req.reserved_tokens,
            manager_keys=req.manager_keys))
        ok, model_error = _outcome(lambda: self.model.allocate_slots(*req[:6]))
        assert (model_error is None) == (error is None), f"core {error!r}, model {model_error!r}"
        if error is not None:
            return  # the core cannot have touched ``before``; the invariants check the model
        assert ok == res.ok, f"{req!r}: core ok={res.ok}, model ok={ok}"
        event("allocate_slots accepted" if res.ok else "allocate_slots refused")
        if res.ok:
            self._commit(res.state, res.delta)
            self.tokens[req.request_id] = req.computed_tokens + req.num_new_tokens
        else:
            assert res.state is before, "a refusal must return the input state object"
            assert res.delta.is_empty, f"a refusal produced a delta: {res.delta!r}"

    # -- rules ------------------------------------------------------------------
    @initialize(data=st.data())
    def init_state(self, data: st.DataObject) -> None:
        """Draw the groups and ``max_model_len``; build the core state and the model."""
        layout, order = data.draw(self.layout_strategy, label="layout")
        groups = shared_sizes(data.draw(self.groups_strategy, label="groups"), layout)
        max_model_len = data.draw(self.max_model_len_strategy, label="max_model_len")
        self.initial = self.state = KVState.create(groups, max_model_len, layout=layout,
                                                   free_order=order)
        self.model = NaiveAllocator(groups, max_model_len, layout=layout, free_order=order)
        self.snapshot = state_snapshot(self.state)
        self.token_budget = token_budget(self.state, self.max_tokens)

    @initialize(target=request_ids)
    def first_request_id(self) -> RequestId:
        """An id to start from, so that rules drawing ids are enabled from step one."""
        return self._fresh_id()

    @rule(target=request_ids, data=st.data())
    def admit(self, data: st.DataObject) -> RequestId:
        """A new request: usually a prefill from 0 tokens."""
        rid = self._fresh_id()
        self._allocate(self._request(data, rid, decode=False))
        return rid

    @rule(rid=request_ids, data=st.data())
    def allocate(self, rid: RequestId, data: st.DataObject) -> None:
        """A valid ``allocate_slots`` for a known (maybe freed) request, often continuing it."""
        self._allocate(self._request(data, rid, decode=data.draw(st.booleans())))

    @precondition(lambda self: bool(self.tokens))
    @rule(data=st.data())
    def decode(self, data: st.DataObject) -> None:
        """A decode step of a live request, from the tokens it has computed."""
        live = list(self.tokens)
        rid = live[data.draw(st.integers(0, len(live) - 1), label="live request")]
        self._allocate(self._request(data, rid, decode=True))

    @rule(rid=request_ids, data=st.data())
    def allocate_invalid(self, rid: RequestId, data: st.DataObject) -> None:
        """Counts that are often invalid: a negative ``num_new_tokens`` or total raises in both."""
        new = data.draw(st.integers(-3, 2), label="num_new_tokens")
        lookahead = data.draw(st.integers(-8, 0), label="lookahead_tokens")
        computed = data.draw(st.integers(0, 4), label="computed_tokens")
        self._allocate(SlotRequest(rid, computed, new, lookahead, 0, self._keys(data)))

    @precondition(lambda self: bool(self.bundle("request_ids")))
    @rule(rids=st.lists(request_ids, max_size=4), fresh=st.booleans(), data=st.data())
    def batch(self, rids: list[RequestId], fresh: bool, data: st.DataObject) -> None:
        """One ``allocate_batch`` step, compared with the model (and sequential calls)."""
        rids = list(dict.fromkeys(rids))  # a step names each request once
        if fresh:
            rids.append(self._fresh_id())
        requests = tuple(self._request(data, rid, decode=data.draw(st.booleans()))
                         for rid in rids)
        before = self.state
        res = kf.allocate_batch(before, requests)
        assert self.model.allocate_batch(requests) == res.refused
        if self.check_batches_sequentially:
            state, refused = before, []
            for r in requests:
                one = kf.allocate_slots(state, r.request_id, r.computed_tokens, r.num_new_tokens,
                                        r.lookahead_tokens, reserved_tokens=r.reserved_tokens,
                                        manager_keys=r.manager_keys)
                state = one.state
                if not one.ok:
                    refused.append(r.request_id)
            assert tuple(refused) == res.refused
            assert state == res.state, "allocate_batch differs from sequential allocate_slots"
            assert res.state == kf.replay(before, [res.delta]), "a batch delta does not replay"
        self._commit(res.state, res.delta)
        for r in requests:
            if r.request_id not in res.refused:
                self.tokens[r.request_id] = r.computed_tokens + r.num_new_tokens

    @rule(rid=consumes(request_ids))
    def free(self, rid: RequestId) -> None:
        """``free_request`` in every group; the id leaves the bundle."""
        self._free(rid, None)

    @rule(rid=request_ids, data=st.data())
    def free_some_groups(self, rid: RequestId, data: st.DataObject) -> None:
        """``free_request`` restricted by ``manager_keys``; the id may come back."""
        self._free(rid, self._keys(data))

    def _free(self, rid: RequestId, keys: Any) -> None:
        after, delta = kf.free_request(self.state, rid, manager_keys=keys)
        self.model.free(rid, keys)
        if keys is None or set(keys) >= set(self.state.manager_keys):
            self.tokens.pop(rid, None)
        self._commit(after, delta)

    @rule(rid=request_ids, data=st.data())
    def recycle(self, rid: RequestId, data: st.DataObject) -> None:
        """``recycle_skipped_blocks`` at the request's position or anywhere."""
        computed = data.draw(st.one_of(st.just(self.tokens.get(rid, 0)),
                                       st.integers(0, self.max_tokens + 8)),
                             label="computed_tokens")
        keys = self._keys(data)
        after, delta = kf.recycle_skipped_blocks(self.state, rid, computed, manager_keys=keys)
        self.model.remove_skipped_blocks(rid, computed, keys)
        self._commit(after, delta)

    # -- invariants ---------------------------------------------------------------
    @invariant()
    def core_invariants_hold(self) -> None:
        """``kvfunc.check_invariants``: conservation, no duplicates, null prefixes."""
        kf.check_invariants(self.state)

    @invariant()
    def registrations_match_model(self) -> None:
        """Every group registers the same requests (empty lists count for reservations)."""
        for key in self.state.manager_keys:
            assert self.model.registered_request_ids(key) == set(self.state.group(key).tables)

    @invariant()
    def block_ids_match_model(self) -> None:
        """Every request ever named holds the model's block ids, in every group."""
        for rid in (*self.seen, *self.state.request_ids()):
            assert self.model.get_block_ids(rid) == kf.get_block_ids(self.state, rid), rid

    @invariant()
    def pools_match_model(self) -> None:
        """Free counts, free-queue order (FIFO, tail re-entry) and usage strings agree."""
        for key in self.state.manager_keys:
            assert self.model.num_free_blocks(key) == kf.num_free_blocks(self.state, key)
            assert self.model.free_block_ids(key) == self.state.pool_of(key).free_block_ids()
        assert self.model.format_usage() == kf.format_usage(self.state)

    @invariant()
    def previous_state_unchanged(self) -> None:
        """The state the last transition started from still reads as it did."""
        if self.previous is not None:
            before, snapshot = self.previous
            assert snapshot == state_snapshot(before), "a transition mutated its input"

    @precondition(lambda self: self.num_steps % self.replay_every == 0)
    @invariant()
    def deltas_replay_to_state(self) -> None:
        """``replay(initial, deltas)`` reproduces the current state."""
        assert self.state == kf.replay(self.initial, self.deltas)

    def teardown(self) -> None:
        """Replay the whole log, and check no state of the run was ever mutated."""
        if self.deltas:
            assert self.state == kf.replay(self.initial, self.deltas)
        for state, snapshot in self.history:
            assert snapshot == state_snapshot(state), "a kept state was mutated"


def run_state_machine(machine: type[RuleBasedStateMachine] = KVStateMachine, *,
                      max_examples: int | None = None,
                      stateful_step_count: int | None = None) -> None:
    """Run a state machine as a test under the current settings profile.

    Arguments left ``None`` come from the loaded Hypothesis profile.  As in
    ``RuleBasedStateMachine.TestCase``, the deadline and the health checks
    are off: a step's time depends on the pool sizes drawn.

    >>> run_state_machine(max_examples=3, stateful_step_count=5)
    """
    base = settings()
    run_state_machine_as_test(machine, settings=settings(
        base, deadline=None, suppress_health_check=list(HealthCheck),
        max_examples=base.max_examples if max_examples is None else max_examples,
        stateful_step_count=(base.stateful_step_count if stateful_step_count is None
                             else stateful_step_count)))
