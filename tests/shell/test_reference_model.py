"""End to end: a tiny decoder over kvfunc's paged caches gives the dense model's logits.

Eight requests of different lengths are prefilled together, then decoded for
64 steps; two finish part-way and new requests take their place (with pools
sized to the schedule's peak, so the newcomers reuse freed blocks).  Each
step allocates with kvfunc, writes K/V through the slot mappings, reads
earlier tokens through the block tables, and every logit must equal a dense
run of the same model on the same tokens.  Caches start as NaN and the null
block is poisoned with NaN after every step: a read of a block the request
does not own, or of the null block, shows up as NaN.
"""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any, NamedTuple

import pytest
import torch

import kvfunc as kf
from kvfunc.compat import (
    KVCacheManager,
    allocate_cache_tensors,
    create_single_type_managers,
    prepare_block_tables,
    prepare_slot_mapping,
)
from kvfunc.shell import BlockTableBuffer, TinyDecoder, TinyDecoderConfig, with_cache_tensors

CONFIG = TinyDecoderConfig()
PROMPTS = {"r0": 5, "r1": 17, "r2": 1, "r3": 33, "r4": 12, "r5": 26, "r6": 3, "r7": 40}
# Step -> request freed after it, step -> (request, prompt length) admitted in it.  The late
# finish frees more blocks than the rest of the run needs, so its newcomer must reuse some.
FINISH_AFTER = {20: "r3", 60: "r7"}
ARRIVE_AT = {21: ("r8", 30), 61: ("r9", 30)}
NUM_DECODE_STEPS = 64
NUM_PADDING_ROWS = 2  # dummy rows (request id -1) the compat variant adds to every batch


def assert_close(paged: torch.Tensor, dense: torch.Tensor) -> None:
    """fp32 logits agree within 1e-5 (a NaN anywhere fails)."""
    assert paged.shape == dense.shape
    worst = float((paged - dense).abs().max()) if paged.numel() else 0.0
    assert worst <= 1e-5, f"paged and dense logits differ by {worst}"


class Entry(NamedTuple):
    """One request's part of a step: its id, tokens already cached, this step's tokens."""

    request_id: str
    num_cached: int
    tokens: tuple[int, ...]
    history: tuple[int, ...]  # the tokens at positions 0 .. num_cached-1


class Step(NamedTuple):
    """A batch step and the requests freed after it."""

    entries: tuple[Entry, ...]
    freed: tuple[str, ...]


def make_plan(next_n: int, seed: int = 0) -> list[Step]:
    """The whole run, decided up front: tokens, draft acceptance, arrivals and finishes."""
    rng = random.Random(seed)
    vocab = CONFIG.vocab_size
    history: dict[str, list[int]] = {}
    pending: dict[str, list[int]] = {rid: [rng.randrange(vocab) for _ in range(n)]
                                     for rid, n in PROMPTS.items()}
    plan = []
    for step in range(NUM_DECODE_STEPS + 1):
        if step in ARRIVE_AT:
            rid, n = ARRIVE_AT[step]
            pending[rid] = [rng.randrange(vocab) for _ in range(n)]
        entries = []
        for rid, tokens in pending.items():
            done = history.setdefault(rid, [])
            entries.append(Entry(rid, len(done), tuple(tokens), tuple(done)))
            prefill = not done
            accepted = len(tokens) if prefill else 1 + rng.randint(0, next_n)
            done.extend(tokens[:accepted])
            pending[rid] = [rng.randrange(vocab) for _ in range(1 + next_n)]
        freed = (FINISH_AFTER[step],) if step in FINISH_AFTER else ()
        for rid in freed:
            del pending[rid]
        plan.append(Step(tuple(entries), freed))
    return plan


def slot_request(entry: Entry, next_n: int) -> tuple[str, int, int, int]:
    """What the engine asks kvfunc for: the seed's decode call with MTP lookahead."""
    if entry.num_cached == 0:
        return entry.request_id, 0, len(entry.tokens), 0
    return entry.request_id, entry.num_cached, 1 + next_n, max(next_n - 1, 0)


def pool_sizes(plan: list[Step], next_n: int, layout: str = "per-type") -> dict[str, int]:
    """The smallest pools that serve the plan: its peak block use, plus the null block (with
    ``layout="shared"`` every key names the one pool, so all give its size)."""
    big = 10_000
    info = TinyDecoder(CONFIG).cache_info()
    state = kf.KVState.from_cache_info(info, {"FullAttention": big, "SlidingWindow": big},
                                       CONFIG.max_model_len, layout=layout)
    peak = dict.fromkeys(state.manager_keys, 0)
    for step in plan:
        # Request by request: within a step one request may grow before the next recycles.
        for request in (slot_request(e, next_n) for e in step.entries):
            result = kf.allocate_slots(state, *request)
            assert result.ok
            state = result.state
            for key in peak:
                peak[key] = max(peak[key], big - 1 - kf.num_free_blocks(state, key))
        for rid in step.freed:
            state, _ = kf.free_request(state, rid)
    return {key: used + 1 for key, used in peak.items()}


class PureEngine:
    """Allocation with the pure API; tables from a delta-driven BlockTableBuffer."""

    LAYOUT = "layer"  # of the cache tensors

    def __init__(self, model: TinyDecoder, pools: dict[str, int]) -> None:
        info = with_cache_tensors(model.cache_info(), pools, "cpu", layout=self.LAYOUT)
        model.bind_caches(info)
        self.state = kf.KVState.from_cache_info(info, pools, CONFIG.max_model_len)
        self.buffer = BlockTableBuffer.from_state(self.state, max_num_requests=8)

    def allocate(self, requests: list[tuple[str, int, int, int]]) -> None:
        result = kf.allocate_batch(self.state, requests)
        assert () == result.refused
        self.state = result.state
        self.buffer.apply(result.delta)

    def inputs(self, rids: list[str], positions: torch.Tensor, ends: list[int]) -> Any:
        return rids, ends, self.buffer.block_tables(rids), \
            self.buffer.slot_mappings(rids, positions, ends)

    def free(self, rid: str) -> None:
        self.state, delta = kf.free_request(self.state, rid)
        self.buffer.apply(delta)

    def blocks(self, rid: str) -> dict[str, tuple[int, ...]]:
        return kf.get_block_ids(self.state, rid)


class BlockMajorEngine(PureEngine):
    """The pure engine over caches laid out block-major: one buffer per group, a block of
    every layer side by side."""

    LAYOUT = "block"


class CompatEngine:
    """Allocation with the seed-compatible manager; tables rebuilt each step, padded batch."""

    def __init__(self, model: TinyDecoder, pools: dict[str, int]) -> None:
        info = model.cache_info()
        allocate_cache_tensors("cpu", info, pools)
        self.mgr = KVCacheManager(CONFIG.max_model_len, create_single_type_managers(
            info, pools, CONFIG.max_model_len), info)
        self.widths = self.mgr.get_block_table_max_lens(CONFIG.max_model_len)

    def allocate(self, requests: list[tuple[str, int, int, int]]) -> None:
        for rid, cached, new, lookahead in requests:
            assert self.mgr.allocate_slots(rid, cached, new, lookahead)

    def inputs(self, rids: list[str], positions: torch.Tensor, ends: list[int]) -> Any:
        padded = rids + [-1] * NUM_PADDING_ROWS  # the seed's dummy rows, at position 0
        positions = torch.cat([positions, torch.zeros(NUM_PADDING_ROWS, dtype=torch.int64)])
        ends = ends + [ends[-1] + i + 1 for i in range(NUM_PADDING_ROWS)]
        requests = [SimpleNamespace(request_id=rid) for rid in padded]
        tables = prepare_block_tables(requests, self.mgr, self.widths, "cpu", len(padded))
        return padded, ends, tables, prepare_slot_mapping(positions, ends, self.mgr, tables)

    def free(self, rid: str) -> None:
        self.mgr.free(rid)

    def blocks(self, rid: str) -> dict[str, tuple[int, ...]]:
        return {k: tuple(v) for k, v in self.mgr.get_block_ids(rid).items()}


def run(engine_cls: type[PureEngine | CompatEngine], next_n: int) -> dict[str, set[int]]:
    """Run the plan, checking every step's logits; the blocks newcomers reused, per group."""
    plan = make_plan(next_n)
    model = TinyDecoder(CONFIG)
    engine = engine_cls(model, pool_sizes(plan, next_n))
    for cache in model.caches.values():
        cache.fill_(float("nan"))
    held_by_finished: dict[str, set[int]] = {}
    reused: dict[str, set[int]] = {}
    for step in plan:
        engine.allocate([slot_request(e, next_n) for e in step.entries])
        rids = [e.request_id for e in step.entries]
        tokens = [t for e in step.entries for t in e.tokens]
        positions = torch.tensor([e.num_cached + i for e in step.entries
                                  for i in range(len(e.tokens))])
        ends = torch.cumsum(torch.tensor([len(e.tokens) for e in step.entries]), 0).tolist()
        batch_rids, batch_ends, tables, slots = engine.inputs(rids, positions, ends)
        pad = len(batch_rids) - len(rids)
        logits = model.forward_paged(tokens + [0] * pad, torch.cat(
            [positions, torch.zeros(pad, dtype=torch.int64)]), batch_ends, tables, slots)
        start = 0
        for entry, end in zip(step.entries, ends, strict=False):
            dense = model.forward_dense(entry.history + entry.tokens)[entry.num_cached:]
            assert_close(logits[start:end], dense)
            start = end
        for cache in model.caches.values():
            cache[0] = float("nan")  # the null block: nobody may read it
        for rid in step.freed:
            for key, ids in engine.blocks(rid).items():
                held_by_finished.setdefault(key, set()).update(ids)
            engine.free(rid)
        for entry in step.entries:
            if entry.num_cached == 0 and entry.request_id in ("r8", "r9"):
                for key, ids in engine.blocks(entry.request_id).items():
                    reused.setdefault(key, set()).update(
                        set(ids) & held_by_finished.get(key, set()) - {0})
    return reused


@pytest.mark.parametrize("next_n", [0, 2], ids=["decode", "mtp-lookahead"])
@pytest.mark.parametrize("engine_cls", [PureEngine, BlockMajorEngine, CompatEngine],
                         ids=["buffer", "block-major", "compat"])
def test_paged_logits_equal_dense_logits(engine_cls: type[PureEngine | CompatEngine],
                                         next_n: int) -> None:
    """Paged prefill + 64 decode steps match dense attention; newcomers reuse freed blocks."""
    reused = run(engine_cls, next_n)
    assert {"FullAttention": True, "SlidingWindow": True} == {
        key: bool(ids) for key, ids in reused.items()}


def test_a_wrong_block_table_changes_the_logits() -> None:
    """The check has teeth: swapping two requests' table rows makes paged != dense."""
    model = TinyDecoder(CONFIG)
    pools = {"FullAttention": 64, "SlidingWindow": 64}
    engine = PureEngine(model, pools)
    first = [Entry("a", 0, (1, 2, 3, 4, 5), ()), Entry("b", 0, (6, 7, 8, 9, 10), ())]
    engine.allocate([slot_request(e, 0) for e in first])
    positions = torch.tensor([0, 1, 2, 3, 4] * 2)
    _, _, tables, slots = engine.inputs(["a", "b"], positions, [5, 10])
    model.forward_paged([t for e in first for t in e.tokens], positions, [5, 10], tables, slots)
    engine.allocate([("a", 5, 1, 0), ("b", 5, 1, 0)])
    step_pos = torch.tensor([5, 5])
    _, _, tables, slots = engine.inputs(["a", "b"], step_pos, [1, 2])
    swapped = {k: t.flip(0) for k, t in tables.items()}
    logits = model.forward_paged([11, 12], step_pos, [1, 2], swapped, slots)
    dense = model.forward_dense([1, 2, 3, 4, 5, 11])[-1]
    with pytest.raises(AssertionError, match="paged and dense logits differ"):
        assert_close(logits[:1], dense[None])
