"""The shell over caching states: prefix hits, forks and copy-on-write, end to end.

Three layers of evidence:

* the delta-driven :class:`BlockTableBuffer` equals a rebuild from the state
  after every transition of random caching programs (hits, forks,
  copy-on-write, saved states, frees, cache resets);
* a symbolic cache: every slot holds a number that names the token prefix
  it was computed from, every state block the prefix its state summarises;
  after :func:`apply_delta` each running request must find exactly its own
  prefix's numbers (shared blocks kept, copies done before new blocks are
  zeroed, a state saved right after its copy-on-write saved from the copy);
* the tiny decoder: requests that share a system prompt, admitted with
  prefix hits, and forked requests continued with different tokens give the
  logits of a dense run of their own tokens.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import NamedTuple

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kvfunc as kf
from kvfunc import COPY_INTO_NEW, COPY_SAVED, BlocksChanged, ReplayMismatchError
from kvfunc.shell import (
    BlockTableBuffer,
    TinyDecoder,
    TinyDecoderConfig,
    apply_delta,
    build_block_tables,
    cache_tensors_by_key,
    with_cache_tensors,
    with_shared_cache_tensors,
)

HASH_BLOCK = 2  # hashes' block size: divides every group block size below


# -- random caching programs ------------------------------------------------------------------

class Req:
    """A running request: all its known tokens, how many are computed, their block hashes."""

    __slots__ = ("computed", "hashes", "tokens")

    def __init__(self, tokens: list[int], computed: int, hashes: kf.BlockHashes) -> None:
        self.tokens, self.computed, self.hashes = tokens, computed, hashes


class Ran(NamedTuple):
    """One request's part of an allocation step: its tokens, computed before, new now."""

    request_id: str
    tokens: tuple[int, ...]
    computed: int
    new: int


class Transition(NamedTuple):
    """A transition's result and, for an allocation step, the requests it ran."""

    state: kf.KVState
    delta: BlocksChanged
    ran: tuple[Ran, ...]


def caching_state(rnd: random.Random) -> kf.KVState:
    """Full attention, a sliding window and a Mamba state over small pools, caching on."""
    sizes = [2, 4]
    groups: dict[str, kf.Policy] = {
        "full": kf.FullAttention(num_blocks=rnd.randint(14, 40), block_size=rnd.choice(sizes)),
        "swa": kf.SlidingWindow(num_blocks=rnd.randint(10, 30), block_size=rnd.choice(sizes),
                                sliding_window=rnd.randint(2, 9)),
        "mamba": kf.Mamba(num_blocks=rnd.randint(6, 14), block_size=rnd.choice([2, 4, 8]),
                          next_n=rnd.choice([0, 0, 1]))}
    return kf.KVState.create(groups, 64, enable_prefix_caching=True)


def caching_program(state: kf.KVState, rnd: random.Random, num_steps: int
                    ) -> Iterator[Transition]:
    """Random scheduler steps: frees, forks, resets, admissions with prefix hits, decodes.

    Prompts start with one of a few shared prefixes or with an earlier
    request's tokens (a later turn), and are prefilled in random chunks.
    """
    vocab = 3
    earlier = [[rnd.randrange(vocab) for _ in range(rnd.randint(4, 16))] for _ in range(3)]
    reqs: dict[str, Req] = {}
    next_id = 0
    for _ in range(num_steps):
        for rid in [r for r in reqs if rnd.random() < 0.15 or reqs[r].computed > 44]:
            state, delta = kf.free_request(state, rid)
            earlier.append(reqs.pop(rid).tokens)
            yield Transition(state, delta, ())
        if reqs and rnd.random() < 0.3 and len(reqs) < 7:
            parent = rnd.choice(list(reqs))
            p = reqs[parent]
            if p.computed:
                child = f"r{next_id}"
                next_id += 1
                state, delta = kf.fork_request(state, parent, child)
                prefix = p.tokens[:p.computed]  # the parent's hashes may cover more tokens
                reqs[child] = Req(prefix, p.computed, kf.BlockHashes.of(prefix, HASH_BLOCK))
                yield Transition(state, delta, ())
        if rnd.random() < 0.03:
            state, delta = kf.reset_prefix_cache(state)
            yield Transition(state, delta, ())
        batch: list[kf.SlotRequest] = []
        for rid, r in reqs.items():
            new = min(len(r.tokens) - r.computed, rnd.randint(1, 6)) or rnd.randint(1, 4)
            while len(r.tokens) < r.computed + new:
                r.tokens.append(rnd.randrange(vocab))
            r.hashes = r.hashes.update(r.tokens[:r.computed + new])
            batch.append(kf.SlotRequest(rid, r.computed, new, block_hashes=r.hashes))
        admitted: dict[str, Req] = {}
        for _ in range(rnd.randint(0, 2) if len(reqs) < 6 else 0):
            prompt = list(rnd.choice(earlier))[:rnd.randint(2, 24)]
            prompt += [rnd.randrange(vocab) for _ in range(rnd.randint(0, 6))]
            hashes = kf.BlockHashes.of(prompt, HASH_BLOCK)
            hit = kf.lookup_prefix(state, hashes, max_tokens=len(prompt) - 1)
            rid = f"r{next_id}"
            next_id += 1
            admitted[rid] = Req(prompt, hit.num_tokens, hashes)
            new = min(len(prompt) - hit.num_tokens, rnd.randint(1, 8))
            batch.append(kf.SlotRequest(rid, hit.num_tokens, new, block_hashes=hashes,
                                        prefix_hit=hit))
        rnd.shuffle(batch)
        result = kf.allocate_batch(state, batch)
        state = result.state
        reqs.update((rid, r) for rid, r in admitted.items() if rid not in result.refused)
        ran = []
        for b in batch:
            if b.request_id not in result.refused:
                r = reqs[b.request_id]
                ran.append(Ran(b.request_id, tuple(r.tokens), b.computed_tokens,
                               b.num_new_tokens))
                r.computed += b.num_new_tokens
        yield Transition(state, result.delta, tuple(ran))


# -- the block-table buffer ---------------------------------------------------------------------

def check_buffer(buf: BlockTableBuffer, state: kf.KVState) -> None:
    """Rows are the registered requests; tables equal the state's and a rebuild's."""
    order = buf.request_ids
    assert set(state.request_ids()) == set(order)
    tables = {k: t.tolist() for k, t in buf.block_tables().items()}
    for spec in buf.specs:
        held = state.group(spec.key).tables
        assert tables[spec.key] == [list(held.get(r, ())) + [0] * (spec.width - len(
            held.get(r, ()))) for r in order]
    paged = kf.KVState(state.max_model_len, state.pools, tuple(g for g in state.groups
                                                   if g.policy.attn_type != "Mamba"))
    rebuilt = build_block_tables(paged, list(order), {s.key: s.width for s in buf.specs})
    assert {k: t.tolist() for k, t in rebuilt.items()} == {k: tables[k] for k in rebuilt}


@given(st.randoms(use_true_random=False))
def test_buffer_equals_rebuild_over_random_caching_programs(rnd: random.Random) -> None:
    """Hits, forks, copy-on-write, saved states, frees, resets: buffer == rebuild after each."""
    state = caching_state(rnd)
    buf = BlockTableBuffer.from_state(state, max_num_requests=16)
    for step in caching_program(state, rnd, 20):
        buf.apply(step.delta)
        check_buffer(buf, step.state)


def test_copy_on_write_replaces_the_table_entry() -> None:
    """A fork's first write gives the writer the copy: only its row changes, at that position."""
    state = kf.KVState.create({"full": kf.FullAttention(num_blocks=8, block_size=4)}, 32,
                              enable_prefix_caching=True)
    buf = BlockTableBuffer.from_state(state, max_num_requests=2)
    result = kf.allocate_slots(state, "p", 0, 6)
    buf.apply(result.delta)
    state, delta = kf.fork_request(result.state, "p", "c")
    buf.apply(delta)
    delta = kf.allocate_slots(state, "c", 6, 1).delta
    buf.apply(delta)
    assert ((1,), (2,), (3,)) == (delta.copied_positions, delta.copied_src_block_ids,
                                  delta.copied_dst_block_ids)
    assert [[1, 2] + [0] * 6, [1, 3] + [0] * 6] == buf.block_tables()["full"].tolist()


def test_a_copy_that_does_not_fit_the_buffer_changes_nothing() -> None:
    """A copy-on-write naming a wrong source or a position past the table raises; no edit."""
    state = kf.KVState.create({"full": kf.FullAttention(num_blocks=8, block_size=4)}, 32,
                              enable_prefix_caching=True)
    buf = BlockTableBuffer.from_state(state, max_num_requests=2)
    buf.apply(kf.allocate_slots(state, "p", 0, 6).delta)
    before = buf.block_tables()["full"].tolist()

    def cow(pos: int, src: int) -> BlocksChanged:
        return BlocksChanged(order="AC", appended_keys=("full",), appended_request_ids=("p",),
                             appended_block_ids=(5,), copied_keys=("full",),
                             copied_request_ids=("p",), copied_positions=(pos,),
                             copied_src_block_ids=(src,), copied_dst_block_ids=(6,))

    with pytest.raises(ReplayMismatchError, match="replaces block 1, but the table holds 2"):
        buf.apply(cow(1, 1))
    with pytest.raises(ReplayMismatchError, match="position 3 of 'p' in 'full' is past its"):
        buf.apply(cow(3, 1))
    with pytest.raises(ReplayMismatchError, match="are not parallel"):
        buf.apply(BlocksChanged(order="C", copied_keys=("full",), copied_request_ids=("p",),
                                copied_src_block_ids=(1,), copied_dst_block_ids=(6,)))
    assert before == buf.block_tables()["full"].tolist()
    buf.apply(cow(2, 5))  # the appended block itself is copied away in the same delta
    assert [1, 2, 6, 0] == buf.block_tables()["full"][0, :4].tolist()


# -- a symbolic cache ---------------------------------------------------------------------------

def prefix_values(tokens: tuple[int, ...]) -> list[float]:
    """``values[p]``: a number naming ``tokens[:p + 1]`` (never 0, exact in float64)."""
    out, v = [], 0
    for t in tokens:
        v = (v * 1_000_003 + t + 1) % (1 << 47)
        out.append(float(v + 1))
    return out


class SymbolicCache:
    """One float64 per slot (paged groups) or per state block (Mamba), numbered by prefix."""

    def __init__(self, state: kf.KVState) -> None:
        self.tensors = {g.key: torch.full((g.policy.num_blocks, 1 if g.policy.attn_type ==
                                           "Mamba" else g.policy.block_size), float("nan"),
                                          dtype=torch.float64) for g in state.groups}

    def run_step(self, state: kf.KVState, ran: Ran) -> None:
        """Check the request finds its prefix in its blocks, then write this step's entries."""
        values = prefix_values(ran.tokens)
        c, end = ran.computed, ran.computed + ran.new
        for g in state.groups:
            t, table, policy = self.tensors[g.key], g.tables[ran.request_id], g.policy
            if policy.attn_type == "Mamba":
                held = float(t[table[0], 0])
                assert held == (values[c - 1] if c else 0.0), (g.key, ran)
                t[table[0], 0] = values[end - 1]
                continue
            bs = policy.block_size
            window = getattr(policy, "sliding_window", None)
            first = 0 if window is None else max(0, c - window + 1)
            for p in range(first, c):
                assert table[p // bs], (g.key, ran, p)
                assert float(t[table[p // bs], p % bs]) == values[p], (g.key, ran, p)
            for p in range(c, end):
                t[table[p // bs], p % bs] = values[p]


    def check_saved(self, delta: BlocksChanged, ran: tuple[Ran, ...]) -> None:
        """Every state saved into the cache (and still cached) is the saver's state before the step.

        A saved block that the same step handed out again is evicted after its stored
        operation and is a new, zeroed block of its new owner.
        """
        computed = {r.request_id: prefix_values(r.tokens)[r.computed - 1] for r in ran}
        cached: set[tuple[str, int]] = set()
        for op in delta.operations():
            if isinstance(op, kf.core.Stored):
                cached.add((op.key, op.block_id))
            elif isinstance(op, kf.core.Evicted):
                cached.discard((op.key, op.block_id))
        last = {(key, dst): rid for key, rid, pos, dst in zip(  # a block may be saved into twice
            delta.copied_keys, delta.copied_request_ids, delta.copied_positions,
            delta.copied_dst_block_ids, strict=True) if pos == COPY_SAVED}
        for (key, dst), rid in last.items():
            if (key, dst) in cached:
                assert float(self.tensors[key][dst, 0]) == computed[rid], (key, rid, dst)


def copy_hazards(delta: BlocksChanged) -> dict[str, int]:
    """What makes a delta's copies delicate: kinds of copies, chains, reused sources."""
    shared = set(zip(delta.shared_keys, delta.shared_block_ids, strict=True))
    new = {(k, b) for k, b in zip(delta.appended_keys, delta.appended_block_ids, strict=True)
           if b and (k, b) not in shared}
    written: set[tuple[str, int]] = set()
    out = dict.fromkeys(["cow", "into_new", "saved", "chained", "source_reused"], 0)
    for key, pos, src, dst in zip(delta.copied_keys, delta.copied_positions,
                                  delta.copied_src_block_ids, delta.copied_dst_block_ids,
                                  strict=True):
        kind = {COPY_INTO_NEW: "into_new", COPY_SAVED: "saved"}.get(pos, "cow")
        out[kind] += 1
        out["chained"] += (key, src) in written
        out["source_reused"] += (key, src) in new and (key, src) not in written
        written.add((key, dst))
    return out


def test_copies_and_zeroing_keep_every_request_on_its_own_prefix() -> None:
    """Random caching programs over a symbolic cache: every step reads its own prefix."""
    seen = dict.fromkeys(["cow", "into_new", "saved", "chained", "source_reused"], 0)
    for seed in range(40):
        rnd = random.Random(seed)
        state = caching_state(rnd)
        cache = SymbolicCache(state)
        for step in caching_program(state, rnd, 30):
            apply_delta({k: [t] for k, t in cache.tensors.items()}, step.delta,
                        zero_new_blocks=True)
            cache.check_saved(step.delta, step.ran)
            for ran in step.ran:
                cache.run_step(step.state, ran)
            for kind, n in copy_hazards(step.delta).items():
                seen[kind] += n
    assert all(seen.values()), seen


def test_a_state_saved_after_its_copy_on_write_is_saved_from_the_copy() -> None:
    """Fork, then both write: the parent's saved state is read from its fresh copy."""
    state = kf.KVState.create({"full": kf.FullAttention(num_blocks=16, block_size=4),
                               "mamba": kf.Mamba(num_blocks=8, block_size=4)}, 64,
                              enable_prefix_caching=True)
    tokens = list(range(8))
    hashes = kf.BlockHashes.of(tokens, 4)
    state = kf.allocate_slots(state, "p", 0, 8, block_hashes=hashes).state
    state, _ = kf.fork_request(state, "p", "c")
    mamba = torch.zeros(8, 1)
    mamba[kf.get_block_ids(state, "p")["mamba"][0]] = 7.0
    result = kf.allocate_batch(state, [
        kf.SlotRequest("p", 8, 1, block_hashes=hashes.update([*tokens, 100])),
        kf.SlotRequest("c", 8, 1, block_hashes=hashes.update([*tokens, 200]))])
    # The parent copies the shared state, then saves its copy; the child then holds the
    # original alone and writes it in place.
    assert (0, COPY_SAVED) == result.delta.copied_positions
    apply_delta({"full": [torch.zeros(16, 1)], "mamba": [mamba]}, result.delta)
    assert [7.0] * 2 == mamba[list(result.delta.copied_dst_block_ids), 0].tolist()


def test_a_copy_source_handed_out_in_the_same_step_is_copied_before_it_is_zeroed() -> None:
    """A hit's saved state seeds its request's block; then the pool hands it out and zeroes it."""
    state = kf.KVState.create({"full": kf.FullAttention(num_blocks=32, block_size=2),
                               "mamba": kf.Mamba(num_blocks=4, block_size=2)}, 64,
                              enable_prefix_caching=True)
    a, b = [1, 2, 3, 4], [9, 9, 9]
    ha, hb = kf.BlockHashes.of(a, 2), kf.BlockHashes.of(b, 2)
    state = kf.allocate_batch(state, [kf.SlotRequest("a", 0, 4, block_hashes=ha),
                                      kf.SlotRequest("b", 0, 3, block_hashes=hb)]).state
    state = kf.allocate_batch(state, [  # a saves its state at 4 tokens into block 3
        kf.SlotRequest("a", 4, 1, block_hashes=ha.update([*a, 5])),
        kf.SlotRequest("b", 3, 1, block_hashes=hb.update([*b, 5]))]).state
    state, _ = kf.free_request(state, "a")
    hc = kf.BlockHashes.of([*a, 7], 2)
    hit = kf.lookup_prefix(state, hc, max_tokens=4)
    result = kf.allocate_batch(state, [
        kf.SlotRequest("c", 4, 1, block_hashes=hc, prefix_hit=hit),
        kf.SlotRequest("d", 0, 2, block_hashes=kf.BlockHashes.of([8, 8], 2))])
    d = result.delta
    # c takes block 1 (freed by a, holding nothing cached); d then takes the saved block 3
    assert (("c",), (COPY_INTO_NEW,), (3,), (1,)) == (
        d.copied_request_ids, d.copied_positions, d.copied_src_block_ids, d.copied_dst_block_ids)
    assert {"c": (1,), "d": (3,)} == {r: kf.get_block_ids(result.state, r)["mamba"]
                                       for r in ("c", "d")}
    mamba = torch.arange(5.0).view(5, 1)
    apply_delta({"full": [torch.zeros(32, 1)], "mamba": [mamba]}, d, zero_new_blocks=True)
    assert [0.0, 3.0, 2.0, 0.0, 4.0] == mamba[:, 0].tolist()


# -- the tiny decoder ---------------------------------------------------------------------------

CONFIG = TinyDecoderConfig(sliding_window=6)


class Engine:
    """A caching state, the model's caches, a block-table buffer; deltas applied to both."""

    def __init__(self, pools: dict[str, int], zero_new_blocks: bool,
                 layout: str = "per-type") -> None:
        self.model = TinyDecoder(CONFIG)
        if layout == "shared":  # one pool: the groups' tensors overlay each other
            (num_blocks,) = set(pools.values())
            info = with_shared_cache_tensors(self.model.cache_info(), num_blocks, "cpu")
        else:
            info = with_cache_tensors(self.model.cache_info(), pools, "cpu")
        self.model.bind_caches(info)
        for cache in self.model.caches.values():
            cache.fill_(float("nan"))
        self.tensors = cache_tensors_by_key(info)
        self.state = kf.KVState.from_cache_info(info, pools, CONFIG.max_model_len,
                                                enable_prefix_caching=True, layout=layout)
        self.buffer = BlockTableBuffer.from_state(self.state, max_num_requests=8)
        self.zero_new_blocks = zero_new_blocks
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.hashes: dict[str, kf.BlockHashes] = {}
        self.hits: dict[str, kf.PrefixHit] = {}
        self.deltas: list[BlocksChanged] = []

    def commit(self, state: kf.KVState, delta: BlocksChanged) -> None:
        apply_delta(self.tensors, delta, zero_new_blocks=self.zero_new_blocks)
        self.buffer.apply(delta)
        self.state = state
        self.deltas.append(delta)

    def admit(self, rid: str, prompt: list[int]) -> kf.PrefixHit:
        """Look the prompt up; the next step computes what the hit does not cover."""
        hashes = kf.BlockHashes.of(prompt, CONFIG.block_size)
        hit = kf.lookup_prefix(self.state, hashes, max_tokens=len(prompt) - 1)
        self.tokens[rid], self.computed[rid], self.hashes[rid] = list(prompt), -1, hashes
        self.hits[rid] = hit
        return hit

    def fork(self, parent: str, child: str) -> None:
        self.commit(*kf.fork_request(self.state, parent, child))
        done = self.computed[parent]
        self.tokens[child] = self.tokens[parent][:done]
        self.computed[child] = done
        self.hashes[child] = kf.BlockHashes.of(self.tokens[child], CONFIG.block_size)

    def free(self, rid: str) -> None:
        self.commit(*kf.free_request(self.state, rid))
        del self.tokens[rid], self.computed[rid], self.hashes[rid]

    def step(self, appended: dict[str, list[int]], chunk: int | None = None) -> None:
        """Allocate, run one paged batch, and compare every request with its dense run.

        Each named request gets ``appended`` tokens and computes all its
        pending tokens, or at most ``chunk`` of them (chunked prefill).
        """
        batch, entries = [], []
        for rid, more in appended.items():
            self.tokens[rid] += more
            hit = self.hits.pop(rid, None)  # an admission: the hit is already computed
            done = self.computed[rid] if hit is None else hit.num_tokens
            end = len(self.tokens[rid]) if chunk is None else min(len(self.tokens[rid]),
                                                                  done + chunk)
            hashes = self.hashes[rid] = self.hashes[rid].update(self.tokens[rid][:end])
            batch.append(kf.SlotRequest(rid, done, end - done, block_hashes=hashes,
                                        prefix_hit=hit))
            entries.append((rid, done, end))
        result = kf.allocate_batch(self.state, batch)
        assert () == result.refused
        self.commit(result.state, result.delta)
        rids = [rid for rid, _, _ in entries]
        tokens = [t for rid, done, end in entries for t in self.tokens[rid][done:end]]
        positions = torch.tensor([p for _, done, end in entries for p in range(done, end)])
        ends = torch.cumsum(torch.tensor([end - done for _, done, end in entries]), 0).tolist()
        logits = self.model.forward_paged(tokens, positions, ends, self.buffer.block_tables(rids),
                                          self.buffer.slot_mappings(rids, positions, ends))
        start = 0
        for (rid, done, end), stop in zip(entries, ends, strict=True):
            dense = self.model.forward_dense(self.tokens[rid][:end])[done:]
            worst = float((logits[start:stop] - dense).abs().max())
            assert worst <= 1e-5, f"{rid}: paged and dense logits differ by {worst}"
            self.computed[rid] = end
            start = stop
        for cache in self.model.caches.values():
            cache[0] = float("nan")  # the null block: nobody may read it


def tokens_of(seed: int, n: int) -> list[int]:
    """``n`` reproducible random token ids."""
    rnd = random.Random(seed)
    return [rnd.randrange(CONFIG.vocab_size) for _ in range(n)]


@pytest.mark.parametrize("zero_new_blocks", [True, False], ids=["zeroed", "stale"])
def test_requests_sharing_a_system_prompt_hit_and_match_dense_runs(
        zero_new_blocks: bool) -> None:
    """Prefix hits on full, sliding-window and latent layers give each request's dense logits."""
    engine = Engine({"FullAttention": 40, "SlidingWindow": 24}, zero_new_blocks)
    system = tokens_of(0, 22)
    engine.admit("a", system + tokens_of(1, 5))
    engine.step({"a": []}, chunk=20)  # chunked prefill: the window before 20 gets cached
    hits = {}
    for i, rid in enumerate(["b", "c"]):
        hits[rid] = engine.admit(rid, system + tokens_of(2 + i, 3 + 4 * i)).num_tokens
    engine.step({"a": [], "b": [], "c": []})
    for n in range(6):
        engine.step({rid: tokens_of(20 + n, 1) for rid in ("a", "b", "c")})
    engine.free("a")
    engine.free("b")  # their blocks stay cached, free: the next hit takes them back
    hits["d"] = engine.admit("d", system + tokens_of(1, 5) + tokens_of(20, 1) + [7]).num_tokens
    hits["e"] = engine.admit("e", system + tokens_of(2, 1)).num_tokens  # b's prompt, shorter
    engine.step({"c": tokens_of(30, 1), "d": [], "e": []})
    for n in range(8):  # long enough that the pools hand out freed cached blocks again
        engine.step({rid: tokens_of(40 + n, 2) for rid in ("c", "d", "e")})
    assert {"b": 20, "c": 20, "d": 28, "e": 20} == hits
    stats = kf.PrefixCacheStats.of(engine.deltas)
    assert (5, 88) == (stats.queries, stats.hit_tokens)
    assert any(d.shared_keys for d in engine.deltas)
    assert any(d.evicted_keys for d in engine.deltas)


@pytest.mark.parametrize("zero_new_blocks", [True, False], ids=["zeroed", "stale"])
def test_forked_requests_continue_with_their_own_tokens(zero_new_blocks: bool) -> None:
    """Parallel sampling: forks share the prompt, copy-on-write gives each its own dense logits."""
    engine = Engine({"FullAttention": 40, "SlidingWindow": 30}, zero_new_blocks)
    system = tokens_of(0, 12)
    engine.admit("p", system + tokens_of(1, 6))
    engine.step({"p": []})
    engine.fork("p", "c1")
    engine.fork("p", "c2")
    for n in range(7):
        engine.step({rid: tokens_of(100 * i + n, 1) for i, rid in enumerate(["p", "c1", "c2"])})
    engine.fork("c1", "g")  # a fork of a fork, mid-block
    engine.admit("q", system + tokens_of(1, 6) + tokens_of(0, 1))  # hits the parent's prompt
    engine.step({"g": tokens_of(7, 3), "c1": tokens_of(8, 2), "q": []})
    for n in range(5):
        engine.step({rid: tokens_of(200 * i + n, 1 + i % 2)
                     for i, rid in enumerate(["p", "c1", "c2", "g", "q"])})
    cows = [pos for d in engine.deltas for pos in d.copied_positions if pos >= 0]
    assert len(cows) >= 4  # the forks' shared partial blocks, in both paged groups


def test_a_missing_copy_changes_the_logits() -> None:
    """The check has teeth: dropping the copy-on-write copies makes a fork's logits differ."""
    engine = Engine({"FullAttention": 40, "SlidingWindow": 30}, zero_new_blocks=True)
    engine.admit("p", tokens_of(0, 10))
    engine.step({"p": []})
    engine.fork("p", "c")

    def commit_without_copies(state: kf.KVState, delta: BlocksChanged) -> None:
        assert delta.copied_keys
        engine.buffer.apply(delta)  # the tables follow the copies, the tensors do not
        engine.state = state

    engine.commit = commit_without_copies  # type: ignore[method-assign]
    with pytest.raises(AssertionError, match="paged and dense logits differ"):
        engine.step({"p": tokens_of(1, 1), "c": tokens_of(2, 1)})

