"""Prefix caching, forks and hashing: examples that pin exact behaviour and block ids."""

from __future__ import annotations

import hashlib
import pickle
import struct
from typing import Any

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

import kvfunc as kf


def _state(*, caching: bool = True, **groups: kf.Policy) -> kf.KVState:
    return kf.KVState.create(groups or {"full": kf.FullAttention(num_blocks=12, block_size=4)},
                             1024, enable_prefix_caching=caching)


def _admit(state: kf.KVState, rid: object, toks: list[int]) -> kf.AllocationResult:
    h = kf.BlockHashes.of(toks, 4)
    hit = kf.lookup_prefix(state, h, max_tokens=len(toks) - 1)
    return kf.allocate_slots(state, rid, hit.num_tokens, len(toks) - hit.num_tokens,  # type: ignore[arg-type]
                             block_hashes=h, prefix_hit=hit)


# -- hashing ---------------------------------------------------------------------------

def test_hashes_chain_and_depend_on_every_earlier_token() -> None:
    """Block i's hash changes when any token before its end changes, and only then."""
    a = kf.BlockHashes.of(list(range(12)), 4).hashes
    b = kf.BlockHashes.of([0, 1, 2, 99] + list(range(4, 12)), 4).hashes
    c = kf.BlockHashes.of(list(range(8)) + [0, 0, 0, 0], 4).hashes
    assert (a[0] != b[0], a[1] != b[1], a[2] != b[2]) == (True, True, True)
    assert (a[0] == c[0], a[1] == c[1], a[2] != c[2]) == (True, True, True)


def test_hashes_are_sha256_of_the_parent_and_packed_tokens() -> None:
    """A block hash is sha256(parent | little-endian int64 tokens): no per-process salt."""
    root = hashlib.sha256(b"kvfunc.prefix/1-").digest()
    first = hashlib.sha256(root + struct.pack("<4q", 1, 2, 3, 4)).digest()
    second = hashlib.sha256(first + struct.pack("<4q", -5, 6, 7, 2**40)).digest()
    assert kf.BlockHashes.of([1, 2, 3, 4, -5, 6, 7, 2**40], 4).hashes == (first, second)


@pytest.mark.parametrize("fn", kf.HASH_FUNCTIONS)
def test_incremental_update_equals_hashing_at_once(fn: str) -> None:
    """Updating token by token gives the hashes of one call over the whole sequence."""
    toks = list(range(50, 90))
    h = kf.BlockHashes.of([], 8, hash_fn=fn)
    for i in range(len(toks) + 1):
        h = h.update(toks[:i])
    assert h == kf.BlockHashes.of(toks, 8, hash_fn=fn)
    assert h.block_token_ids(1) == tuple(toks[8:16])
    assert h.parent_hash(0) is None and h.parent_hash(2) == h.hashes[1]


def test_salt_and_extra_keys_separate_requests() -> None:
    """Different tenants (salt) or LoRA ids (extra keys) never share a block hash."""
    base = kf.BlockHashes.of(range(8), 4).hashes
    assert kf.BlockHashes.of(range(8), 4, cache_salt="t1").hashes[0] != base[0]
    assert kf.BlockHashes.of(range(8), 4, extra_keys=("lora-7",)).hashes[0] != base[0]
    assert kf.BlockHashes.of(range(8), 4, extra_keys=(7,)).hashes[0] != \
        kf.BlockHashes.of(range(8), 4, extra_keys=("7",)).hashes[0]


@pytest.mark.parametrize(("tokens", "kwargs", "error"), [
    ([1.5, 2], {}, kf.InvalidTypeError),
    (["a"], {}, kf.InvalidTypeError),
    ([2**63], {}, kf.InvalidTypeError),
    ([1], {"hash_fn": "md5"}, kf.InvalidArgumentError),
    ([1], {"extra_keys": (None,)}, kf.InvalidTypeError),
    ([1], {"extra_keys": "lora"}, kf.InvalidTypeError),
    ([1], {"cache_salt": 3.0}, kf.InvalidTypeError),
])
def test_bad_hash_inputs_raise_typed_errors(tokens: list[object], kwargs: dict[str, object],
                                            error: type[Exception]) -> None:
    """Token ids of a wrong type, an unknown hash function, bad keys: typed errors."""
    with pytest.raises(error):
        kf.BlockHashes.of(tokens, 1, **kwargs)  # type: ignore[arg-type]


def test_bad_block_size_raises() -> None:
    """A hash block size must be a positive int."""
    with pytest.raises(kf.InvalidArgumentError):
        kf.BlockHashes.of([1], 0)


# -- hits, references, eviction ----------------------------------------------------------

def test_repeated_prompt_hits_and_shares_blocks() -> None:
    """A second request with the same prompt reuses its full blocks; counts go to 2."""
    s = _admit(_state(), "a", list(range(10))).state
    r = _admit(s, "b", list(range(10)))
    assert kf.get_block_ids(r.state, "b") == {"full": (1, 2, 4)}
    assert r.delta.shared_block_ids == (1, 2) and r.delta.hit_tokens == (8,)
    assert list(r.state.pool_of("full").refs or ())[:5] == [0, 2, 2, 1, 1]


def test_hit_is_capped_so_one_token_is_computed() -> None:
    """An identical prompt of whole blocks hits all but its last block."""
    s = _admit(_state(), "a", list(range(8))).state
    hit = kf.lookup_prefix(s, kf.BlockHashes.of(range(8), 4), max_tokens=7)
    assert (hit.num_tokens, hit.block_ids["full"]) == (4, (1,))


def test_freed_blocks_stay_cached_until_needed_then_lru_is_evicted() -> None:
    """Freed cached blocks stay hittable: uncached free blocks go first, most recently freed
    first, then the cached ones, least recently freed first (evicted as they go)."""
    s = _state(full=kf.FullAttention(num_blocks=7, block_size=4))
    s = _admit(s, "a", list(range(9))).state           # blocks 1, 2, 3
    s, _ = kf.free_request(s, "a")                     # free: 3 4 5 6 | 2 1 (cached 1, 2)
    assert s.pool_of("full").free_block_ids() == (3, 4, 5, 6, 2, 1)
    s = _admit(s, "b", list(range(100, 109))).state    # takes 3 4 5
    r = _admit(s, "c", list(range(200, 205)))          # takes 6, 2: evicts 2 (freed before 1)
    assert kf.get_block_ids(r.state, "c") == {"full": (6, 2)}
    assert r.delta.evicted_block_ids == (2,)
    hit = kf.lookup_prefix(r.state, kf.BlockHashes.of(range(9), 4), max_tokens=8)
    assert (hit.num_tokens, hit.block_ids["full"]) == (4, (1,))


def test_old_states_do_not_see_what_later_states_cache() -> None:
    """Branches of one state cache one hash in different blocks; each sees only its own."""
    s0 = _state(full=kf.FullAttention(num_blocks=7, block_size=4))
    h = kf.BlockHashes.of(range(9), 4)
    one = kf.allocate_slots(s0, "a", 0, 9, block_hashes=h).state           # caches 1, 2
    before = kf.lookup_prefix(one, h, max_tokens=8).block_ids["full"]
    other = kf.allocate_slots(kf.allocate_slots(s0, "x", 0, 4).state, "a", 0, 9,
                              block_hashes=h).state                        # caches 2, 3
    evicted = kf.allocate_slots(kf.free_request(one, "a")[0], "y", 0, 24).state
    found = {name: kf.lookup_prefix(st, h, max_tokens=8).block_ids["full"]
             for name, st in (("s0", s0), ("one", one), ("other", other), ("evicted", evicted))}
    assert found == {"s0": (), "one": (1, 2), "other": (2, 3), "evicted": ()}
    assert before == found["one"]  # what later branches cached did not reach it
    for state in (s0, one, other, evicted):
        kf.check_invariants(state)


def test_the_index_holds_exactly_the_cached_blocks() -> None:
    """Distinct prompts through a small pool: the index never outgrows the pool (it holds
    the cached blocks, nothing else) and the first state still finds its prefix."""
    s = _state(full=kf.FullAttention(num_blocks=9, block_size=4))
    first = s = _admit(s, 0, list(range(9))).state
    for rid in range(1, 200):
        s, _ = kf.free_request(s, rid - 1)
        r = _admit(s, rid, [rid * 1000 + t for t in range(29)])
        assert r.ok
        s = r.state
        assert len(s.pool_of("full").by_key) == kf.num_cached_blocks(s, "full") <= 8
    kf.check_invariants(s)
    hit = kf.lookup_prefix(first, kf.BlockHashes.of(range(9), 4), max_tokens=8)
    assert hit.block_ids["full"] == (1, 2)
def test_hit_on_a_free_block_takes_it_out_of_the_queue() -> None:
    """A touched free block leaves the free queue; free counts include cached blocks."""
    s = _admit(_state(), "a", list(range(9))).state
    s, _ = kf.free_request(s, "a")
    assert kf.num_free_blocks(s, "full") == 11 and kf.num_cached_blocks(s, "full") == 2
    r = _admit(s, "b", list(range(9)))
    assert r.delta.shared_block_ids == (1, 2) and kf.num_free_blocks(r.state, "full") == 8
    assert 1 not in r.state.pool_of("full").free_block_ids()


def test_stale_hit_is_refused_and_changes_nothing() -> None:
    """A hit whose block was evicted after the lookup is refused (the state is returned)."""
    s = _state(full=kf.FullAttention(num_blocks=4, block_size=4))
    s = _admit(s, "a", list(range(5))).state
    s, _ = kf.free_request(s, "a")
    h = kf.BlockHashes.of(range(5), 4)
    hit = kf.lookup_prefix(s, h, max_tokens=4)
    s2 = _admit(s, "x", list(range(50, 62))).state     # takes every block: evicts the hit
    r = kf.allocate_slots(s2, "b", 4, 1, block_hashes=h, prefix_hit=hit)
    assert hit.num_tokens == 4 and (r.ok, r.state is s2) == (False, True)


def test_sliding_window_hybrid_hits_repeated_prompts() -> None:
    """On full + sliding-window groups a repeated prompt hits; the hit holds only the
    window's blocks: a prefill with caching computes (and caches) every block, and those
    before the window leave at the next step."""
    s = _state(full=kf.FullAttention(num_blocks=20, block_size=4),
               swa=kf.SlidingWindow(num_blocks=20, block_size=4, sliding_window=8))
    toks = list(range(30))
    r = _admit(s, "a", toks)
    assert kf.get_block_ids(r.state, "a")["swa"] == (1, 2, 3, 4, 5, 6, 7, 8)
    s = kf.allocate_slots(r.state, "a", 30, 1, block_hashes=kf.BlockHashes.of(toks, 4)).state
    assert kf.get_block_ids(s, "a")["swa"] == (0, 0, 0, 0, 0, 6, 7, 8)  # 1..5 slid out
    s, _ = kf.free_request(s, "a")
    r = _admit(s, "b", toks)
    assert r.delta.hit_tokens == (28,)
    assert kf.get_block_ids(r.state, "b")["swa"][:7] == (0, 0, 0, 0, 0, 6, 7)


def test_sliding_window_needs_only_its_window_cached() -> None:
    """Blocks that slid out of the window long ago are evicted first: the hit, which needs
    only the window's blocks, stays valid."""
    s = _state(full=kf.FullAttention(num_blocks=20, block_size=4),
               swa=kf.SlidingWindow(num_blocks=8, block_size=4, sliding_window=4))
    toks = list(range(24))
    h = kf.BlockHashes.of(toks, 4)
    s = kf.allocate_slots(s, "a", 0, 8, block_hashes=h).state            # swa blocks 1, 2
    for computed in (8, 12, 16, 20):  # each step slides one block out, to the queue's end
        s = kf.allocate_slots(s, "a", computed, 4, block_hashes=h).state
    assert kf.get_block_ids(s, "a")["swa"] == (0, 0, 0, 0, 5, 6)
    s, _ = kf.free_request(s, "a")
    assert s.pool_of("swa").free_block_ids() == (7, 1, 2, 3, 4, 6, 5)
    s = kf.allocate_slots(s, "x", 0, 20).state                           # evicts 1..4
    hit = kf.lookup_prefix(s, h, max_tokens=23)
    assert hit.num_tokens == 20 and hit.block_ids["swa"] == (0, 0, 0, 0, 5)


def test_mamba_state_is_saved_at_a_boundary_and_copied_on_hit() -> None:
    """A state group caches a copy of the state at a block boundary; a hit copies it back."""
    s = _state(full=kf.FullAttention(num_blocks=16, block_size=4),
               mamba=kf.Mamba(num_blocks=8, block_size=8))
    toks = list(range(100, 116))
    s = _admit(s, 1, toks).state
    r = kf.allocate_slots(s, 1, 16, 1, block_hashes=kf.BlockHashes.of(toks + [1], 4))
    assert (r.delta.copied_positions, r.delta.copied_src_block_ids,
            r.delta.copied_dst_block_ids) == ((kf.COPY_SAVED,), (1,), (2,))
    r2 = _admit(r.state, 2, toks + [2, 3])
    assert r2.delta.hit_tokens == (16,)
    assert (r2.delta.copied_positions, r2.delta.copied_src_block_ids,
            r2.delta.copied_dst_block_ids) == ((kf.COPY_INTO_NEW,), (2,), (3,))
    assert kf.get_block_ids(r2.state, 2)["mamba"] == (3,)


def test_mamba_without_a_saved_state_limits_the_hit() -> None:
    """With no state saved at any candidate length the hybrid hit is 0."""
    s = _state(full=kf.FullAttention(num_blocks=16, block_size=4),
               mamba=kf.Mamba(num_blocks=8, block_size=8))
    toks = list(range(100, 116))
    s = _admit(s, 1, toks).state
    hit = kf.lookup_prefix(s, kf.BlockHashes.of(toks + [5], 4), max_tokens=16)
    assert hit.num_tokens == 0


# -- forks ---------------------------------------------------------------------------------

def test_fork_shares_then_copies_on_first_write() -> None:
    """Parent and child share blocks; the first write to the shared partial block copies it."""
    s = _state()
    s = kf.allocate_slots(s, "p", 0, 6).state
    s, d = kf.fork_request(s, "p", "c")
    assert d.shared_block_ids == (1, 2) and kf.get_block_ids(s, "c") == {"full": (1, 2)}
    r = kf.allocate_slots(s, "c", 6, 1)
    assert (r.delta.copied_request_ids, r.delta.copied_positions) == (("c",), (1,))
    r2 = kf.allocate_slots(r.state, "p", 6, 1)  # the parent now owns block 2 alone
    assert r2.delta.copied_keys == () and kf.get_block_ids(r2.state, "p") == {"full": (1, 2)}
    _, d3 = kf.free_request(r2.state, "p")
    assert d3.freed_block_ids == (2,)  # block 1 is still the child's


def test_fork_errors_change_nothing() -> None:
    """Forking an unknown parent, into a known child, or without caching raises."""
    s = kf.allocate_slots(_state(), "p", 0, 6).state
    with pytest.raises(kf.UnknownRequestError):
        kf.fork_request(s, "nobody", "c")
    with pytest.raises(kf.InvalidArgumentError):
        kf.fork_request(s, "p", "p")
    with pytest.raises(kf.NotSupportedError):
        kf.fork_request(kf.allocate_slots(_state(caching=False), "p", 0, 6).state, "p", "c")


# -- resets, metrics, batches, replay --------------------------------------------------------

def test_reset_forgets_everything_cached() -> None:
    """After a reset nothing hits; running requests re-cache their blocks as they go on."""
    toks = list(range(9))
    s = _admit(_state(), "a", toks).state
    s, d = kf.reset_prefix_cache(s)
    assert d.cleared_keys == ("full",) and kf.num_cached_blocks(s, "full") == 0
    h = kf.BlockHashes.of(toks + [9], 4)
    s = kf.allocate_slots(s, "a", 9, 1, block_hashes=h).state
    assert kf.num_cached_blocks(s, "full") == 2


def test_stats_count_hits_and_evictions() -> None:
    """PrefixCacheStats sums hit rows, stores and evictions of deltas."""
    s = _state()
    r1 = _admit(s, "a", list(range(9)))
    r2 = _admit(r1.state, "b", list(range(9)))
    stats = kf.PrefixCacheStats.of([r1.delta, r2.delta])
    assert (stats.queries, stats.hits, stats.hit_tokens, stats.query_tokens) == (2, 1, 8, 16)
    assert stats.stored_blocks == 2 and stats.hit_rate == 0.5


def test_batch_with_hits_equals_sequential_calls() -> None:
    """allocate_batch on a caching state equals allocate_slots one request at a time."""
    s = _admit(_state(), "a", list(range(9))).state
    h = kf.BlockHashes.of(range(9), 4)
    hit = kf.lookup_prefix(s, h, max_tokens=8)
    reqs = [kf.SlotRequest("b", 8, 1, 0, 0, None, h, hit), ("a", 9, 3)]
    batch = kf.allocate_batch(s, reqs)
    seq = kf.allocate_slots(s, "b", 8, 1, block_hashes=h, prefix_hit=hit).state
    seq = kf.allocate_slots(seq, "a", 9, 3).state
    assert batch.state == seq and batch.refused == ()
    assert kf.replay(s, [batch.delta]) == batch.state


def test_caching_off_keeps_the_seed_path() -> None:
    """Without caching a state has no cache and frees in logical order (the seed's ids)."""
    s = _state(caching=False)
    assert not s.prefix_caching and s.pool_of("full").hash_of is None
    s, d = kf.free_request(kf.allocate_slots(s, "a", 0, 9).state, "a")
    assert d.freed_block_ids == (1, 2, 3)
    assert _state(caching=False) == kf.KVState.create(
        {"full": kf.FullAttention(num_blocks=12, block_size=4)}, 1024)


@pytest.mark.parametrize(("kwargs", "error"), [
    ({"block_hashes": kf.BlockHashes.of(range(8), 3)}, kf.InvalidArgumentError),
    ({"block_hashes": "nope"}, kf.InvalidTypeError),
    ({"prefix_hit": "nope", "block_hashes": kf.BlockHashes.of(range(8), 4)}, kf.InvalidTypeError),
])
def test_bad_caching_arguments_raise_before_any_change(kwargs: dict[str, object],
                                                       error: type[Exception]) -> None:
    """Hashes of a block size that does not divide the group's, or wrong types: typed errors."""
    s = _state()
    with pytest.raises(error):
        kf.allocate_slots(s, "a", 0, 8, **kwargs)  # type: ignore[arg-type]


def test_hit_arguments_must_match_the_admission() -> None:
    """computed_tokens must equal the hit; hashes are required; caching must be on."""
    s = _admit(_state(), "a", list(range(9))).state
    h = kf.BlockHashes.of(range(9), 4)
    hit = kf.lookup_prefix(s, h, max_tokens=8)
    with pytest.raises(kf.InvalidArgumentError):
        kf.allocate_slots(s, "b", 0, 9, block_hashes=h, prefix_hit=hit)
    with pytest.raises(kf.InvalidArgumentError):
        kf.allocate_slots(s, "b", 8, 1, prefix_hit=hit)
    with pytest.raises(kf.InvalidArgumentError):
        kf.allocate_slots(s, "a", 8, 1, block_hashes=h, prefix_hit=hit)
    with pytest.raises(kf.NotSupportedError):
        kf.lookup_prefix(_state(caching=False), h)
    with pytest.raises(kf.NotSupportedError):
        kf.allocate_slots(_state(caching=False), "a", 0, 9, block_hashes=h)


def test_compat_manager_refuses_a_caching_state() -> None:
    """The seed-compatible facade restores only plain states (it has no prefix cache)."""
    from kvfunc.compat import FullAttentionManager, KVCacheManager

    mgr = KVCacheManager(1024, [FullAttentionManager("FullAttention", 12, 4)], None)
    plain = mgr.state
    caching = kf.KVState.create({"FullAttention": kf.FullAttention(num_blocks=12, block_size=4)},
                                1024, enable_prefix_caching=True)
    with pytest.raises(kf.InvalidArgumentError):
        mgr.restore(caching)
    assert mgr.state is plain


def test_many_hits_and_frees_keep_the_queue_order() -> None:
    """Repeated hit/free cycles take hit blocks out of the middle of the queue and put them
    back at its end; the order and the ids stay those of the first cycle."""
    s0 = _state(full=kf.FullAttention(num_blocks=6, block_size=4))
    s, deltas = s0, []
    toks = list(range(9))
    for i in range(300):  # each cycle turns two ring entries stale and appends two more
        r = _admit(s, i, toks)
        s, d = kf.free_request(r.state, i)
        deltas += [r.delta, d]
    kf.check_invariants(s)
    assert kf.replay(s0, deltas) == s
    # Each cycle hits blocks 1, 2, takes the head of 3, 4, 5 and frees it first: 3 rotate.
    assert s.pool_of("full").free_block_ids() == (3, 4, 5, 2, 1)


def test_batch_bounds_a_copying_request_before_planning_the_rest() -> None:
    """A forked request that copies and grows, then a new one that no longer fits: refused."""
    s = _state(full=kf.FullAttention(num_blocks=7, block_size=4))
    s = kf.allocate_slots(s, "p", 0, 6).state         # blocks 1, 2 (2 is partial)
    s, _ = kf.fork_request(s, "p", "c")               # free: 3, 4, 5, 6
    reqs = [("c", 6, 10), ("x", 0, 8)]                # c: a copy of 2 and 2 new blocks; x: 2
    batch = kf.allocate_batch(s, reqs)
    seq = kf.allocate_slots(s, "c", 6, 10).state
    assert kf.allocate_slots(seq, "x", 0, 8).ok is False
    assert batch.refused == ("x",) and batch.state == seq
    kf.check_invariants(batch.state)


def test_a_state_saved_twice_into_one_block_in_a_batch_replays() -> None:
    """Two saves into the only free block of a state group: batch == sequential == replay."""
    s = kf.KVState.create({"m": kf.Mamba(num_blocks=4, block_size=4)}, 64,
                          enable_prefix_caching=True)
    s = kf.allocate_slots(kf.allocate_slots(s, "A", 0, 3).state, "C", 0, 3).state
    reqs = [kf.SlotRequest("A", 4, 1, block_hashes=kf.BlockHashes.of(range(100, 108), 4)),
            kf.SlotRequest("C", 4, 1, block_hashes=kf.BlockHashes.of(range(200, 208), 4))]
    r = kf.allocate_batch(s, reqs)
    seq = s
    for req in reqs:
        seq = kf.allocate_slots(seq, req[0], req[1], req[2], block_hashes=req[6]).state
    assert r.state == seq and kf.replay(s, [r.delta]) == r.state
    # the delta is the exact log: A's saved state is cached, then evicted for C's
    assert r.delta.order == "CTFECTF" and r.delta.evicted_hashes == r.delta.stored_hashes[:1]


def test_a_hit_in_the_batch_makes_a_later_writer_copy() -> None:
    """A hit that shares a block a later request of the step writes: it copies, as sequentially."""
    h = kf.BlockHashes.of(range(12), 4)
    s = kf.allocate_slots(_state(full=kf.FullAttention(num_blocks=16, block_size=4)), "B", 0,
                          12, block_hashes=h).state
    hit = kf.lookup_prefix(s, h, max_tokens=8)
    reqs = [kf.SlotRequest("A", 8, 2, block_hashes=h, prefix_hit=hit), ("B", 4, 8)]
    batch = kf.allocate_batch(s, reqs)
    seq = kf.allocate_slots(s, "A", 8, 2, block_hashes=h, prefix_hit=hit).state
    seq = kf.allocate_slots(seq, "B", 4, 8).state
    assert batch.state == seq and kf.replay(s, [batch.delta]) == batch.state


def test_batch_registers_a_new_request_with_no_tokens() -> None:
    """A new request asking for 0 tokens is registered by a caching batch, as by one call."""
    s = _state()
    assert kf.allocate_batch(s, [("a", 0, 0)]).state == kf.allocate_slots(s, "a", 0, 0).state


@pytest.mark.parametrize("hit", [
    kf.PrefixHit(4, dict({"full": (99,)}), 4),
    kf.PrefixHit(4, dict({"full": (1, 2)}), 4),
    kf.PrefixHit(16, dict({"full": (1, 2, 3, 4)}), 16),
])
def test_a_hit_that_does_not_fit_the_state_or_hashes_is_rejected(hit: kf.PrefixHit) -> None:
    """Hand-built hits with ids out of range, a wrong count, or past the hashes: typed errors."""
    s = _admit(_state(), "a", list(range(9))).state
    with pytest.raises(kf.InvalidArgumentError):
        kf.allocate_slots(s, "b", hit.num_tokens, 1, block_hashes=kf.BlockHashes.of(range(9), 4),
                          prefix_hit=hit)


def test_batch_rejects_bad_hits_and_keys_with_typed_errors() -> None:
    """A non-PrefixHit or malformed manager_keys in a caching batch: typed errors."""
    s = _state()
    h = kf.BlockHashes.of(range(9), 4)
    with pytest.raises(kf.InvalidTypeError):
        kf.allocate_batch(s, [("a", 0, 9, 0, 0, None, h, "hit")])
    with pytest.raises(kf.InvalidTypeError):
        kf.allocate_batch(s, [("a", 0, 9, 0, 0, 5, None, None)])


def _longest_hit(state: kf.KVState, h: kf.BlockHashes, cap: int) -> int:
    """The longest hit by the definitions, trying every length (a reference for the search)."""
    cached = {g.key: state.pool_of(g.key).cached(g.key) for g in state.groups}

    def has(key: str, bs: int, pos: int) -> bool:
        return h.hashes[(pos + 1) * bs // h.block_size - 1] in cached[key]

    def accepts(g: Any, n: int) -> bool:
        bs, w = g.policy.block_size, g.policy.window
        if not g.policy.grows_with_tokens:
            return has(g.key, bs, n // bs - 1)
        first = 0 if w is None else max(0, n - w + 1) // bs
        return all(has(g.key, bs, p) for p in range(first, n // bs))

    step = 4
    for n in range(min(cap, h.num_tokens) // step * step, 0, -step):
        if all(accepts(g, n) for g in state.groups):
            return n
    return 0


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_lookup_finds_the_longest_hit_on_hybrid_models(data: st.DataObject) -> None:
    """Lookups equal a search over every length, with windows and states holding holes."""
    extra = data.draw(st.sampled_from([
        {"swa": kf.SlidingWindow(num_blocks=30, block_size=4, sliding_window=9)},
        {"swa": kf.SlidingWindow(num_blocks=30, block_size=4, sliding_window=4)},
        {"mamba": kf.Mamba(num_blocks=30, block_size=4)}]))
    s = _state(full=kf.FullAttention(num_blocks=40, block_size=4), **extra)
    words = st.lists(st.integers(0, 2), min_size=1, max_size=30)
    prompts = []
    for rid in range(data.draw(st.integers(1, 5))):
        toks = data.draw(words)
        prompts.append(toks)
        h = kf.BlockHashes.of(toks, 4)
        split = 4 * data.draw(st.integers(0, len(toks) // 4))  # chunked: states and windows
        for computed, new in ((0, split), (split, len(toks) - split)):  # ... cached midway
            r = kf.allocate_slots(s, rid, computed, new, block_hashes=h)
            if r.ok:
                s = r.state
        if data.draw(st.booleans()):
            s, _ = kf.free_request(s, rid)
    shared = data.draw(st.sampled_from(prompts))  # a query sharing a prefix of a prompt
    query = kf.BlockHashes.of(shared[:data.draw(st.integers(0, len(shared)))]
                              + data.draw(words), 4)
    cap = data.draw(st.one_of(st.just(40), st.integers(0, 40)))
    hit = kf.lookup_prefix(s, query, max_tokens=cap)
    assert hit.num_tokens == _longest_hit(s, query, cap)
    event(f"{next(iter(extra))}: {'hit' if hit.num_tokens else 'no hit'}")


def test_a_batch_delta_with_copies_around_a_hit_replays() -> None:
    """Copy-on-write, a hit sharing the copied block, copy-on-write again: replay follows."""
    s = _state(full=kf.FullAttention(num_blocks=10, block_size=2))
    h = kf.BlockHashes.of([0, 1, 2, 3], 2)
    s = kf.allocate_slots(s, "a", 0, 4, block_hashes=h).state
    s, _ = kf.fork_request(s, "a", "b")
    hc = kf.BlockHashes.of([0, 1, 2, 3, 7], 2)
    hit = kf.lookup_prefix(s, hc, max_tokens=4)
    r = kf.allocate_batch(s, [("a", 2, 1, 0, 0, None, None, None), ("c", 4, 1, 0, 0, None, hc, hit),
                              ("b", 2, 1, 0, 0, None, None, None)])
    assert ((), ("a", "b"), 4) == (r.refused, r.delta.copied_request_ids, hit.num_tokens)
    assert kf.replay(s, [r.delta]) == r.state
    kf.check_invariants(r.state)


def test_a_state_evicted_then_saved_again_in_one_batch_replays() -> None:
    """An eviction before a save of the same block and hash does not undo the save."""
    s = _state(full=kf.FullAttention(num_blocks=12, block_size=2),
               mamba=kf.Mamba(num_blocks=4, block_size=2))
    toks = list(range(12))
    s = kf.allocate_slots(s, 0, 0, 8, block_hashes=kf.BlockHashes.of(toks[:8], 2)).state
    s = kf.allocate_slots(s, 0, 8, 2, block_hashes=kf.BlockHashes.of(toks[:10], 2)).state
    s = kf.allocate_slots(s, 0, 10, 0, block_hashes=kf.BlockHashes.of(toks[:10], 2)).state
    h3 = kf.BlockHashes.of(toks[:8] + [99, 98, 97, 96], 2)
    hit = kf.lookup_prefix(s, h3, max_tokens=8)
    r = kf.allocate_batch(s, [(3, hit.num_tokens, 4, 0, 0, None, h3, hit),
                              (0, 10, 2, 0, 0, None, kf.BlockHashes.of(toks, 2), None)])
    assert kf.replay(s, [r.delta]) == r.state
    assert kf.num_cached_blocks(r.state, "mamba") == 1


def test_caching_rejects_negative_computed_tokens_and_empty_windows() -> None:
    """A caching step reads the block at computed_tokens; a window must hold a token."""
    s = kf.allocate_slots(_state(), "a", 0, 4).state
    s, _ = kf.fork_request(s, "a", "b")
    with pytest.raises(kf.InvalidArgumentError):
        kf.allocate_slots(s, "b", -2, 1, 1)
    with pytest.raises(kf.InvalidArgumentError):
        kf.allocate_batch(s, [("b", -2, 1, 1)])
    with pytest.raises(kf.InvalidArgumentError):
        _state(swa=kf.SlidingWindow(num_blocks=8, block_size=4, sliding_window=0))


def test_thrown_away_transitions_leave_the_index_as_it_was() -> None:
    """Transitions that are dropped change nothing a live state holds: its index is its own."""
    s = _state(full=kf.FullAttention(num_blocks=9, block_size=4))
    s = kf.allocate_slots(s, "live", 0, 5, block_hashes=kf.BlockHashes.of(range(5), 4)).state
    for i in range(500):  # accepted, then dropped
        toks = [i * 100 + t for t in range(24)]
        assert kf.allocate_slots(s, i, 0, 24, block_hashes=kf.BlockHashes.of(toks, 4)).ok
    assert len(s.pool_of("full").by_key) == 1
    hit = kf.lookup_prefix(s, kf.BlockHashes.of(range(5), 4), max_tokens=4)
    assert hit.block_ids["full"] == (1,)
def test_block_hashes_built_from_tuples_equal_hashed_ones() -> None:
    """The constructor takes hashes and token blocks; bad sizes are typed errors."""
    h = kf.BlockHashes.of(range(8), 4)
    built = kf.BlockHashes(4, "sha256", h.root, h.hashes, h.blocks)
    assert (built, built.blocks) == (h, ((0, 1, 2, 3), (4, 5, 6, 7)))  # == ignores tokens
    assert pickle.loads(pickle.dumps(h)).blocks == h.blocks
    assert h.block_token_ids(-1) == (4, 5, 6, 7)
    with pytest.raises(kf.InvalidArgumentError):
        kf.BlockHashes(0, "sha256", b"r")


@pytest.mark.parametrize(("first", "last", "size"), [(0, 3, 4), (1, 0, 4), (-1, 1, 4),
                                                     (0, 1, 6), (0, 1, 0)])
def test_token_ids_by_block_rejects_blocks_not_hashed(first: int, last: int,
                                                      size: int) -> None:
    """Group blocks past the hashed tokens, reversed, negative or of a size that is not a
    multiple of the hash block size are typed errors; a valid range reads the lineage's
    tokens, never a longer sibling's."""
    h = kf.BlockHashes.of(range(9), 4)
    longer = h.update(range(16))  # appends to the lists h shares
    assert h.token_ids_by_block(0, 2, 4) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert longer.token_ids_by_block(1, 2, 8) == [tuple(range(8, 16))]
    with pytest.raises(kf.InvalidArgumentError, match="not hashed"):
        h.token_ids_by_block(first, last, size)


def test_saves_in_two_state_groups_evicted_in_one_batch() -> None:
    """Two Mamba groups save a state and evict it again within one batch: the delta logs
    both saves and both evictions in order, and replays."""
    s = kf.KVState.create({"full": kf.FullAttention(num_blocks=40, block_size=2),
                           "m1": kf.Mamba(num_blocks=3, block_size=2),
                           "m2": kf.Mamba(num_blocks=3, block_size=2)}, 1024,
                          enable_prefix_caching=True)
    toks = list(range(12))
    s = kf.allocate_slots(s, 0, 0, 3, block_hashes=kf.BlockHashes.of(toks[:3], 2)).state
    r = kf.allocate_batch(s, [(0, 4, 2, 0, 0, None, kf.BlockHashes.of(toks[:6], 2), None)]
                          + [(i, 0, 3, 0, 0, None, None, None) for i in range(1, 4)])
    assert ((2, 3), ("full", "full", "m1", "m2"), ("m1", "m2"), ("m1", "m2")) == (
        r.refused, r.delta.stored_keys, r.delta.copied_keys, r.delta.evicted_keys)
    assert kf.replay(s, [r.delta]) == r.state
    kf.check_invariants(r.state)


def test_hits_take_the_copy_cached_first_live_and_replayed_alike() -> None:
    """Two blocks hold one hash (two requests computed the same prefix at once); a hit takes
    the copy cached first, as vLLM's does, in a live state and in its replay."""
    def new() -> kf.KVState:
        return _state(full=kf.FullAttention(num_blocks=8, block_size=4))
    h = kf.BlockHashes.of(range(5), 4)
    s0 = new()
    r1 = kf.allocate_slots(s0, "x", 0, 4)                        # block 1
    r2 = kf.allocate_slots(r1.state, "a", 0, 5, block_hashes=h)  # 2 (cached first), 3
    r3 = kf.allocate_slots(r2.state, "b", 0, 5, block_hashes=h)  # 4 (a second copy), 5
    s4, d4 = kf.free_request(r3.state, "a")
    assert s4.pool_of("full").cached("full")[h.hashes[0]] == (2, 4)
    replayed = kf.replay(s0, [r1.delta, r2.delta, r3.delta, d4])
    assert replayed == s4
    assert ((2,), (2,)) == tuple(kf.lookup_prefix(st, h, max_tokens=4).block_ids["full"]
                                 for st in (s4, replayed))
def test_a_hash_stored_in_many_blocks_is_found_until_its_last_copy_goes() -> None:
    """One hash stored into 40 blocks: a hit takes the first copy; evicting every copy
    leaves nothing cached, and storing it again caches the new block alone."""
    s = _state(full=kf.FullAttention(num_blocks=128, block_size=4))
    h = kf.BlockHashes.of(range(5), 4)
    for i in range(40):  # no prefix_hit: each request caches the block in a block of its own
        s = kf.allocate_slots(s, i, 0, 5, block_hashes=h).state
    assert 40 == kf.num_cached_blocks(s, "full")
    assert kf.lookup_prefix(s, h, max_tokens=4).block_ids["full"] == (1,)
    for i in range(40):
        s = kf.free_request(s, i)[0]
    s = kf.free_request(kf.allocate_slots(s, "big", 0, 127 * 4).state, "big")[0]  # evicts all
    assert 0 == kf.num_cached_blocks(s, "full") and not len(s.pool_of("full").by_key)
    s = kf.allocate_slots(s, "again", 0, 5, block_hashes=h).state
    block = kf.get_block_ids(s, "again")["full"][0]
    assert s.pool_of("full").cached("full") == {h.hashes[0]: (block,)}


def test_one_digest_twice_in_a_run_caches_both_blocks_under_it() -> None:
    """Hashes given as digests may repeat one: both blocks are cached, in order, under it."""
    s = kf.KVState.create({"full": kf.FullAttention(num_blocks=8, block_size=4)}, 64,
                          enable_prefix_caching=True)
    digest = b"x" * 32
    h = kf.BlockHashes.of_digests([digest, digest], list(range(8)), 4)
    r = kf.allocate_slots(s, "a", 0, 8, block_hashes=h)
    assert r.ok and r.state.pools[0].by_key == {digest: (1, 2)}
    kf.check_invariants(r.state)


def test_a_step_caches_no_block_before_its_first_uncached_one_or_its_computed_ones() -> None:
    """What vLLM's manager relies on to test only some of a step's digests against the owed
    ones: a step caches no position below both the first one its row has not cached (or
    nulled) and its computed tokens' blocks.  A write below the row's cached blocks onto a
    block another request holds copies it, and the copy is cached again: below the first
    uncached position, so only the two bounds together hold."""
    base = kf.KVState.create({"full": kf.FullAttention(num_blocks=16, block_size=4)}, 64,
                             enable_prefix_caching=True)
    h = kf.BlockHashes.of(range(16), 4)
    s = kf.allocate_slots(base, "a", 0, 9, block_hashes=h).state
    hit = kf.lookup_prefix(s, h, max_tokens=8)
    assert hit.num_tokens == 8
    s = kf.allocate_slots(s, "b", 8, 1, block_hashes=h, prefix_hit=hit).state
    below = 0
    for computed in range(0, 12):
        for new in range(1, 16 - computed):
            row = s.groups[0].rows["b"]
            first = row.stored if row.stored > row.nulls else row.nulls
            r = kf.allocate_slots(s, "b", computed, new, block_hashes=h)
            stored = r.delta.stored_positions
            assert all(p >= min(first, computed // 4) for p in stored), (computed, new, stored)
            below += any(p < first for p in stored)
    assert below, "no step cached below its first uncached block: the case is not covered"


def test_a_state_of_windows_only_admits_a_request_with_its_prefix_hit() -> None:
    """With no full-attention group, a hit's slid-out positions are null entries of a new
    row: the admission fits (nothing to recycle yet) and takes the rest."""
    s = kf.KVState.create({"swa": kf.SlidingWindow(num_blocks=32, block_size=4,
                                                   sliding_window=7)}, 256,
                          enable_prefix_caching=True)
    t = list(range(20))
    s = kf.free_request(kf.allocate_slots(s, "a", 0, 20,
                                          block_hashes=kf.BlockHashes.of(t, 4)).state, "a")[0]
    h = kf.BlockHashes.of([*t, 99], 4)
    hit = kf.lookup_prefix(s, h, max_tokens=20)
    assert hit.block_ids["swa"] == (0, 0, 0, 4, 5)
    r = kf.allocate_slots(s, "b", 20, 1, block_hashes=h, prefix_hit=hit)
    assert kf.get_block_ids(r.state, "b") == {"swa": (0, 0, 0, 4, 5, 6)}
    kf.check_invariants(r.state)
