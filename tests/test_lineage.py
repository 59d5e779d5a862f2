"""A lineage's shared store (``kvfunc.core._lineage``): old values stay values.

A transition from the newest state writes the pool's lists in place and
logs what it overwrote; older states read through those logs, branches
fork, a transition that raises undoes its writes, and held old states are
compacted.  Every check compares contents with a twin run that never
shares: the same program replayed from a fresh state.
"""

from __future__ import annotations

import copy
import gc
import pickle
import threading
from typing import Any

import pytest

import kvfunc as kf
from kvfunc.core import _lineage
from kvfunc.core._lineage import Store, Version, claim, commit, content, materialize, reading


def _state(n: int = 32) -> kf.KVState:
    return kf.KVState.create({"full": kf.FullAttention(num_blocks=n, block_size=4),
                              "swa": kf.SlidingWindow(num_blocks=n, block_size=4,
                                                      sliding_window=8)},
                             256, enable_prefix_caching=True, layout="shared")


def _steps(k: int) -> list[tuple[str, str, int]]:
    """A program: admissions of prompts sharing prefixes, decode steps and frees."""
    out: list[tuple[str, str, int]] = []
    for i in range(k):
        rid = f"r{i % 5}"
        out.append(("admit", rid, 8 + 4 * (i % 3)))
        out.append(("decode", rid, 5))
        if i % 2:
            out.append(("free", rid, 0))
    return out


def _run(state: kf.KVState, steps: list[tuple[str, str, int]],
         seen: list[Any] | None = None) -> list[kf.KVState]:
    """Every state the program goes through (a request already running is freed first);
    ``seen`` gets each state's contents read as it is made, the newest of its lineage."""
    states = [state]
    running: dict[str, int] = {}
    for op, rid, n in steps:
        if op == "admit":
            if any(g.row(rid) is not None for g in state.groups):
                state = kf.free_request(state, rid)[0]
            tokens = [ord(rid[-1]) % 2 * 100 + t for t in range(n)]
            h = kf.BlockHashes.of(tokens, 4)
            hit = kf.lookup_prefix(state, h, max_tokens=n - 1)
            r = kf.allocate_slots(state, rid, hit.num_tokens, n - hit.num_tokens,
                                  block_hashes=h, prefix_hit=hit)
            if r.ok:
                state, running[rid] = r.state, n
        elif op == "decode" and rid in running:
            for _ in range(n):
                r = kf.allocate_slots(state, rid, running[rid], 1)
                if r.ok:
                    state, running[rid] = r.state, running[rid] + 1
        elif op == "free" and rid in running:
            state = kf.free_request(state, rid)[0]
            del running[rid]
        states.append(state)
        if seen is not None:
            seen.append(_contents(state))
    return states


def _contents(state: kf.KVState) -> Any:
    return [p.identity() for p in state.pools], [g.identity() for g in state.groups]


def test_every_old_state_of_a_run_reads_as_it_was_made() -> None:
    seen: list[Any] = []
    states = _run(_state(), _steps(24), seen)  # each read as it was made, from the store
    assert [_contents(s) for s in reversed(states[1:])] == seen[::-1]  # read back: rolled back
    assert [_contents(s) for s in states[1:]] == seen  # oldest first: each a fork of its own
    for s in states[::5]:
        kf.check_invariants(s)


def test_a_linear_run_writes_one_store_in_place() -> None:
    state = _state()
    store = state.pools[0].ver.store
    heads = []
    for step in _steps(12):  # each new state heads the very store its first state did
        state = _run(state, [step])[-1]
        heads.append(state.pools[0].ver.store)
    assert store is not None and all(head is store for head in heads)
    assert [store.refs, store.hash_of] == [list(state.pools[0].refs or ()),
                                           state.pools[0].hash_of]


def test_branches_from_one_state_never_see_each_other() -> None:
    base = _run(_state(), _steps(6))[-1]
    before = _contents(base)
    a = _run(base, _steps(9))[-1]
    b = _run(base, [("admit", "x", 12), ("decode", "x", 9)])[-1]
    a2 = _run(base, _steps(9))[-1]  # the first branch again, from the same old state
    assert _contents(base) == before
    assert _contents(a) == _contents(a2) != _contents(b)
    for s in (base, a, b, a2):
        kf.check_invariants(s)


def test_a_transition_that_raises_undoes_its_writes() -> None:
    state = _run(_state(), _steps(6))[-1]
    before = _contents(state)
    h = kf.BlockHashes.of(list(range(12)), 4)
    good = ("z", 0, 12, 0, 0, None, h, None)
    with pytest.raises(kf.InvalidTypeError):
        kf.allocate_batch(state, [good, ("y", 0, "nine")])  # the first entry wrote blocks
    assert _contents(state) == before
    store = state.pools[0].ver.store
    assert store is not None and store.txn is None  # still the head, and free to write
    r = kf.allocate_batch(state, [good])
    assert r.state.pools[0].ver.store is store and not r.refused
    kf.check_invariants(r.state)


def test_a_transition_left_open_only_costs_a_fork() -> None:
    state = _run(_state(), _steps(6))[-1]
    before = _contents(state)
    store, log = claim(state.pools[0].ver)  # claimed and never given back
    log.append((_lineage.REFS, 1, store.refs[1]))
    store.refs[1] += 7
    assert _contents(state) == before  # a read rolls the pending write back on a copy
    after = _run(state, _steps(4))[-1]
    assert after.pools[0].ver.store is not store
    assert _contents(after) == _contents(_run(_run(_state(), _steps(6))[-1], _steps(4))[-1])
    kf.check_invariants(after)


def test_an_old_state_kept_while_the_run_goes_on_gets_its_own_store(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_lineage, "COMPACT_MIN", 16)
    states = _run(_state(16), _steps(16))
    kept, want, newest = states[2], _contents(states[2]), states[-1]
    del states  # the logs from ``kept`` to ``newest`` now serve ``kept`` alone
    later = _run(newest, _steps(40))  # every state held: their logs are short
    gc.collect()
    assert kept.pools[0].ver.store is not None  # materialized: no log chain held
    assert kept.pools[0].ver.node.parent is None and kept.pools[0].ver.node.undo is None
    assert _contents(kept) == want
    twins = _run(_run(_state(16), _steps(16))[-1], _steps(40))
    assert [_contents(s) for s in later] == [_contents(s) for s in twins]
    kf.check_invariants(later[-1])


def test_compaction_keeps_states_whose_logs_are_short() -> None:
    s = Store([0] * 4, None, [4] * 5, [4] * 5, None)
    versions = [Version(s)]
    for i in range(40):  # one write each: every old version is cheap to keep
        store, log = claim(versions[-1])
        log.append((_lineage.REFS, i % 4, store.refs[i % 4]))
        store.refs[i % 4] += 1
        versions.append(commit(store, log, versions[-1]))
    assert all(v.store is None for v in versions[:-1])  # none copied: their logs are short
    for i, v in enumerate(versions):
        with reading(v) as seen:
            assert sum(seen.refs) == i


def test_a_fork_reads_past_a_pending_write_in_any_order() -> None:
    s = Store([0, 0, 0], [None] * 3, [3] * 4, [3] * 4, {b"k": 1})
    head = Version(s)
    store, log = claim(head)
    # a writer logs before it writes; a fork may copy between the two
    log.append((_lineage.REFS, 2, 0))
    log.append((_lineage.KEYS, b"k", 1))
    log.append((_lineage.KEYS, b"new", _lineage.MISSING))
    with _lineage.LOCK:
        early = content(head)
    store.refs[2] = 9
    store.by_key[b"k"] = 2
    store.by_key[b"new"] = 0
    store.prev.append(0)  # a marker node appended
    late = materialize(head)
    for seen in (early, late):
        assert (seen.refs, seen.by_key, len(seen.prev)) == ([0, 0, 0], {b"k": 1}, 4)
    _lineage.abort(store, log)
    assert (store.refs, store.by_key, len(store.prev), store.txn) == ([0, 0, 0], {b"k": 1}, 4,
                                                                       None)


def test_threads_reading_and_writing_one_lineage_agree_with_a_lone_run() -> None:
    base = _run(_state(), _steps(6))[-1]
    want = _contents(_run(base, _steps(8))[-1])
    fixed = _contents(base)
    results: list[Any] = [None] * 4
    barrier = threading.Barrier(4, timeout=30)

    def work(i: int) -> None:
        barrier.wait()
        if i % 2:
            results[i] = _contents(_run(base, _steps(8))[-1])
        else:
            results[i] = [_contents(base) for _ in range(20)]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results[1] == results[3] == want
    assert all(seen == fixed for seen in results[0] + results[2])


def test_a_fork_while_the_holder_adds_a_marker_node_reads_the_value_before() -> None:
    s = Store([0, 0], None, [2, 2, 2], [2, 2, 2], None)
    head = Version(s)
    store, log = claim(head)
    # the holder logs writes to a marker node (index 3) it is about to append, after a
    # fork copied the arrays: the fork has no index 3 and must not write there
    log.append((_lineage.NEXT, 3, 0))
    log.append((_lineage.PREV, 3, 0))
    log.append((_lineage.NEXT, 2, 2))
    store.next[2] = 3
    with _lineage.LOCK:
        seen = content(head)
    assert (seen.prev, seen.next) == ([2, 2, 2], [2, 2, 2])
    _lineage.abort(store, log)


def test_marker_nodes_are_reused_once_a_reset_unlinks_them() -> None:
    s = kf.KVState.create({"full": kf.FullAttention(num_blocks=16, block_size=4)}, 64,
                          enable_prefix_caching=True)
    h = kf.BlockHashes.of(list(range(8)), 4)
    for _ in range(50):
        s = kf.allocate_slots(s, "a", 0, 8, block_hashes=h).state
        s = kf.free_request(s, "a", priority=3)[0]
        s = kf.reset_prefix_cache(s)[0]
    with s.pools[0].reading() as store:
        assert len(store.next) <= 16 + 1 + 2  # the sentinel, priority 0's and 3's markers
    kf.check_invariants(s)


def test_transitions_on_an_old_state_copy_its_contents_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    copies = []
    real = _lineage.materialize

    def counting(v: Version) -> Store:
        copies.append(v)
        return real(v)

    monkeypatch.setattr(_lineage, "materialize", counting)
    s = kf.KVState.create({"full": kf.FullAttention(num_blocks=64, block_size=4)}, 1024,
                          enable_prefix_caching=True)
    old = kf.allocate_slots(s, "a", 0, 40, block_hashes=kf.BlockHashes.of(range(40), 4)).state
    new = kf.allocate_slots(old, "a", 40, 1).state  # ``old`` is no longer the head
    for _ in range(5):
        assert not kf.allocate_slots(old, "b", 0, 4000).ok  # refused: no room
        assert old.pools[0].refs is not None and len(old.pools[0].by_key) == 10
    assert len(copies) == 1 and old.pools[0].ver.store is not None  # it heads its copy now
    assert _contents(new) != _contents(old)
    kf.check_invariants(old)
    kf.check_invariants(new)


def test_compaction_copies_one_of_a_cluster_of_kept_states(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_lineage, "COMPACT_MIN", 16)
    states = _run(_state(16), _steps(10))
    cluster, want = states[2:8], [_contents(s) for s in states[2:8]]
    newest = states[-1]
    del states
    later = _run(newest, _steps(60))
    gc.collect()
    own = [s.pools[0].ver.store is not None for s in cluster]
    assert own == [False] * 5 + [True]  # the newest of them was copied; the others chain into it
    assert [_contents(s) for s in cluster] == want
    kf.check_invariants(later[-1])


def test_a_pickled_or_copied_state_shares_nothing_with_its_lineage() -> None:
    states = _run(_state(), _steps(8))
    for s in (states[1], states[4], states[-1]):
        for twin in (pickle.loads(pickle.dumps(s)), copy.deepcopy(s)):
            assert twin == s and twin.pools[0].ver.store is not None
            assert twin.pools[0].ver.store is not s.pools[0].ver.store
            kf.check_invariants(twin)
    again = _run(copy.deepcopy(states[4]), _steps(3))[-1]
    assert _contents(again) == _contents(_run(states[4], _steps(3))[-1])


@pytest.mark.parametrize(("layout", "n"), [("shared", 24), ("per-type", 12)])
def test_a_run_of_blocks_cached_or_evicted_logs_one_entry_and_rolls_back(layout: str,
                                                                         n: int) -> None:
    """A prompt caches a run of blocks (one ``CACHED`` entry in the log) and, once freed,
    another takes them back from the queue, evicting a run (one ``UNCACHED`` entry); every
    old state still reads as it was made, and a lookup on it still finds the first prompt."""
    policies = {"full": kf.FullAttention(num_blocks=n, block_size=4),
                "swa": kf.SlidingWindow(num_blocks=n, block_size=4, sliding_window=8)}
    state = kf.KVState.create(policies, 256, enable_prefix_caching=True, layout=layout)
    seen: list[Any] = []
    states = _run(state, [("admit", "a", 40), ("free", "a", 0), ("admit", "b", 40)], seen)
    logs = [e for s in states[:-1] for p in s.pools for e in p.ver.node.undo or ()]
    runs = {kind: max((len(e[1]) for e in logs if e[0] == kind), default=0)
            for kind in (_lineage.CACHED, _lineage.UNCACHED)}
    assert runs[_lineage.CACHED] == 10 and runs[_lineage.UNCACHED] >= 9  # one entry a run
    assert [_contents(s) for s in reversed(states[1:])] == seen[::-1]
    assert [_contents(s) for s in states[1:]] == seen
    prompt = kf.BlockHashes.of([100 + t for t in range(40)], 4)
    assert kf.lookup_prefix(states[2], prompt).num_tokens == 40  # freed, still cached
    assert kf.lookup_prefix(states[3], prompt).num_tokens < 40  # evicted (in part) by "b"
    for s in states:
        kf.check_invariants(s)
