"""The candidate index that a lineage of caching states shares, under concurrent branches."""

from __future__ import annotations

import sys
import threading
from typing import Any

import pytest

import kvfunc as kf


def _state() -> kf.KVState:
    return kf.KVState.create({"full": kf.FullAttention(num_blocks=8, block_size=4)}, 64,
                             enable_prefix_caching=True)


class _SwitchesInsideGet(dict):  # type: ignore[type-arg]
    """An index that runs ``other`` (once) in the middle of a lookup of ``key``: a thread
    switch at the worst moment of a store."""

    def __init__(self, items: Any, key: bytes, other: Any) -> None:
        super().__init__(items)
        self.key, self.other = key, other

    def get(self, key: Any, default: Any = None) -> Any:
        found = super().get(key, default)
        if key == self.key and self.other is not None:
            other, self.other = self.other, None
            other()
        return found


def test_a_branch_storing_the_same_hash_meanwhile_loses_no_candidate() -> None:
    """Two branches of one state cache one new hash in different blocks; the second store
    to reach the shared index, interleaved inside the first, keeps both candidates."""
    mine, theirs = list(range(100, 104)), list(range(900, 904))
    h_mine, h_theirs = kf.BlockHashes.of(mine, 4), kf.BlockHashes.of(theirs, 4)
    s0 = _state()
    out: dict[str, kf.KVState] = {}

    def other_branch() -> None:  # caches ``mine`` in block 2 (``theirs`` takes block 1)
        out["theirs"] = kf.allocate_batch(s0, [("q", 0, 4, 0, 0, None, h_theirs, None),
                                               ("p", 0, 4, 0, 0, None, h_mine, None)]).state

    cache = s0.group("full").cache
    index = _SwitchesInsideGet(cache.by_hash, h_mine.hashes[0], other_branch)
    object.__setattr__(cache, "by_hash", index)
    out["mine"] = kf.allocate_slots(s0, "p", 0, 4, block_hashes=h_mine).state  # block 1
    probe = kf.BlockHashes.of([*mine, 0], 4)
    for name, block in (("mine", 1), ("theirs", 2)):
        kf.check_invariants(out[name])
        assert kf.lookup_prefix(out[name], probe).block_ids["full"] == (block,), name


@pytest.fixture
def frequent_thread_switches() -> Any:
    """Let the interpreter switch threads every microsecond (5 ms by default)."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


@pytest.mark.usefixtures("frequent_thread_switches")
def test_threads_branching_from_one_state_all_keep_their_hits() -> None:
    """Threads admitting prompts onto one shared state each end with a valid state whose
    lookups find what it cached."""
    prompts = [list(range(k * 1000, k * 1000 + 8)) for k in range(4)]
    hashes = [kf.BlockHashes.of(p, 4) for p in prompts]
    for _ in range(300):
        s0 = _state()
        results: list[kf.KVState | None] = [None] * 4
        barrier = threading.Barrier(4, timeout=30)

        def admit(i: int, s0: kf.KVState = s0, results: list[Any] = results,
                  barrier: threading.Barrier = barrier) -> None:
            barrier.wait()
            reqs = [(f"r{j}", 0, 8, 0, 0, None, hashes[j], None) for j in (i, (i + 1) % 4)]
            results[i] = kf.allocate_batch(s0, reqs).state

        threads = [threading.Thread(target=admit, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        for i, state in enumerate(results):
            assert state is not None
            kf.check_invariants(state)
            for j in (i, (i + 1) % 4):
                probe = kf.BlockHashes.of([*prompts[j], 0], 4)
                assert kf.lookup_prefix(state, probe).num_tokens == 8, (i, j)
