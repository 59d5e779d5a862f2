"""Properties of the pure core over generated states and programs (``kvfunc.testing``)."""

import copy

from hypothesis import given
from hypothesis import strategies as st

import kvfunc as kf
from kvfunc.core import GroupState
from kvfunc.testing import (
    Allocate,
    Batch,
    NaiveAllocator,
    Operation,
    apply_operation,
    apply_to_model,
    group_configs,
    kv_states,
    policies,
    programs,
    run_program,
    slot_requests,
    state_snapshot,
    token_budget,
)

StateAndProgram = tuple[kf.KVState, tuple[Operation, ...]]


def with_program(state: kf.KVState) -> st.SearchStrategy[StateAndProgram]:
    """``(state, program)``: a program over the state's keys, prompts sized to its pools."""
    return st.tuples(st.just(state),
                     programs(state.manager_keys, max_tokens=token_budget(state)))


states_and_programs = kv_states().flatmap(with_program)


def rebuilt(state: kf.KVState) -> kf.KVState:
    """An equal state that shares no container with ``state`` (a pre-call copy)."""
    return copy.deepcopy(state)


def held_blocks(group: GroupState) -> int:
    """Non-null table entries of a group, counted from the tables themselves."""
    return sum(1 for table in group.tables.values() for block in table if block != kf.NULL_BLOCK)


@given(states_and_programs)
def test_transitions_never_modify_their_input(state_and_program: StateAndProgram) -> None:
    """Every transition leaves its input state equal to a pre-call copy, tables and queue alike."""
    state, program = state_and_program
    for op in program:
        copy, snapshot = rebuilt(state), state_snapshot(state)
        after = apply_operation(state, op).after
        assert copy == state
        assert snapshot == state_snapshot(state)
        state = after


@given(states_and_programs)
def test_blocks_are_conserved(state_and_program: StateAndProgram) -> None:
    """After every step, free + held == num_blocks - 1 in each group (null block excluded)."""
    state, program = state_and_program
    for step in run_program(state, program):
        for j, pool in enumerate(step.after.pools):
            held = sum(held_blocks(g) for g in step.after.groups if g.pool == j)
            assert pool.num_blocks - 1 == pool.num_free + held
            assert len(set(pool.free_block_ids())) == pool.num_free


@given(states_and_programs)
def test_replaying_the_deltas_gives_the_final_state(state_and_program: StateAndProgram) -> None:
    """``replay(initial, deltas)`` equals the final state, and each delta replays its step."""
    state, program = state_and_program
    steps = run_program(state, program)
    final = steps[-1].after if steps else state
    assert final == kf.replay(state, [step.delta for step in steps])
    for step in steps:
        assert step.after == kf.replay(step.before, [step.delta])


@given(states_and_programs, st.data())
def test_batch_equals_sequential_allocate_slots(state_and_program: StateAndProgram,
                                                data: st.DataObject) -> None:
    """``allocate_batch`` gives the state and refusals of ``allocate_slots`` called in order."""
    state, program = state_and_program
    steps = run_program(state, program)
    state = steps[-1].after if steps else state
    one = slot_requests(manager_keys=state.manager_keys, max_tokens=token_budget(state))
    requests = data.draw(st.lists(one, max_size=5, unique_by=lambda r: r.request_id))
    sequential = run_program(state, [Allocate(r) for r in requests])
    batch = apply_operation(state, Batch(tuple(requests)))
    assert (sequential[-1].after if sequential else state) == batch.after
    assert tuple(rid for step in sequential for rid in step.refused) == batch.refused


# Any groups plus a full-attention group "guard", and room for any prompt.
guarded_states = kv_states(
    st.tuples(group_configs(), policies(attn_types=["FullAttention"])).map(
        lambda t: {**t[0], "guard": t[1]}),
    st.just(4096))


@given(guarded_states.flatmap(with_program))
def test_refusal_returns_the_input_state_object(state_and_program: StateAndProgram) -> None:
    """A refused ``allocate_slots`` returns the very input object and an empty delta."""
    state, program = state_and_program
    steps = run_program(state, program)
    state = steps[-1].after if steps else state
    guard = state.group("guard").policy
    # A new request for a whole pool's worth of blocks: more than can ever be free.
    res = kf.allocate_slots(state, "huge", 0, guard.num_blocks * guard.block_size)
    assert (False, True, True) == (res.ok, res.state is state, res.delta.is_empty)


@given(states_and_programs)
def test_refused_steps_of_a_program_change_nothing(state_and_program: StateAndProgram) -> None:
    """Each refused single allocation of a program returns its input object unchanged."""
    state, program = state_and_program
    for step, op in zip(run_program(state, program), program, strict=True):
        if isinstance(op, Allocate) and step.refused:
            assert step.before is step.after
            assert step.delta.is_empty


@given(states_and_programs)
def test_programs_match_the_naive_model(state_and_program: StateAndProgram) -> None:
    """Every step of a program refuses and hands out exactly what the model does."""
    state, program = state_and_program
    groups = {g.key: g.policy for g in state.groups}
    order = "seed" if not state.pools or state.pools[0].refs is None else "vllm"
    model = NaiveAllocator(groups, state.max_model_len, layout=state.layout, free_order=order)
    for op, step in zip(program, run_program(state, program), strict=True):
        assert apply_to_model(model, op) == step.refused
        for rid in step.after.request_ids():
            assert model.get_block_ids(rid) == kf.get_block_ids(step.after, rid)
        for key in state.manager_keys:
            assert model.free_block_ids(key) == step.after.pool_of(key).free_block_ids()
