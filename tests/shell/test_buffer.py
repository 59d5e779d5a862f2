"""The delta-driven block-table buffer equals a full rebuild after every transition."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kvfunc as kf
from kvfunc import (
    BlocksChanged,
    InvalidArgumentError,
    InvalidTypeError,
    ReplayMismatchError,
    UnknownRequestError,
)
from kvfunc.shell import (
    BlockTableBuffer,
    TableSpec,
    build_block_tables,
    build_slot_mappings,
    specs_from_state,
)
from kvfunc.testing import kv_states, programs, run_program
from kvfunc.testing._strategies import REQUEST_IDS


def padded_rows(state: kf.KVState, key: str, request_ids: tuple[kf.RequestId, ...],
                width: int) -> list[list[int]]:
    """The model: each request's table in ``key``, padded with the null block."""
    tables = state.group(key).tables
    return [list(tables.get(r, ())) + [0] * (width - len(tables.get(r, ())))
            for r in request_ids]


def paged_only(state: kf.KVState) -> kf.KVState:
    """The state without its Mamba groups (whose seed tables raise for short requests)."""
    return kf.KVState(state.max_model_len, state.pools, tuple(g for g in state.groups
                                                              if g.policy.attn_type != "Mamba"))


def registered(state: kf.KVState) -> set[kf.RequestId]:
    """Requests registered in any group."""
    return set(state.request_ids())


def check_against_rebuild(buf: BlockTableBuffer, state: kf.KVState) -> None:
    """Rows, request set and (non-Mamba) tables equal the model and build_block_tables."""
    order = buf.request_ids
    assert registered(state) == set(order)
    assert list(range(len(order))) == [buf.row_of(r) for r in order]
    tables = buf.block_tables()
    widths = {s.key: s.width for s in buf.specs}
    expected = {s.key: padded_rows(state, s.key, order, s.width) for s in buf.specs}
    assert expected == {k: t.tolist() for k, t in tables.items()}
    rebuilt = build_block_tables(paged_only(state), list(order), widths)
    assert {k: t.tolist() for k, t in rebuilt.items()} == {k: tables[k].tolist()
                                                           for k in rebuilt}


@given(kv_states(), st.data())
def test_buffer_equals_rebuild_over_random_programs(state: kf.KVState, data: st.DataObject
                                                    ) -> None:
    """Any program: buffer == rebuild, == a buffer built from that state, slots == rebuilt slots."""
    program = data.draw(programs(state.manager_keys))
    buf = BlockTableBuffer.from_state(state, max_num_requests=len(REQUEST_IDS))
    for step in run_program(state, program):
        buf.apply(step.delta)
        check_against_rebuild(buf, step.after)
        fresh = BlockTableBuffer.from_state(step.after, max_num_requests=len(REQUEST_IDS))
        mine, theirs = buf.block_tables(), fresh.block_tables()
        assert {k: {r: mine[k][buf.row_of(r)].tolist() for r in buf.request_ids}
                for k in mine} == {k: {r: theirs[k][fresh.row_of(r)].tolist()
                                       for r in fresh.request_ids} for k in theirs}
        batch = data.draw(st.lists(st.sampled_from(buf.request_ids), unique=True)
                          if buf.request_ids else st.just([]))
        limit = min((s.width * s.block_size for s in buf.specs if s.has_slots), default=0)
        if not limit:
            continue
        counts = [data.draw(st.integers(0, 3)) for _ in batch]
        positions = data.draw(st.lists(st.integers(0, limit - 1), min_size=sum(counts),
                                       max_size=sum(counts)))
        ends = torch.cumsum(torch.tensor(counts, dtype=torch.int64), 0).tolist()
        widths = {s.key: s.width for s in buf.specs}
        slots = buf.slot_mappings(batch, positions, ends)
        paged = paged_only(step.after)
        tables = build_block_tables(paged, batch, widths)
        rebuilt = build_slot_mappings(paged, tables, positions, ends)
        assert {k: v.tolist() for k, v in rebuilt.items()} == {k: v.tolist()
                                                               for k, v in slots.items()}


@st.composite
def engine_states(draw: st.DrawFn) -> kf.KVState:
    """A hybrid model's fresh state: full attention, a small sliding window, maybe more."""
    sizes = st.sampled_from([1, 2, 4])
    groups: dict[str, kf.Policy] = {
        "full": kf.FullAttention(num_blocks=draw(st.integers(8, 64)), block_size=draw(sizes)),
        "swa": kf.SlidingWindow(num_blocks=draw(st.integers(4, 32)), block_size=draw(sizes),
                                sliding_window=draw(st.integers(1, 12)))}
    if draw(st.booleans()):
        groups["mamba"] = kf.Mamba(num_blocks=draw(st.integers(4, 16)),
                                   next_n=draw(st.integers(0, 2)))
    if draw(st.booleans()):
        groups["compressed"] = kf.FullAttention(num_blocks=draw(st.integers(8, 64)),
                                                block_size=4, compress_ratio=2)
    return kf.KVState.create(groups, draw(st.integers(16, 128)))


# One engine step: a bit mask of the running requests that finish before it, and how
# many requests arrive.  Token counts come from a Hypothesis-controlled Random: drawing
# them one by one would cost more than the test itself.
engine_steps = st.lists(st.tuples(st.integers(0, 255), st.integers(0, 8)), min_size=1,
                        max_size=16)


@given(engine_states(), engine_steps, st.randoms(use_true_random=False))
def test_buffer_equals_rebuild_over_random_engine_steps(
        state: kf.KVState, steps: list[tuple[int, int]], rnd: random.Random) -> None:
    """Arrivals, prefills, decodes with lookahead, finishes: buffer == rebuild after each."""
    buf = BlockTableBuffer.from_state(state, max_num_requests=8)
    computed: dict[int, int] = {}
    next_id = 0
    for finish_mask, arrivals in steps:
        for i, rid in enumerate(list(computed)):
            if finish_mask >> i & 1:
                state, delta = kf.free_request(state, rid)
                buf.apply(delta)
                check_against_rebuild(buf, state)
                del computed[rid]
        for _ in range(min(arrivals, 8 - len(computed))):
            computed[next_id] = 0
            next_id += 1
        batch = [(rid, done, rnd.randint(1, 24) if done == 0 else rnd.randint(1, 4),
                  rnd.randint(0, 2)) for rid, done in computed.items()]
        result = kf.allocate_batch(state, batch)
        state = result.state
        buf.apply(result.delta)
        check_against_rebuild(buf, state)
        for rid, done, new, _ in batch:
            if rid not in result.refused:
                computed[rid] = done + new


def two_groups(max_model_len: int = 64) -> kf.KVState:
    """Full attention (bs 4) and a sliding window of 4 tokens (bs 4), roomy pools."""
    return kf.KVState.create({"full": kf.FullAttention(num_blocks=32, block_size=4),
                              "swa": kf.SlidingWindow(num_blocks=32, block_size=4,
                                                      sliding_window=4)}, max_model_len)


def test_finished_requests_leave_and_the_last_row_fills_the_hole() -> None:
    """Freeing the first request moves the last one into its row; tables move with it."""
    state = two_groups()
    buf = BlockTableBuffer.from_state(state, max_num_requests=3)
    result = kf.allocate_batch(state, [("a", 0, 5), ("b", 0, 3), ("c", 0, 9)])
    buf.apply(result.delta)
    assert ("a", "b", "c") == buf.request_ids
    state, delta = kf.free_request(result.state, "a")
    buf.apply(delta)
    assert (["c", "b"], 0) == (list(buf.request_ids), buf.row_of("c"))
    assert [[4, 5, 6] + [0] * 13, [3] + [0] * 15] == buf.block_tables()["full"].tolist()
    check_against_rebuild(buf, state)


def test_recycled_window_blocks_become_null_entries() -> None:
    """A sliding window's recycled positions are written as the null block."""
    state = two_groups()
    buf = BlockTableBuffer.from_state(state, max_num_requests=2)
    for request in [("a", 0, 8), ("a", 8, 4)]:
        result = kf.allocate_batch(state, [request])
        state = result.state
        buf.apply(result.delta)
    assert [0, 2, 3] == buf.block_tables()["swa"][0, :3].tolist()
    check_against_rebuild(buf, state)


def test_a_delta_that_does_not_fit_changes_nothing() -> None:
    """Too wide a table, too many requests, an unknown request: errors, buffer unchanged."""
    state = two_groups(max_model_len=64)
    buf = BlockTableBuffer(specs_from_state(state, widths=2), max_num_requests=1)
    ok = kf.allocate_batch(state, [("a", 0, 8)])
    buf.apply(ok.delta)
    before = ({k: t.clone() for k, t in buf.block_tables().items()}, buf.request_ids)
    wide = kf.allocate_batch(ok.state, [("a", 8, 4)]).delta
    with pytest.raises(InvalidArgumentError, match="block table for manager_key=full, "
                       "request_id=a exceeds the buffer's width: blocks=3, width=2"):
        buf.apply(wide)
    crowded = kf.allocate_batch(ok.state, [("b", 0, 1)]).delta
    with pytest.raises(InvalidArgumentError, match="all 1 rows of the block-table buffer"):
        buf.apply(crowded)
    stranger = BlocksChanged(order="A", appended_keys=("full",), appended_request_ids=("zz",),
                             appended_block_ids=(9,))
    with pytest.raises(ReplayMismatchError, match="names request 'zz', which has no row"):
        buf.apply(stranger)
    after = ({k: t.clone() for k, t in buf.block_tables().items()}, buf.request_ids)
    assert {k: v.tolist() for k, v in before[0].items()} == {k: v.tolist()
                                                             for k, v in after[0].items()}
    assert before[1] == after[1]


def test_bad_deltas_raise_typed_errors() -> None:
    """Not a delta, another version, a double registration: typed errors."""
    state = two_groups()
    buf = BlockTableBuffer.from_state(state, max_num_requests=2)
    with pytest.raises(InvalidTypeError, match="expected a BlocksChanged or TierDelta delta"):
        buf.apply("delta")  # type: ignore[arg-type]
    with pytest.raises(ReplayMismatchError, match="version 99"):
        buf.apply(BlocksChanged(version=99))
    reg = kf.allocate_batch(state, [("a", 0, 0)]).delta
    buf.apply(reg)
    with pytest.raises(ReplayMismatchError, match="'a' is already registered in 'full'"):
        buf.apply(reg)


def test_groups_the_buffer_does_not_track_are_ignored() -> None:
    """A buffer over one group ignores the other group's rows in a delta."""
    state = two_groups()
    buf = BlockTableBuffer([TableSpec("full", 4, 16)], max_num_requests=2)
    buf.apply(kf.allocate_batch(state, [("a", 0, 9)]).delta)
    assert (["full"], [[1, 2, 3] + [0] * 13]) == (
        list(buf.block_tables()), buf.block_tables()["full"].tolist())


def test_staged_tables_are_copies_that_follow_the_host_tables() -> None:
    """With staging the tables handed out are separate tensors, refreshed on the next read."""
    state = two_groups()
    staged = BlockTableBuffer.from_state(state, 2, staging=True)
    direct = BlockTableBuffer.from_state(state, 2)
    result = kf.allocate_batch(state, [("a", 0, 5)])
    for buf in (staged, direct):
        buf.apply(result.delta)
    first = staged.block_tables()["full"]
    kept = first.clone()
    step = kf.allocate_batch(result.state, [("a", 5, 4)]).delta
    staged.apply(step)
    direct.apply(step)
    assert kept.tolist() == first.tolist()  # the host edit did not reach the handed-out copy
    assert direct.block_tables()["full"].tolist() == staged.block_tables()["full"].tolist()
    assert staged.block_tables()["full"].data_ptr() != staged._host[0].data_ptr()


def test_batches_may_list_requests_in_any_order() -> None:
    """block_tables(ids) and slot_mappings(ids, ...) follow the batch's order, not the rows'."""
    state = two_groups()
    buf = BlockTableBuffer.from_state(state, 2)
    buf.apply(kf.allocate_batch(state, [("a", 0, 5), ("b", 0, 3)]).delta)
    assert [[3], [1]] == buf.block_tables(["b", "a"])["full"][:, :1].tolist()
    assert [3 * 4 + 2, 2 * 4 + 0] == buf.slot_mappings(["b", "a"], [2, 4], [1, 2])[
        "full"].tolist()


@pytest.mark.parametrize(("ids", "positions", "ends", "error", "match"), [
    (["zz"], [0], [1], UnknownRequestError, "request 'zz' has no row"),
    (["a"], [0, 1], [1, 2], InvalidArgumentError, "1 request ids for a batch of 2 rows"),
    (["a"], [-1], [1], InvalidArgumentError, r"position_ids\[0\] = -1"),
    (["a"], [64], [1], InvalidArgumentError, "block_indices out of range for manager_key=full: "
     "max_index=16, block_table_width=16"),
])
def test_slot_mapping_errors(ids: list[str], positions: list[int], ends: list[int],
                             error: type[Exception], match: str) -> None:
    """Unknown requests, mismatched batch sizes, negative or out-of-width positions raise."""
    state = two_groups()
    buf = BlockTableBuffer.from_state(state, 2)
    buf.apply(kf.allocate_batch(state, [("a", 0, 5)]).delta)
    with pytest.raises(error, match=match):
        buf.slot_mappings(ids, positions, ends)


def test_constructor_checks() -> None:
    """Negative capacity, duplicate keys and negative widths are rejected."""
    with pytest.raises(InvalidArgumentError, match="max_num_requests"):
        BlockTableBuffer([], -1)
    with pytest.raises(InvalidArgumentError, match="duplicate manager keys"):
        BlockTableBuffer([TableSpec("f", 4, 2), TableSpec("f", 4, 2)], 1)
    with pytest.raises(InvalidArgumentError, match="table width"):
        BlockTableBuffer([TableSpec("f", 4, -2)], 1)


def test_a_tiered_runs_deltas_keep_the_tables_of_its_device() -> None:
    """Every delta of a tiered run (stores down, a hit from the host tier, its loads) applied
    in order: the tables equal the device state's; moves change no table entry."""
    device = kf.KVState.create({"full": kf.FullAttention(num_blocks=5, block_size=4)}, 64,
                               enable_prefix_caching=True, free_order="vllm")
    state = kf.TieredState.create(device, host_blocks=8)
    buf = BlockTableBuffer.from_state(device, max_num_requests=2)

    def step(result: kf.TieredResult | kf.MovesResult | tuple[kf.TieredState, kf.TierDelta]
             ) -> kf.TieredState:
        new, delta = (result[0], result[1]) if type(result) is tuple else (
            result.state, result.delta)  # type: ignore[union-attr]
        buf.apply(delta)
        check_against_rebuild(buf, new.device)
        return new

    def admit(state: kf.TieredState, rid: str, tokens: list[int]) -> kf.TieredState:
        h = kf.BlockHashes.of(tokens, 4)
        hit = kf.lookup_tiers(state, h, max_tokens=len(tokens) - 1)
        entry = (rid, hit.num_tokens, len(tokens) - hit.num_tokens, 0, 0, None, h, hit)
        return step(kf.allocate_tiered(state, [entry]))

    prompt = list(range(100, 113))
    state = step(kf.free_tiered(admit(state, "a", prompt), "a"))
    state = admit(state, "b", list(range(200, 216)))  # evicts a's blocks: stored to the host
    state = step(kf.complete_moves(state, done=list(state.moves)))
    state = step(kf.free_tiered(state, "b"))
    state = admit(state, "a2", prompt)  # a hit from the host tier: loads into new blocks
    assert "host->device" in {m.direction for m in state.moves.values()}  # (and b's stores)
    state = step(kf.complete_moves(state, done=list(state.moves)))
    assert buf.request_ids == ("a2",)
    with pytest.raises(InvalidTypeError):
        buf.apply(kf.TierDelta(device="junk"))  # type: ignore[arg-type]
