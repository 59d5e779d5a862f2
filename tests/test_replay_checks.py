"""Replay checks every operation of every delta against the state it applies to."""

from __future__ import annotations

import re
from typing import Any

import pytest

import kvfunc as kf


def plain() -> tuple[kf.KVState, kf.KVState, kf.BlocksChanged]:
    """An empty state, the state holding "a" (blocks 1, 2) and "b" (3), and its delta."""
    s0 = kf.KVState.create({"full": kf.FullAttention(num_blocks=8, block_size=4)}, 64)
    r = kf.allocate_batch(s0, [("a", 0, 6), ("b", 0, 2)])
    return s0, r.state, r.delta


def d(order: str, **columns: Any) -> kf.BlocksChanged:
    return kf.BlocksChanged(order=order, **columns)


# name: (the second delta of a log, the start of the error's message after "delta 1")
BAD_PLAIN = {
    "frees a free block": (
        d("LFFF", released_keys=("full",), released_request_ids=("a",),
          freed_keys=("full",) * 3, freed_block_ids=(1, 2, 5)),
        ", operation 3 Freed(key='full', block_id=5): block 5 is freed, but no operation"),
    "frees a held block": (
        d("LFFF", released_keys=("full",), released_request_ids=("a",),
          freed_keys=("full",) * 3, freed_block_ids=(1, 2, 3)),
        ", operation 3 Freed(key='full', block_id=3): block 3 is freed, but no operation"),
    "releases without freeing": (
        d("L", released_keys=("full",), released_request_ids=("a",)),
        ": blocks left without a holder are never freed: {'full': [1, 2]}"),
    "a null entry in a full-attention table": (
        d("RA", registered_keys=("full",), registered_request_ids=("c",),
          appended_keys=("full",), appended_request_ids=("c",), appended_block_ids=(0,)),
        ", operation 1 Appended(key='full', request_id='c', block_id=0): a null entry in "
        "'full', whose policy keeps every token"),
    "a float request id": (
        d("R", registered_keys=("full",), registered_request_ids=(1.0,)),
        ": malformed delta: registered_request_ids holds 1.0, not a request id"),
    "a null request id": (
        d("R", registered_keys=("full",), registered_request_ids=(None,)),
        ": malformed delta: registered_request_ids holds None, not a request id"),
    "a block the pool would not hand out": (
        d("RA", registered_keys=("full",), registered_request_ids=("c",),
          appended_keys=("full",), appended_request_ids=("c",), appended_block_ids=(7,)),
        ", operation 1 Appended(key='full', request_id='c', block_id=7): 'full' hands out "
        "block 4, the delta says 7"),
    "an unknown group": (
        d("R", registered_keys=("swa",), registered_request_ids=("c",)),
        ", operation 0 Registered(key='swa', request_id='c'): unknown manager_key 'swa'"),
    "a malformed order": (
        d("AA", appended_keys=("full",), appended_request_ids=("a",), appended_block_ids=(4,)),
        ": malformed delta: order names 2 'A' rows, the columns hold 1"),
}


@pytest.mark.parametrize("name", BAD_PLAIN)
def test_a_delta_that_does_not_fit_is_refused_naming_it(name: str) -> None:
    """Each broken log is a ReplayMismatchError naming the delta, the operation and the misfit."""
    s0, s1, good = plain()
    bad, says = BAD_PLAIN[name]
    with pytest.raises(kf.ReplayMismatchError, match="^" + re.escape("delta 1" + says)):
        kf.replay(s0, [good, bad])
    assert kf.replay(s0, [good]) == s1


def test_a_caching_log_cannot_share_a_free_block_that_caches_nothing() -> None:
    """A shared entry must name a held block or a cached one."""
    s0 = kf.KVState.create({"full": kf.FullAttention(num_blocks=8, block_size=4)}, 64,
                           enable_prefix_caching=True)
    bad = d("RS", registered_keys=("full",), registered_request_ids=("c",),
            shared_keys=("full",), shared_request_ids=("c",), shared_block_ids=(4,))
    with pytest.raises(kf.ReplayMismatchError, match=r"delta 0.*free and holds nothing cached"):
        kf.replay(s0, [bad])


def test_a_caching_log_cannot_share_a_block_released_before_its_freed_row() -> None:
    """A block released in a delta waits for its Freed row: sharing it first is refused,
    and the state replayed from keeps reading as it did."""
    s0 = kf.KVState.create({"full": kf.FullAttention(num_blocks=6, block_size=4)}, 64,
                           enable_prefix_caching=True)
    s1 = kf.allocate_slots(s0, "a", 0, 8, block_hashes=kf.BlockHashes.of(range(8), 4)).state
    before = s1.pools[0].identity()
    bad = d("RLSFF", registered_keys=("full",), registered_request_ids=("x",),
            released_keys=("full",), released_request_ids=("a",), shared_keys=("full",),
            shared_request_ids=("x",), shared_block_ids=(2,), freed_keys=("full", "full"),
            freed_block_ids=(2, 1))
    with pytest.raises(kf.ReplayMismatchError, match=r"block 2 was released and waits"):
        kf.replay(s1, [bad])
    assert s1.pools[0].identity() == before
    kf.check_invariants(s1)


def test_replay_of_every_transition_kind_checks_out() -> None:
    """A log of allocations, recycling, forks, hits, copies, saves, resets and frees replays."""
    s0 = kf.KVState.create({"full": kf.FullAttention(num_blocks=16, block_size=4),
                            "swa": kf.SlidingWindow(num_blocks=16, block_size=4,
                                                    sliding_window=8),
                            "m": kf.Mamba(num_blocks=8, block_size=4)}, 64,
                           enable_prefix_caching=True)
    toks = list(range(12))
    h = kf.BlockHashes.of(toks, 4)
    deltas = []
    s = s0
    r = kf.allocate_slots(s, "p", 0, 12, block_hashes=h)
    s = r.state
    deltas.append(r.delta)
    s, dl = kf.fork_request(s, "p", "c")
    deltas.append(dl)
    r = kf.allocate_batch(s, [kf.SlotRequest("c", 12, 1, block_hashes=h.update(toks + [7])),
                              kf.SlotRequest("p", 12, 5, block_hashes=h.update(toks + [8]))])
    s = r.state
    deltas.append(r.delta)
    hit = kf.lookup_prefix(s, h, max_tokens=11)
    r = kf.allocate_slots(s, "q", hit.num_tokens, 12 - hit.num_tokens, block_hashes=h,
                          prefix_hit=hit)
    s = r.state
    deltas.append(r.delta)
    for rid in ("p", "c"):
        s, dl = kf.free_request(s, rid)
        deltas.append(dl)
    s, dl = kf.reset_prefix_cache(s)
    deltas.append(dl)
    assert set("RANSCTFLZH") <= set("".join(x.order for x in deltas))
    assert kf.replay(s0, deltas) == s
    kf.check_invariants(s)
