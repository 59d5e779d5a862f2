"""kvfunc's drop-in manager against vLLM's own: same constructor, same answers, block for block."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
from hypothesis import given
from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmManager
from vllm.v1.request import RequestStatus
from vllm_programs import BLOCK, Player, programs

import kvfunc as kf
from kvfunc.vllm import KVCacheManager, ShadowKVCacheManager
from kvfunc.vllm.harness import kv_cache_config, make_request

#: What vLLM 0.33's Scheduler (and its connectors' binding) reads on its manager.
SCHEDULER_SURFACE = (
    "new_step_starts", "get_computed_blocks", "get_computed_blocks_for_connector",
    "allocate_slots", "get_blocks", "get_block_ids", "get_block_ids_for_computed_tokens",
    "free", "pop_blocks_for_free", "cache_blocks", "estimate_cached_tokens",
    "truncate_computed_blocks", "remove_skipped_blocks", "record_prefix_cache_stats",
    "make_prefix_cache_stats", "reset_prefix_cache", "take_events", "take_new_block_ids",
    "take_kv_cache_block_copies", "take_boundary_state_offloads", "record_blocks_for_zeroing",
    "evict_blocks", "usage", "empty_kv_cache_blocks", "finalize_partial_tail_offloads",
    "mamba_shared_prefix_checkpoint", "block_pool", "coordinator", "prefix_cache_stats",
    "kv_cache_config", "num_kv_cache_groups")


def manager(windows: tuple[int | None, ...] = (None,), *, num_blocks: int = 40,
            caching: bool = True, cls: type = KVCacheManager, events: bool = True,
            **kwargs: object) -> object:
    """A manager (kvfunc's unless ``cls`` says otherwise) of block size BLOCK."""
    return cls(kv_cache_config(num_blocks, BLOCK, windows), max_model_len=256,
               scheduler_block_size=BLOCK, hash_block_size=BLOCK, enable_caching=caching,
               log_stats=True, enable_kv_cache_events=events, **kwargs)


def test_constructor_is_vllms() -> None:
    """The constructor takes exactly vLLM 0.33's parameters, with its defaults."""
    mine = inspect.signature(KVCacheManager.__init__).parameters
    theirs = inspect.signature(VllmManager.__init__).parameters
    assert [(p.name, p.default) for p in theirs.values()] == [
        (p.name, p.default) for p in mine.values()]


def test_scheduler_surface_is_there() -> None:
    """Every method and attribute the scheduler uses exists on kvfunc's manager."""
    m = manager()
    assert [] == [name for name in SCHEDULER_SURFACE if not hasattr(m, name)]
    group = m.coordinator.single_type_managers[0]
    assert (BLOCK, "FullAttentionSpec") == (group.block_size, type(group.kv_cache_spec).__name__)


CONFIGS = [((None,), True, 0.0, True), ((None,), False, 0.0, True), ((None, 8), True, 0.0, True),
           ((None, 8), False, 0.1, True), ((6, None), True, 0.0, True),
           ((None,), True, 0.0, False), ((None, 8), True, 0.0, False)]


@pytest.mark.parametrize(("windows", "caching", "watermark", "events"), CONFIGS)
@given(program=programs)
def test_random_programs_answer_as_vllm(windows: tuple[int | None, ...], caching: bool,
                                        watermark: float, events: bool,
                                        program: list[tuple]) -> None:
    """A strict shadow finds no difference in hits, refusals, block ids, counts, stats, events
    (without KV events, calls that only cache a block are owed: the answers are the same)."""
    shadow = manager(windows, caching=caching, cls=ShadowKVCacheManager, strict=True,
                     watermark=watermark, events=events)
    assert shadow.mirror is not None
    Player(shadow, windows).run(program)
    assert shadow.divergence is None
    kf.check_invariants(shadow.mirror.state)


def test_hit_takes_the_cached_blocks_and_counts_as_vllm() -> None:
    """A second identical prompt hits the first one's full blocks; stats follow vLLM's meaning."""
    m = manager()
    a = make_request("a", list(range(10)), block_size=BLOCK)
    blocks, hit, _ = m.get_computed_blocks(a)
    assert (0, ([1, 2, 3],)) == (hit, m.allocate_slots(a, 10, hit, blocks).get_block_ids())
    b = make_request("b", list(range(10)), block_size=BLOCK)
    blocks, hit, _ = m.get_computed_blocks(b)
    m.record_prefix_cache_stats(b, hit)
    assert (8, ([1, 2],)) == (hit, blocks.get_block_ids())
    stats = m.make_prefix_cache_stats()
    assert (1, 10, 8) == (stats.requests, stats.queries, stats.hits)


class _Recording:
    """A manager whose every call's answer, and the free count after it, is logged (read
    without paying anything owed: a shadow would read the state, and pay, after each call)."""

    def __init__(self, manager: Any) -> None:
        self.manager, self.log = manager, []

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.manager, name)
        if not callable(value):
            return value

        def call(*args: Any, **kwargs: Any) -> Any:
            out = value(*args, **kwargs)
            self.log.append((name, _plain(out), self.manager.block_pool.get_num_free_blocks()))
            return out
        return call


def _plain(value: Any) -> Any:
    """An answer as plain values: block handles as ids, ``KVCacheBlocks`` as their ids."""
    if hasattr(value, "get_block_ids"):
        return value.get_block_ids()
    if hasattr(value, "block_id"):
        return value.block_id
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value


@pytest.mark.parametrize("windows", [(None,), (None, 8), (6, None), (None, 6)])
@given(program=programs)
def test_owing_calls_to_the_cache_changes_no_answer(windows: tuple[int | None, ...],
                                                    program: list[tuple]) -> None:
    """The same random program on a manager that owes calls which only cache a block, on one
    that makes each its own transition, on an owing one with a journal (every transition
    builds its delta; without one none is read, so none is built) and on vLLM's own: every
    call's answer and the free count after each call are the same, and so are the kvfunc
    states at the end, with owed calls kept across calls (nothing reads the state between
    them); the journal's deltas replay to that state."""
    logs, states = [], []
    deltas: list[kf.BlocksChanged] = []
    for owing, journaled in ((True, False), (False, False), (True, True)):
        m = manager(windows, events=False)
        m._defers = owing
        start = m._value
        if journaled:
            m._journal = lambda call, rid, args, delta: deltas.append(delta)
        assert m._records is journaled
        player = Player(_Recording(m), windows)
        player.run(program)
        logs.append(player.manager.log)
        states.append(m.state)
        kf.check_invariants(m.state)
    assert kf.replay(start, deltas) == states[2]
    theirs = Player(_Recording(manager(windows, events=False, cls=VllmManager)), windows)
    theirs.run(program)
    assert logs[0] == logs[1] == logs[2] == theirs.manager.log
    assert states[0] == states[1] == states[2]


def _both_ways(windows: tuple[int | None, ...], scenario: Any) -> list[Any]:
    """``scenario(manager)`` on a manager that owes, on one that does not and on vLLM's own:
    the log of answers (the same, or the test fails; the two kvfunc states too)."""
    runs = []
    for owing in (True, False):
        m = manager(windows, events=False)
        m._defers = owing
        rec = _Recording(m)
        scenario(rec)
        runs.append((rec.log, m.state))
    theirs = _Recording(manager(windows, events=False, cls=VllmManager))
    scenario(theirs)
    assert runs[0][0] == runs[1][0] == theirs.log
    assert runs[0][1] == runs[1][1]
    return runs[0][0]


def _running(rid: str, prompt: list[int], computed: int) -> Any:
    req = make_request(rid, prompt, block_size=BLOCK, max_tokens=16)
    req.status, req.num_computed_tokens = RequestStatus.RUNNING, computed
    return req


def test_a_step_that_takes_and_fills_blocks_pays_a_digest_owed_by_another_first() -> None:
    """A owes the caching of a block whose digest C's next chunk also fills: C's step (it
    takes blocks, every block it held cached already) pays A's first, and is not owed itself
    (A's later take, owed with A's caching, would come after it), so A's copy is the one
    cached first and the next lookup hits it, as vLLM's does."""
    shared = list(range(3 * BLOCK))

    def scenario(m: Any) -> None:
        a = _running("a", shared, 0)
        assert m.allocate_slots(a, BLOCK + 1) is not None
        c = make_request("c", [*shared, 50, 51, 52, 53, 54], block_size=BLOCK)
        blocks, hit, _ = m.get_computed_blocks(c)
        assert hit == BLOCK and m.allocate_slots(c, BLOCK, hit, blocks) is not None
        c.status, c.num_computed_tokens = RequestStatus.RUNNING, 2 * BLOCK
        a.num_computed_tokens = BLOCK + 1
        assert m.allocate_slots(a, BLOCK + 1) is not None  # takes a block
        m.get_block_ids("a")  # a table read: what is owed is paid
        a.num_computed_tokens = 2 * BLOCK + 2
        assert m.allocate_slots(a, BLOCK - 2) is not None  # fills it: owed
        assert m.allocate_slots(c, 2 * BLOCK) is not None  # fills a copy of it
        c.num_computed_tokens = 4 * BLOCK
        a.num_computed_tokens = 3 * BLOCK
        a.append_output_token_ids(7)
        assert m.allocate_slots(a, 1) is not None
        m.get_computed_blocks(make_request("e", [*shared, 9], block_size=BLOCK))

    log = _both_ways((None,), scenario)
    assert log[-1][1][1] == 3 * BLOCK  # the last lookup hit every shared block


def test_a_step_whose_window_lets_an_owed_block_go_caches_it_first() -> None:
    """A owes the caching of two blocks; its next step slides both out of its window: they
    are cached first and let go cached (vLLM cached them when they filled)."""
    def scenario(m: Any) -> None:
        a = _running("a", list(range(4 * BLOCK)), 0)
        assert m.allocate_slots(a, 5, num_lookahead_tokens=11) is not None
        a.num_computed_tokens = 5
        assert m.allocate_slots(a, 9) is not None  # fills blocks 1 and 2: owed
        a.num_computed_tokens = 14
        assert m.allocate_slots(a, 1) is not None  # the window lets blocks 0 and 1 go
        m.get_computed_blocks(make_request("e", list(range(4 * BLOCK)) + [9],
                                           block_size=BLOCK))

    for windows in ((None, 6), (6, None)):
        _both_ways(windows, scenario)


def test_a_block_owed_to_the_cache_is_a_hit_for_the_next_lookup() -> None:
    """Without KV events a decode call that only fills a block is owed, not a transition;
    the next lookup that could hit it pays what is owed first and hits it, as vLLM's does,
    while a lookup of other digests leaves it owed; the state read has it cached."""
    m = manager(events=False)
    a = make_request("a", list(range(14)), block_size=BLOCK, max_tokens=16)
    assert m.allocate_slots(a, 14) is not None
    a.num_computed_tokens = 14
    a.append_output_token_ids(14)
    a.append_output_token_ids(15)  # block 3 (tokens 12..15) is full once these are written
    value = m._value
    assert m.allocate_slots(a, 2).get_block_ids() == ([],)  # no block taken
    assert m._value is value and "a" in m._owed  # owed: no transition yet
    other = make_request("c", [7] * 9, block_size=BLOCK)
    assert m.get_computed_blocks(other)[1] == 0 and "a" in m._owed  # other digests: still owed
    b = make_request("b", list(range(16)) + [99], block_size=BLOCK)
    blocks, hit, _ = m.get_computed_blocks(b)
    assert (hit, blocks.get_block_ids()) == (16, ([1, 2, 3, 4],)) and not m._owed
    assert m.state.group(m.state.manager_keys[0]).row("a").stored == 4
    kf.check_invariants(m.state)


def test_refusal_leaves_the_state_but_frees_what_slid_out() -> None:
    """A refused allocation changes nothing but the window's dead blocks, as vLLM frees them."""
    m = manager((8,), num_blocks=6)
    a = make_request("a", list(range(16)), block_size=BLOCK)
    assert m.allocate_slots(a, 16) is not None
    a.num_computed_tokens = 16
    for _ in range(5):
        a.append_output_token_ids(1)
    assert 1 == m.num_free_blocks
    assert m.allocate_slots(a, 5, num_lookahead_tokens=8) is None
    assert ([0, 0, 3, 4],) == m.get_block_ids("a")
    assert 3 == m.num_free_blocks


def test_deferred_free_holds_blocks_until_the_pool_lets_them_go() -> None:
    """pop_blocks_for_free keeps the blocks out of reach; block_pool.free_blocks returns them."""
    m = manager()
    a = make_request("a", list(range(9)), block_size=BLOCK)
    m.allocate_slots(a, 9)
    blocks = m.pop_blocks_for_free(a)
    assert ([1, 2, 3], 36, ([],)) == ([b.block_id for b in blocks], m.num_free_blocks,
                                      m.get_block_ids("a"))
    b = make_request("b", [50] * 8, block_size=BLOCK)
    assert ([4, 5],) == m.allocate_slots(b, 8).get_block_ids()
    m.block_pool.free_blocks(reversed(blocks))
    assert 37 == m.block_pool.get_num_free_blocks()


def test_free_blocks_refuses_a_block_it_did_not_give() -> None:
    """A block this manager never handed out is a typed error, and nothing changes."""
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    m = manager()
    state = m.state
    with pytest.raises(kf.InvalidArgumentError, match="is not detached"):
        m.block_pool.free_blocks([KVCacheBlock(3)])
    assert m.state is state


def test_reset_refuses_while_blocks_are_in_use() -> None:
    """reset_prefix_cache answers False while a block is held, True (and AllBlocksCleared) after."""
    from vllm.distributed.kv_events import AllBlocksCleared, BlockStored

    m = manager()
    a = make_request("a", list(range(8)), block_size=BLOCK)
    m.allocate_slots(a, 8)
    assert not m.reset_prefix_cache()
    m.free(a)
    assert m.reset_prefix_cache()
    events = m.take_events()
    assert [BlockStored, AllBlocksCleared] == [type(e) for e in events]
    assert (True, 0) == (m.make_prefix_cache_stats().reset, kf.num_cached_blocks(m.state,
                                                                                "group0"))


def test_evicted_blocks_miss_but_stay_held() -> None:
    """evict_blocks forgets a held block's hash: the next lookup stops before it."""
    m = manager()
    a = make_request("a", list(range(9)), block_size=BLOCK)
    m.allocate_slots(a, 9)
    m.evict_blocks({2})
    b = make_request("b", list(range(9)), block_size=BLOCK)
    assert (4, ([1, 2, 3],)) == (m.get_computed_blocks(b)[1], m.get_block_ids("a"))


def test_watermark_applies_to_waiting_requests_only() -> None:
    """With a watermark, a waiting request must leave it free; a running one may use it."""
    m = manager(num_blocks=10, watermark=0.5)
    a = make_request("a", list(range(16)), block_size=BLOCK)
    assert m.allocate_slots(a, 20) is None
    a.status = RequestStatus.RUNNING
    assert ([1, 2, 3, 4, 5],) == m.allocate_slots(a, 20).get_block_ids()


def test_snapshot_restore_replays_a_step_exactly() -> None:
    """A snapshot is a KVState; restoring it and repeating a call gives the same blocks."""
    m = manager()
    a = make_request("a", list(range(9)), block_size=BLOCK)
    m.allocate_slots(a, 9)
    snap = m.snapshot()
    b = make_request("b", list(range(20, 29)), block_size=BLOCK)
    first = m.allocate_slots(b, 9).get_block_ids()
    m.restore(snap)
    assert (([],), first) == (m.get_block_ids("b"), m.allocate_slots(b, 9).get_block_ids())


def test_restore_takes_only_a_snapshot_of_the_same_layout() -> None:
    """Restoring something else is a typed error and keeps the current state."""
    m = manager()
    state = m.state
    other = manager((None, 8)).state
    with pytest.raises(kf.InvalidArgumentError, match="same KV cache layout"):
        m.restore(other)
    with pytest.raises(kf.InvalidTypeError):
        m.restore("state")  # type: ignore[arg-type]
    assert m.state is state


def test_the_owing_requests_next_step_owes_its_take_with_what_it_owes() -> None:
    """A decode call that fills a block is owed; the request's next call, which takes a
    block, is owed too, with that caching (one entry, nothing paid): it answers with the
    block the queue hands out next, the free count counts it taken, and a read of the state
    pays both.  The answers are those of a manager that does not owe and of vLLM's."""
    paid: list[int] = []

    def scenario(m: Any) -> None:
        inner = m.manager
        owing = getattr(inner, "_defers", False)  # vLLM's own manager owes nothing
        if owing:
            real = inner._pay_owed
            inner._pay_owed = lambda: paid.append(1) or real()
        a = make_request("a", list(range(14)), block_size=BLOCK, max_tokens=16)
        assert m.allocate_slots(a, 14) is not None
        a.num_computed_tokens = 14
        a.append_output_token_ids(14)
        a.append_output_token_ids(15)
        m.allocate_slots(a, 2)  # fills block 3: owed when owing
        if owing:
            assert "a" in inner._owed
        a.status, a.num_computed_tokens = RequestStatus.RUNNING, 16
        a.append_output_token_ids(16)
        assert m.allocate_slots(a, 1).get_block_ids() == ([5],)  # takes a block
        if owing:
            assert list(inner._owed) == ["a"] and inner._owed["a"][4] == [[5]] and not paid
            assert inner._value.group(inner._value.manager_keys[0]).row("a").length == 4
            row = inner.state.group(inner._value.manager_keys[0]).row("a")  # pays
            assert paid and not inner._owed and (row.length, row.stored) == (5, 4)

    _both_ways((None,), scenario)


def _started(m: Any, rid: str, prompt: list[int], hashed: bool = True) -> Any:
    """A request whose prompt was computed in one call, its first token sampled (without
    ``hashed``, a request vLLM hashes nothing of: nothing of it is ever cached)."""
    req = _running(rid, prompt, 0)
    if not hashed:
        req._block_hasher = None
        req.block_hashes.clear()
    assert m.allocate_slots(req, len(prompt)) is not None
    req.num_computed_tokens = len(prompt)
    req.append_output_token_ids(7)
    return req


def _decode(m: Any, req: Any) -> Any:
    """One decode step of ``req``: its new token's slot, then the token computed and the next
    one sampled."""
    out = m.allocate_slots(req, 1)
    req.num_computed_tokens += 1
    req.append_output_token_ids(7)
    return out


def _owing(m: Any) -> Any:
    """The kvfunc manager inside a recording when it owes calls, else None."""
    inner = m.manager
    return inner if getattr(inner, "_defers", False) else None


@pytest.mark.parametrize("windows", [(None,), (None, 2 * BLOCK)])
def test_transitions_build_no_delta_unless_one_is_read(windows: tuple[int | None, ...],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Without KV events, a metrics collector, zeroing or a journal nothing reads a delta: a
    prefill, decode steps (owed or not, a window's slides), the payment of the owed calls
    and a free build none (the random programs above check the states against a journaled
    manager's); with a journal, KV events or a collector (even one set after the manager
    was built), every transition builds its delta, and the collector hears of it."""
    import kvfunc.core._runs as runs
    import kvfunc.core._transitions as transitions

    built: list[int] = []

    class Counting(transitions.DeltaBuilder):
        def __init__(self) -> None:
            built.append(1)
            super().__init__()

    class Collector:  # vLLM's block residency metrics, as calls
        def __init__(self) -> None:
            self.calls: list[str] = []

        def __getattr__(self, name: str) -> Any:
            return lambda *_: self.calls.append(name)

    monkeypatch.setattr(transitions, "DeltaBuilder", Counting)
    monkeypatch.setattr(runs, "DeltaBuilder", Counting)
    journaled: list[kf.BlocksChanged] = []
    for events, journal, collector in (
            (False, None, None), (False, lambda *e: journaled.append(e[3]), None),
            (True, None, None), (False, None, Collector())):
        m = manager(windows, events=events)
        m._journal = journal
        m.metrics_collector = collector  # set after construction: read at each transition
        start = m._value
        del built[:]
        a = _started(m, "a", list(range(3 * BLOCK)))
        b = _started(m, "b", list(range(100, 100 + BLOCK + 1)))
        for _ in range(3 * BLOCK):
            _decode(m, a)
            _decode(m, b)
        assert m.get_block_ids("a")  # pays what is owed
        m.free(a)
        m.free(b)
        assert (len(built) >= 4) if events or journal or collector else not built
        assert collector is None or "on_block_allocated" in collector.calls
        if journal is not None:  # every transition's delta, none left out: they replay
            assert kf.replay(start, journaled) == m.state
        kf.check_invariants(m.state)


def test_decode_steps_that_take_blocks_are_owed_and_answer_the_blocks_they_will_take() -> None:
    """Two running requests each need a new block: both calls are owed (no transition) and
    answer the free queue's next blocks in call order, the free count counts them taken,
    and a read of a table pays them first (its answer has the block)."""
    def scenario(m: Any) -> None:
        a = _started(m, "a", list(range(BLOCK)))
        b = _started(m, "b", list(range(50, 50 + BLOCK)))
        inner = _owing(m)
        value = None if inner is None else inner._value
        first, second = _decode(m, a).get_block_ids(), _decode(m, b).get_block_ids()
        assert all(len(ids) == 1 for ids in first + second)  # one block in every group
        if inner is not None:
            assert inner._value is value and inner._takes == len(first) + len(second)
        m.get_block_ids("a")
        if inner is not None:
            assert not inner._takes and inner._value is not value

    _both_ways((None,), scenario)
    _both_ways((None, 6), scenario)


def test_a_window_step_that_lets_cached_blocks_go_is_owed_behind_owed_takes() -> None:
    """While A's take is owed, B's window lets a cached block go: B's call is owed too (the
    block joins the back of the free queue, behind A's, when it is paid, and counts free at
    once), and nothing is paid; every answer and free count is vLLM's."""
    def scenario(m: Any) -> None:
        a = _started(m, "a", list(range(BLOCK)))
        b = _started(m, "b", list(range(50, 59)))
        inner = _owing(m)
        _decode(m, a)  # takes a block: owed
        value = None if inner is None else inner._value
        free = m.block_pool.get_num_free_blocks()
        _decode(m, b)  # the window (6 tokens) lets b's first block go
        if inner is not None:
            assert inner._takes == len(inner._layout.keys) and inner._value is value
            assert inner._slides == 1
        assert m.block_pool.get_num_free_blocks() == free + 1
        m.get_computed_blocks(make_request("e", list(range(50, 59)), block_size=BLOCK))
        if inner is not None:
            assert not inner._takes and not inner._slides and inner._value is not value

    for windows in ((None, 6), (6, None)):
        _both_ways(windows, scenario)


def test_a_window_step_that_lets_an_uncached_block_go_pays_the_owed_takes_first() -> None:
    """While A's take is owed, B's window lets go a block that caches nothing: it would go
    to the front of the free queue, where A's block is promised, so A's take is paid first."""
    def scenario(m: Any) -> None:
        a = _started(m, "a", list(range(BLOCK)))
        b = _started(m, "b", list(range(50, 59)), hashed=False)
        inner = _owing(m)
        _decode(m, a)
        _decode(m, b)
        if inner is not None:
            assert not inner._takes
        assert _decode(m, _started(m, "c", list(range(90, 90 + BLOCK)))) is not None

    for windows in ((None, 6), (6, None)):
        _both_ways(windows, scenario)


def test_recycling_and_deferred_frees_pay_the_owed_takes_first() -> None:
    """``remove_skipped_blocks`` and ``block_pool.free_blocks`` put blocks in the free queue:
    with a take owed, each pays it first (a change before the owed takes is refused)."""
    def scenario(m: Any) -> None:
        a = _started(m, "a", list(range(BLOCK)))
        b = _started(m, "b", list(range(50, 59)), hashed=False)
        c = _started(m, "c", list(range(90, 90 + 3 * BLOCK)))
        inner = _owing(m)
        _decode(m, a)
        m.remove_skipped_blocks("b", 9)
        if inner is not None:
            assert not inner._takes
        held = m.pop_blocks_for_free(c)
        _decode(m, a)
        _decode(m, a)
        _decode(m, a)
        _decode(m, a)  # a block again: owed
        if inner is not None:
            assert inner._takes == 2
        m.block_pool.free_blocks(held)
        if inner is not None:
            assert not inner._takes
        _decode(m, b)

    _both_ways((None, 6), scenario)


def test_a_change_before_the_owed_takes_or_a_take_off_its_promise_is_a_typed_error() -> None:
    """Two checks that guard the owed takes: a transition committed while takes are owed
    (one that does not come before them), and a payment whose takes are not the blocks
    promised, are typed errors (a bug in the manager, not a wrong block handed on)."""
    m = manager(events=False)
    a = _started(m, "a", list(range(BLOCK)))
    _decode(m, a)
    assert m._takes == 1
    value = m._value
    state, delta = kf.free_request(value, "a")
    with pytest.raises(kf.KVFuncError, match="before the owed takes"):
        m._commit(state, delta, "free", a)
    assert m._takes == 1 and m._value is value  # nothing changed
    m._journal = lambda *_: None
    with pytest.raises(kf.KVFuncError, match="built no delta"):
        m._commit(state, None, "free", a, ahead=True)  # a journal reads every delta
    m._journal = None
    assert m._takes == 1 and m._value is value
    m._owed["a"] = (*m._owed["a"][:4], [[m._owed["a"][4][0][0] + 1]])
    with pytest.raises(kf.KVFuncError, match="did not take the blocks"):
        m._pay_owed()
    m = manager(events=False)  # a payment whose blocks are not those counted
    _decode(m, _started(m, "a", list(range(BLOCK))))
    m._takes += 1  # the payment takes one block fewer than counted: not the promise
    with pytest.raises(kf.KVFuncError, match="other blocks than counted"):
        m._pay_owed()
    m = manager((None, 6), events=False)  # a slide whose blocks freed are not those counted
    b = _started(m, "b", list(range(50, 59)))
    _decode(m, b)  # the window (6 tokens) lets b's first block go: owed
    assert m._slides == 1
    m._freed -= 1
    with pytest.raises(kf.KVFuncError, match="other blocks than counted"):
        m._pay_owed()


def test_no_step_comes_before_owed_takes_while_priorities_order_the_free_queue() -> None:
    """With retention priorities in the free queue (a restored state), a block let go joins
    the back of its priority's segment, which may lie before a promised block: no step
    comes before the owed takes then."""
    m = manager((None, 6), events=False)
    hashes = kf.BlockHashes.of(range(8), block_size=BLOCK)
    s = kf.allocate_slots(m.state, "x", 0, 8, block_hashes=hashes).state
    m.restore(kf.free_request(s, "x", priority=5)[0])
    assert m._value.pools[0].queue.levels
    a = _started(m, "a", list(range(BLOCK)))
    b = _started(m, "b", list(range(50, 59)))
    _decode(m, a)
    assert m._takes and not m._ahead_of_takes(b, 9, 10)
    _decode(m, b)
    assert not m._takes
    kf.check_invariants(m.state)


def test_an_owed_take_that_caches_lists_its_digests_so_a_step_ahead_of_it_pays_first() -> None:
    """A's owed take also fills a block (digest Y); C's window step, which could come
    before the owed takes, fills a copy of Y: the take's owed digests include Y, so C's step
    pays first and A's copy is the one cached first, the copy the next lookup hits."""
    t = list(range(100, 112))

    def scenario(m: Any) -> None:
        c = _running("c", t, 0)
        assert m.allocate_slots(c, 9) is not None
        c.num_computed_tokens = 9
        a = _running("a", t[:11], 0)
        assert m.allocate_slots(a, 9) is not None
        a.num_computed_tokens = 9
        assert m.allocate_slots(a, 2) is not None  # the window lets a's first block go
        m.get_block_ids("a")  # (a read: the owed slide is paid)
        a.num_computed_tokens = 11
        a.append_output_token_ids(t[11])
        m.allocate_slots(a, 1, num_lookahead_tokens=1)  # fills Y, takes a block: owed
        inner = _owing(m)
        if inner is not None:
            assert inner._takes
        m.allocate_slots(c, 3)  # fills a copy of Y; its window lets a cached block go
        c.num_computed_tokens = 12
        m.get_computed_blocks(make_request("e", [*t, 999], block_size=BLOCK))

    for windows in ((None, 6), (6, None)):
        _both_ways(windows, scenario)


def test_a_step_pays_first_when_another_call_owes_a_digest_after_those_it_owes() -> None:
    """A owes a block's caching and its next step fills Y, which C owes: the step does not
    cache A's owed block in its own transition (that would cache A's copy of Y before C's,
    which came first); everything owed is paid first, and the lookup hits C's copy."""
    t = list(range(100, 112))

    def scenario(m: Any) -> None:
        c = _running("c", t[:11], 0)
        assert m.allocate_slots(c, 11, num_lookahead_tokens=1) is not None
        c.num_computed_tokens = 11
        c.append_output_token_ids(t[11])
        a = _running("a", t[:7], 0)
        assert m.allocate_slots(a, 7, num_lookahead_tokens=9) is not None
        a.num_computed_tokens = 7
        a.append_output_token_ids(t[7])
        m.allocate_slots(c, 1)  # C fills Y: owed
        c.num_computed_tokens = 12
        m.allocate_slots(a, 5)  # A fills its block 1: owed
        a.num_computed_tokens = 12
        for token in [*t[8:12], 555]:
            a.append_output_token_ids(token)
        m.allocate_slots(a, 1)  # A fills Y
        a.num_computed_tokens = 13
        m.get_computed_blocks(make_request("e", [*t, 999], block_size=BLOCK))

    _both_ways((None,), scenario)


def test_a_take_that_writes_below_its_owed_block_pays_it_first() -> None:
    """After A owes a block's caching, its computed count goes back (as vLLM's scheduler
    sets it after a failed KV load) and its next call takes a block: the take does not
    carry what A owes (a rewritten block is not cached by that step), so it is paid first
    and the next lookup hits it."""
    t = list(range(100, 112))

    def scenario(m: Any) -> None:
        a = _running("a", t[:7], 0)
        assert m.allocate_slots(a, 7) is not None
        a.num_computed_tokens = 7
        a.append_output_token_ids(t[7])
        m.allocate_slots(a, 1)  # fills block 1: owed
        a.num_computed_tokens = 3
        m.allocate_slots(a, 2, num_lookahead_tokens=6)  # takes a block from below it
        m.get_computed_blocks(make_request("e", [*t[:8], 999], block_size=BLOCK))

    _both_ways((None,), scenario)


def test_a_take_that_copies_a_shared_block_is_not_owed() -> None:
    """B hit A's blocks; its computed count goes back below them and its next call takes
    blocks: kvfunc copies the shared blocks it writes (vLLM writes them in place, so only
    the two kvfunc managers are compared), which an owed take cannot promise, so the call
    is made at once, and its answer and free count are those of a manager that does not
    owe."""
    def scenario(m: Any) -> None:
        a = _running("a", list(range(12)), 0)
        assert m.allocate_slots(a, 12) is not None
        a.num_computed_tokens = 12
        b = make_request("b", [*range(12), 77, 78], block_size=BLOCK)
        blocks, hit, _ = m.get_computed_blocks(b)
        assert hit == 12 and m.allocate_slots(b, 2, hit, blocks) is not None
        b.status, b.num_computed_tokens = RequestStatus.RUNNING, 14
        b.append_output_token_ids(5)
        b.append_output_token_ids(6)
        b.num_computed_tokens = 5
        m.allocate_slots(b, 12)
        assert not m.manager._takes
        m.get_block_ids("b")

    runs = []
    for owing in (True, False):
        m = manager(events=False)
        m._defers = owing
        rec = _Recording(m)
        scenario(rec)
        runs.append((rec.log, m.state))
    assert runs[0] == runs[1]
    assert runs[0][0][-1][1][0][1:3] != [2, 3]  # b's copies, not a's blocks


@pytest.mark.parametrize("events", [False, True])
def test_a_step_that_fills_nothing_still_counts_as_seen_for_the_next_caching(events: bool
                                                                               ) -> None:
    """A take that fills no block needs no hashes, but the request's news (digests, blocks
    written) count as seen all the same: a held block evicted after it is cached again
    only past the next block boundary, as documented, not at the next step that takes."""
    m = manager(num_blocks=8, events=events)
    a = make_request("a", list(range(9)), block_size=BLOCK, max_tokens=64)
    assert m.allocate_slots(a, 9).get_block_ids() == ([1, 2, 3],)
    a.status, a.num_computed_tokens = RequestStatus.RUNNING, 9
    a.append_output_token_ids(50)
    assert m.allocate_slots(a, 1, num_lookahead_tokens=30) is None  # refused: nothing seen
    assert m.allocate_slots(a, 1, num_lookahead_tokens=4).get_block_ids() == ([4],)
    a.num_computed_tokens = 10
    a.append_output_token_ids(51)
    m.evict_blocks({2})  # a's second block, held
    assert m.allocate_slots(a, 1, num_lookahead_tokens=8).get_block_ids() == ([5],)
    a.num_computed_tokens = 11
    assert m.get_computed_blocks(make_request("b", [*range(9), 99], block_size=BLOCK))[1] == 4
    assert m.state.group(m._layout.keys[0]).row("a").stored == 1


def test_a_model_of_windows_only_admits_with_a_prefix_hit_as_vllm() -> None:
    """Every layer behind a window: a second request hits the first one's blocks within its
    window and is admitted with them (the room check counts nothing recycled for a request
    that has no row yet), with vLLM's blocks, hit and free counts."""
    prompt = list(range(5 * BLOCK))

    def scenario(m: Any) -> None:
        a = _started(m, "a", prompt)
        m.free(a)
        b = make_request("b", [*prompt, 99], block_size=BLOCK)
        blocks, hit = m.get_computed_blocks(b)[:2]
        assert hit
        m.allocate_slots(b, len(prompt) + 1 - hit, hit, blocks)

    _both_ways((7,), scenario)


def test_a_full_attention_hit_counts_a_block_only_when_every_full_group_caches_it() -> None:
    """Two full-attention groups and a window: with one full group's copy of a prompt block
    evicted (and the window's copy of an earlier one), the shared prefix boundary that a
    lookup reports is the prefix every full-attention group caches (vLLM looks them up
    together), not the first one's."""
    prompt = list(range(5 * BLOCK))

    def scenario(m: Any) -> None:
        a = _started(m, "a", prompt)
        ids = m.get_block_ids("a")
        m.free(a)
        m.evict_blocks({ids[2][3], ids[1][2]})  # the third group's block 3, the window's 2
        b = make_request("b", [*prompt, 99], block_size=BLOCK)
        m.get_computed_blocks(b)

    answers = _both_ways((None, 2 * BLOCK, None), scenario)
    lookup = [entry for entry in answers if entry[0] == "get_computed_blocks"][-1]
    assert lookup[1][1:] == [2 * BLOCK, 3 * BLOCK]  # the window's hit; where the third
    # group's copies stop


def test_a_held_block_evicted_is_cached_again_by_owing_and_not_owing_managers_alike() -> None:
    """A held block evicted lowers its request's cached count, so the next step that fills
    nothing new looks like one that only caches: it caches nothing until news (a block
    filled or a digest) arrives, whether the manager owes such calls or not."""
    prompt = list(range(2 * BLOCK + 1))
    hits = []
    for owing in (True, False):
        m = manager(events=False)
        m._defers = owing
        a = _started(m, "a", prompt)
        m.evict_blocks({m.get_block_ids("a")[0][1]})  # a's second block, held
        _decode(m, a)
        hits.append(m.get_computed_blocks(make_request("b", [*prompt, 99],
                                                       block_size=BLOCK))[1])
    assert hits == [BLOCK, BLOCK]
