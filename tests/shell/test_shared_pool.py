"""End to end on a shared pool: overlaid cache tensors never clobber each other.

Every group draws its ids from one pool and its cache tensors overlay the
other groups' (one buffer per layer slot).  The tiny decoder (a full, a
sliding-window and a latent layer) runs over them and must give the logits
of a dense run:

* decoding with arrivals and finishes, a pool sized to the schedule's peak,
  so that blocks a group gives back are handed to the other group; every
  free block is poisoned with NaN after each step, so a read of a block the
  group does not hold shows up;
* prefix caching: requests sharing a system prompt hit both groups' cached
  blocks, forks continue with copy-on-write, cached blocks are evicted and
  handed to the other group;
* random caching programs over a symbolic cache whose groups' tensors are
  views of one buffer: every request finds its own prefix after the copies
  and zeroing of each delta.

The check has teeth: a per-type state (ids that collide across groups) over
the same overlaid tensors gives different logits.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kvfunc as kf
from kvfunc.shell import (
    BlockTableBuffer,
    TinyDecoder,
    apply_delta,
    with_shared_cache_tensors,
)

sys.path.insert(0, str(Path(__file__).parent))
from test_prefix_shell import (
    Engine,
    SymbolicCache,
    caching_program,
    check_buffer,
    tokens_of,
)
from test_reference_model import (
    CONFIG,
    NUM_DECODE_STEPS,
    PureEngine,
    assert_close,
    make_plan,
    pool_sizes,
    slot_request,
)

KEYS = ("FullAttention", "SlidingWindow")


def shared_pool_size(next_n: int) -> int:
    """The smallest shared pool that serves the decode plan: its peak use, plus the null block."""
    sizes = pool_sizes(make_plan(next_n), next_n, layout="shared")
    assert len(set(sizes.values())) == 1  # one pool: every key reads its free count
    return sizes[KEYS[0]]


class SharedEngine(PureEngine):
    """One pool for both groups, overlaid tensors, tables from a BlockTableBuffer."""

    def __init__(self, model: TinyDecoder, num_blocks: int, layout: str = "shared") -> None:
        info = with_shared_cache_tensors(model.cache_info(), num_blocks, "cpu")
        model.bind_caches(info)
        self.model = model
        self.state = kf.KVState.from_cache_info(info, dict.fromkeys(KEYS, num_blocks),
                                                CONFIG.max_model_len, layout=layout)
        self.buffer = BlockTableBuffer.from_state(self.state, max_num_requests=8)

    def poison_free_blocks(self) -> None:
        """NaN into the null block and every free block, through every view."""
        free = sorted({0} | {b for p in self.state.pools for b in p.free_block_ids()})
        for cache in self.model.caches.values():
            cache[free] = float("nan")


def run_decode(layout: str, next_n: int) -> dict[int, set[str]]:
    """Run the decode plan, checking every step's logits; which groups held each block id."""
    plan = make_plan(next_n)
    engine = SharedEngine(TinyDecoder(CONFIG), shared_pool_size(next_n), layout)
    model = engine.model
    holders: dict[int, set[str]] = {}
    engine.poison_free_blocks()
    for step in plan:
        engine.allocate([slot_request(e, next_n) for e in step.entries])
        rids = [e.request_id for e in step.entries]
        tokens = [t for e in step.entries for t in e.tokens]
        positions = torch.tensor([e.num_cached + i for e in step.entries
                                  for i in range(len(e.tokens))])
        ends = torch.cumsum(torch.tensor([len(e.tokens) for e in step.entries]), 0).tolist()
        logits = model.forward_paged(tokens, positions, ends, engine.buffer.block_tables(rids),
                                     engine.buffer.slot_mappings(rids, positions, ends))
        start = 0
        for entry, end in zip(step.entries, ends, strict=True):
            dense = model.forward_dense(entry.history + entry.tokens)[entry.num_cached:]
            assert_close(logits[start:end], dense)
            start = end
        for rid in rids:
            for key, ids in kf.get_block_ids(engine.state, rid).items():
                for b in ids:
                    holders.setdefault(b, set()).add(key)
        for rid in step.freed:
            engine.free(rid)
        engine.poison_free_blocks()
    return holders


@pytest.mark.parametrize("next_n", [0, 2], ids=["decode", "mtp-lookahead"])
def test_paged_logits_equal_dense_logits_on_a_shared_pool(next_n: int) -> None:
    """Prefill + 64 decode steps match dense attention; block ids pass from group to group."""
    assert NUM_DECODE_STEPS == 64
    holders = run_decode("shared", next_n)
    both = [b for b, keys in holders.items() if b and len(keys) == 2]
    assert len(both) >= 4, holders  # ids the window gave back, reused by full attention


def test_ids_that_collide_across_groups_clobber_overlaid_tensors() -> None:
    """The check has teeth: a pool per group over the same overlaid tensors breaks the logits."""
    with pytest.raises(AssertionError, match="paged and dense logits differ"):
        run_decode("per-type", 0)


# -- prefix caching on a shared pool ----------------------------------------------------------

def test_shared_system_prompt_hits_and_evictions_match_dense_runs() -> None:
    """Hits in both groups, cached blocks evicted and reused by the other group: dense logits."""
    engine = Engine(dict.fromkeys(KEYS, 40), zero_new_blocks=True, layout="shared")
    system = tokens_of(0, 22)
    engine.admit("a", system + tokens_of(1, 5))
    engine.step({"a": []}, chunk=20)  # chunked prefill: the window before 20 gets cached
    hits = {rid: engine.admit(rid, system + tokens_of(2 + i, 3 + 4 * i)).num_tokens
            for i, rid in enumerate(["b", "c"])}
    engine.step({"a": [], "b": [], "c": []})
    for n in range(6):
        engine.step({rid: tokens_of(20 + n, 1) for rid in ("a", "b", "c")})
    engine.free("a")
    engine.free("b")
    hits["d"] = engine.admit("d", system + tokens_of(1, 5) + tokens_of(20, 1) + [7]).num_tokens
    engine.step({"c": tokens_of(30, 1), "d": []})
    for n in range(10):  # long enough that the pool hands out freed cached blocks again
        engine.step({rid: tokens_of(40 + n, 2) for rid in ("c", "d")})
    assert all(n >= 20 for n in hits.values()), hits
    evicted = {(k, b) for d in engine.deltas for k, b in zip(d.evicted_keys, d.evicted_block_ids,
                                                               strict=True)}
    later = {(k, b) for d in engine.deltas
             for k, b in zip(d.appended_keys, d.appended_block_ids, strict=True)}
    crossed = {b for k, b in evicted if any(b == b2 and k != k2 for k2, b2 in later)}
    assert {k for k, _ in evicted} == set(KEYS)
    assert crossed, "no cached block of one group was handed to the other"


def test_forks_on_a_shared_pool_continue_with_their_own_tokens() -> None:
    """Parallel sampling: copy-on-write in both groups of one pool gives each fork its logits."""
    engine = Engine(dict.fromkeys(KEYS, 64), zero_new_blocks=False, layout="shared")
    engine.admit("p", tokens_of(0, 12) + tokens_of(1, 6))
    engine.step({"p": []})
    engine.fork("p", "c1")
    engine.fork("p", "c2")
    for n in range(7):
        engine.step({rid: tokens_of(100 * i + n, 1) for i, rid in enumerate(["p", "c1", "c2"])})
    engine.fork("c1", "g")
    engine.step({"g": tokens_of(7, 3), "c1": tokens_of(8, 2), "p": tokens_of(9, 1)})
    cows = {k for d in engine.deltas for k, pos in zip(d.copied_keys, d.copied_positions,
                                                       strict=True) if pos >= 0}
    assert cows == set(KEYS)


# -- random caching programs over one overlaid symbolic cache ------------------------------------

def shared_caching_state(rnd: random.Random) -> kf.KVState:
    """Full attention, a sliding window and a Mamba state drawing from one pool, caching on."""
    n = rnd.randint(24, 60)
    groups: dict[str, kf.Policy] = {
        "full": kf.FullAttention(num_blocks=n, block_size=rnd.choice([2, 4])),
        "swa": kf.SlidingWindow(num_blocks=n, block_size=rnd.choice([2, 4]),
                                sliding_window=rnd.randint(2, 9)),
        "mamba": kf.Mamba(num_blocks=n, block_size=rnd.choice([2, 4, 8]),
                          next_n=rnd.choice([0, 0, 1]))}
    return kf.KVState.create(groups, 64, enable_prefix_caching=True, layout="shared")


class OverlaidSymbolicCache(SymbolicCache):
    """The symbolic cache with every group's tensor a view of one buffer (block b, row r)."""

    def __init__(self, state: kf.KVState) -> None:
        widths = {g.key: 1 if g.policy.attn_type == "Mamba" else g.policy.block_size
                  for g in state.groups}
        buffer = torch.full((state.pools[0].num_blocks, max(widths.values())), float("nan"),
                            dtype=torch.float64)
        self.tensors = {key: buffer[:, :width] for key, width in widths.items()}


def test_overlaid_groups_keep_every_request_on_its_own_prefix() -> None:
    """Hits, forks, copies, zeroing and frees on one overlaid buffer: each reads its own prefix."""
    crossed = 0
    for seed in range(40):
        rnd = random.Random(seed)
        state = shared_caching_state(rnd)
        cache = OverlaidSymbolicCache(state)
        owner: dict[int, str] = {}
        for step in caching_program(state, rnd, 30):
            apply_delta({k: [t] for k, t in cache.tensors.items()}, step.delta,
                        zero_new_blocks=True)
            cache.check_saved(step.delta, step.ran)
            for ran in step.ran:
                cache.run_step(step.state, ran)
            for key, b in zip(step.delta.appended_keys, step.delta.appended_block_ids,
                              strict=True):
                crossed += b != 0 and owner.get(b, key) != key
                owner[b] = key
    assert crossed > 100  # block ids really pass between the groups


@given(st.randoms(use_true_random=False))
def test_buffer_equals_rebuild_over_shared_caching_programs(rnd: random.Random) -> None:
    """Ids unique across groups: the delta-driven tables equal a rebuild after every transition."""
    state = shared_caching_state(rnd)
    buf = BlockTableBuffer.from_state(state, max_num_requests=16)
    for step in caching_program(state, rnd, 20):
        buf.apply(step.delta)
        check_buffer(buf, step.state)
