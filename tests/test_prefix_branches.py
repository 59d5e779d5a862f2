"""The hash index is part of each state's value: branches and threads never see each other."""

from __future__ import annotations

import sys
import threading
from typing import Any

import pytest

import kvfunc as kf


def _state() -> kf.KVState:
    return kf.KVState.create({"full": kf.FullAttention(num_blocks=8, block_size=4)}, 64,
                             enable_prefix_caching=True)


def test_branches_storing_one_hash_each_keep_their_own_block() -> None:
    """Two branches of one state cache one new hash in different blocks; each branch finds
    its own block and the state they came from finds none."""
    s0 = _state()
    h = kf.BlockHashes.of(range(4), 4)
    one = kf.allocate_slots(s0, "a", 0, 4, block_hashes=h).state
    other = kf.allocate_slots(kf.allocate_slots(s0, "x", 0, 4).state, "a", 0, 4,
                              block_hashes=h).state
    probe = kf.BlockHashes.of([0, 1, 2, 3, 9], 4)
    assert kf.lookup_prefix(one, probe).block_ids["full"] == (1,)
    assert kf.lookup_prefix(other, probe).block_ids["full"] == (2,)
    assert kf.lookup_prefix(s0, probe).num_tokens == 0


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
