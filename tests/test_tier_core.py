"""Tiers below the device: examples that pin lookups, loads, stores, completion and priorities."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvfunc as kf
from kvfunc import (
    BlockHashes,
    FullAttention,
    KVState,
    TieredState,
    allocate_tiered,
    check_tiered_invariants,
    complete_moves,
    free_tiered,
    loads_pending,
    lookup_tiers,
    replay_tiered,
)

BS = 4


def _device(num_blocks: int = 4) -> KVState:
    return KVState.create({"f": FullAttention(num_blocks=num_blocks, block_size=BS)}, 256,
                          enable_prefix_caching=True)


def _tokens(tag: int, n: int) -> list[int]:
    return [tag * 1000 + i for i in range(n)]


class Log:
    """Runs tiered transitions, keeps their deltas and checks every state."""

    def __init__(self, state: TieredState) -> None:
        self.initial = self.state = state
        self.deltas: list[kf.TierDelta] = []

    def keep(self, state: TieredState, delta: kf.TierDelta) -> TieredState:
        check_tiered_invariants(state)
        kf.check_invariants(state)
        self.state = state
        self.deltas.append(delta)
        assert replay_tiered(self.initial, self.deltas) == state
        return state

    def run(self, rid: str, tokens: list[int], *, priority: int = 0, new: int | None = None
            ) -> kf.TieredResult:
        h = BlockHashes.of(tokens, BS)
        hit = lookup_tiers(self.state, h, max_tokens=len(tokens) - 1)
        n = len(tokens) - hit.num_tokens if new is None else new
        res = allocate_tiered(self.state, [(rid, hit.num_tokens, n, 0, 0, None, h, hit)],
                              priorities={rid: priority})
        assert not res.refused
        self.keep(res.state, res.delta)
        return res

    def free(self, rid: str) -> None:
        self.keep(*free_tiered(self.state, rid))

    def complete(self, done: list[int] = (), failed: list[int] = ()) -> kf.MovesResult:  # type: ignore[assignment]
        res = complete_moves(self.state, done=done, failed=failed)
        self.keep(res.state, res.delta)
        return res

    def settle_all(self) -> None:
        if self.state.moves:
            self.complete(done=list(self.state.moves))

    def stored_below(self, tokens: list[int], filler: int) -> None:
        """Cache ``tokens`` as request "a", then let a ``filler``-token request "b" evict them
        from the device: their stores to the tier below settle, and "b" is freed."""
        self.run("a", tokens)
        self.free("a")
        self.run("b", _tokens(2, filler))
        self.settle_all()
        self.free("b")


def test_no_tiers_is_the_device_alone() -> None:
    """Without tiers, a tiered step makes the device state allocate_batch makes, and no moves."""
    dev = _device(8)
    h = BlockHashes.of(_tokens(1, 12), BS)
    t = allocate_tiered(TieredState.create(dev), [("a", 0, 12)], block_hashes={"a": h})
    plain = kf.allocate_batch(dev, [("a", 0, 12)], block_hashes={"a": h})
    assert (t.state.device, t.delta.device, t.delta.order) == (plain.state, plain.delta, "")


def test_write_back_host_hit_loads_and_completes() -> None:
    """An evicted prefix goes to the host, comes back as a host hit with loads, then is a hit."""
    log = Log(TieredState.create(_device(5), host_blocks=8))
    a = _tokens(1, 13)
    log.run("a", a)
    log.free("a")
    log.run("b", _tokens(2, 16))               # evicts a's three cached blocks: stored down
    assert sorted(m.direction for m in log.state.moves.values()) == ["device->host"] * 3
    assert lookup_tiers(log.state, BlockHashes.of(a, BS)).num_tokens == 0  # pending: no hit
    log.settle_all()
    log.free("b")
    res = log.run("a2", a)
    hit_moves = [m for m in res.delta.moves() if m[1] == "host->device"]
    assert [m[3] for m in hit_moves] == [2, 1, 0]      # host blocks, in prefix order
    assert loads_pending(log.state, "a2") == 3
    dst = kf.get_block_ids(log.state.device, "a2")["f"]
    assert [m[4] for m in hit_moves] == list(dst[:3])
    with pytest.raises(kf.InvalidArgumentError):  # no step while its loads are in flight
        allocate_tiered(log.state, [("a2", 12, 1)])
    with pytest.raises(kf.InvalidArgumentError):
        free_tiered(log.state, "a2")
    log.complete(done=[m[0] for m in hit_moves])
    assert loads_pending(log.state, "a2") == 0
    log.free("a2")


def test_failed_load_recomputes_and_forgets_the_block() -> None:
    """A failed load reports the tokens to recompute from; nothing the admission gave the
    request is a device hit until the request computes it again."""
    log = Log(TieredState.create(_device(5), host_blocks=8))
    a = _tokens(1, 13)
    log.stored_below(a, 16)
    res = log.run("a2", a)
    assert not res.delta.device.stored_block_ids  # cached once computed, not at admission
    ids = [m[0] for m in res.delta.moves() if m[1] == "host->device"]
    out = log.complete(done=[ids[0]], failed=[ids[1], ids[2]])
    assert out.recompute_from == {"a2": 4}
    assert loads_pending(log.state, "a2") == 0
    h = BlockHashes.of(a, BS)
    assert kf.lookup_prefix(log.state.device, h).num_tokens == 0
    assert len(log.state.host.index) == 3       # the host copies stay
    log.keep(*allocate_tiered(log.state, [("a2", 4, 9)], block_hashes={"a2": h})[:2])
    assert kf.lookup_prefix(log.state.device, h).num_tokens == 12  # recomputed: cached


def test_failed_store_drops_the_host_copy() -> None:
    """A failed store frees its host block and leaves no hit behind."""
    log = Log(TieredState.create(_device(5), host_blocks=8))
    a = _tokens(1, 13)
    log.run("a", a)
    log.free("a")
    log.run("b", _tokens(2, 16))
    log.complete(failed=list(log.state.moves))
    assert log.state.host.num_free == 8 and not len(log.state.host.index)
    assert lookup_tiers(log.state, BlockHashes.of(a, BS)).num_tokens == 0


def test_write_through_stores_when_cached_then_remote() -> None:
    """Write-through copies each cached block down at once, and remotely once on the host."""
    log = Log(TieredState.create(_device(8), host_blocks=8, remote=True,
                                 write_policy="write-through"))
    log.run("a", _tokens(1, 9))
    moves = list(log.state.moves.values())
    assert [m.direction for m in moves] == ["device->host"] * 2
    log.settle_all()
    assert [m.direction for m in log.state.moves.values()] == ["host->remote"] * 2
    log.settle_all()
    assert len(log.state.remote.index) == 2 and len(log.state.host.index) == 2


def test_remote_hit_after_host_eviction() -> None:
    """With write-back, a block the host evicts goes remote and comes back as a remote hit."""
    log = Log(TieredState.create(_device(5), host_blocks=3, remote=True))
    a, b, c = _tokens(1, 13), _tokens(2, 13), _tokens(3, 13)
    for rid, toks in (("a", a), ("b", b), ("c", c)):
        log.run(rid, toks)
        log.free(rid)
        log.settle_all()
    log.settle_all()
    hit = lookup_tiers(log.state, BlockHashes.of(a, BS), max_tokens=12)
    assert hit.num_tokens == 12 and hit.remote_blocks >= 1
    res = log.run("a2", a)
    assert {m[1] for m in res.delta.moves()} >= {"remote->device"}
    failed = [m[0] for m in res.delta.moves() if m[1] == "remote->device"]
    log.complete(failed=failed)                  # the store lost them: the hint is dropped
    for m in res.delta.moves():
        if m[1] == "remote->device":
            assert log.state.remote.index.get(m[2]) is None


def test_host_evicts_lower_priority_first() -> None:
    """The host tier evicts a priority-0 block before an older priority-5 one."""
    log = Log(TieredState.create(_device(3), host_blocks=2))
    keep, drop, new = _tokens(1, 5), _tokens(2, 5), _tokens(3, 5)
    for rid, toks, p in (("keep", keep, 5), ("drop", drop, 0), ("new", new, 0), ("x", [9] * 5, 0)):
        log.run(rid, toks, priority=p)
        log.free(rid)
        log.settle_all()
    host = log.state.host.index
    digest = BlockHashes.of(keep, BS).hashes[0]
    assert host.get(digest) is not None and host.get(digest).priority == 5
    assert host.get(BlockHashes.of(drop, BS).hashes[0]) is None


@pytest.mark.parametrize("bad", [[-1], [99], ["0"], [True], 3, None, [0, 0]])
def test_bad_move_ids_change_nothing(bad: object) -> None:
    """Unknown, junk or repeated move ids are typed errors, and the state is unchanged."""
    log = Log(TieredState.create(_device(5), host_blocks=8))
    log.run("a", _tokens(1, 13))
    log.free("a")
    log.run("b", _tokens(2, 16))
    before = log.state
    with pytest.raises(kf.KVFuncError):
        complete_moves(before, done=bad)  # type: ignore[arg-type]
    log.complete(done=[0])
    with pytest.raises(kf.UnknownRequestError):  # settled twice
        complete_moves(log.state, done=[0])
    assert log.state.moves.get(0) is None and before.moves.get(0) is not None


def test_create_refuses_what_tiers_cannot_serve() -> None:
    """A device without prefix caching, a pool per group, a group other than full attention or a
    window, groups of several block sizes, or bad counts are typed errors."""
    with pytest.raises(kf.NotSupportedError):
        TieredState.create(KVState.create({"f": FullAttention(num_blocks=4, block_size=4)}, 64))
    per_type = KVState.create({"f": FullAttention(num_blocks=4, block_size=4),
                               "w": kf.SlidingWindow(num_blocks=4, block_size=4,
                                                     sliding_window=8)},
                              64, enable_prefix_caching=True, layout="per-type")
    with pytest.raises(kf.NotSupportedError, match="one pool"):
        TieredState.create(per_type)
    for second in (kf.Mamba(num_blocks=4, block_size=4),
                   kf.SlidingWindow(num_blocks=4, block_size=8, sliding_window=8)):
        shared = KVState.create({"f": FullAttention(num_blocks=4, block_size=4), "x": second},
                                64, enable_prefix_caching=True, layout="shared")
        with pytest.raises(kf.NotSupportedError, match="full attention or sliding windows"):
            TieredState.create(shared)
    for kwargs in ({"host_blocks": -1}, {"host_blocks": True}, {"write_policy": "x"},
                   {"remote": 1}, {"remote_blocks": 4}, {"remote": True, "remote_blocks": 0}):
        with pytest.raises(kf.KVFuncError):
            TieredState.create(_device(), **kwargs)  # type: ignore[arg-type]


def test_a_block_being_loaded_is_no_hit() -> None:
    """While a load writes a device block, the device does not cache it: lookups find the host
    copy, and the block is a device hit once its request computes on."""
    log = Log(TieredState.create(_device(9), host_blocks=8))
    a = _tokens(1, 13)
    log.stored_below(a, 32)
    log.run("a2", a)
    assert loads_pending(log.state, "a2") == 3
    h = BlockHashes.of(a, BS)
    assert kf.lookup_prefix(log.state.device, h, max_tokens=12).num_tokens == 0  # raw device
    hit = lookup_tiers(log.state, h, max_tokens=12)
    assert (hit.device.num_tokens, hit.sources) == (0, ("host", "host", "host"))
    res = log.run("a3", a)                      # loads again from the host, pinned twice
    directions = [m[1] for m in res.delta.moves()]  # stores of evicted blocks, then loads
    assert directions.count("host->device") == 3 and "device->host" in directions
    assert directions == sorted(directions, key=lambda d: d == "host->device")
    entry = log.state.host.index.get(h.hashes[0])
    assert entry is not None and entry.pins == 2
    log.settle_all()
    assert lookup_tiers(log.state, h, max_tokens=12).device.num_tokens == 0
    longer = BlockHashes.of([*a, 7], BS)
    log.keep(*allocate_tiered(log.state, [("a2", 13, 1)], block_hashes={"a2": longer})[:2])
    assert lookup_tiers(log.state, h, max_tokens=12).device.num_tokens == 12


def test_tier_events_name_their_medium() -> None:
    """Done stores announce host and remote blocks; evictions and drops withdraw them."""
    from kvfunc.events import (
        MEDIUM_CPU,
        MEDIUM_REMOTE,
        BlockRemoved,
        BlockStored,
        CachedBlocksView,
        events_from_tier_delta,
    )

    log = Log(TieredState.create(_device(5), host_blocks=3, remote=True, remote_blocks=2))
    events = []
    for n in range(1, 6):
        rid, toks = f"r{n}", _tokens(n, 13)
        for step in ("run", "free", "settle"):
            before = log.state
            if step == "run":
                log.run(rid, toks)
            elif step == "free":
                log.free(rid)
            else:
                log.settle_all()
            events += events_from_tier_delta(log.deltas[-1], before)
    kinds = {(type(e).__name__, e.medium) for e in events}
    assert {("BlockStored", "GPU"), ("BlockRemoved", "GPU"), ("BlockStored", MEDIUM_CPU),
            ("BlockRemoved", MEDIUM_CPU), ("BlockStored", MEDIUM_REMOTE),
            ("BlockRemoved", MEDIUM_REMOTE)} <= kinds
    held: dict[str, set[bytes]] = {"CPU": set(), "REMOTE": set()}
    for e in events:
        if e.medium in held:
            if isinstance(e, BlockStored):
                held[e.medium].update(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                held[e.medium].difference_update(e.block_hashes)
    assert held["CPU"] == set(log.state.host.index.entries)
    assert held["REMOTE"] == set(log.state.remote.index.entries)
    assert CachedBlocksView().apply(events).matches(log.state.device)  # the device's alone


@given(ops=st.lists(st.tuples(st.sampled_from(["admit", "free"]),
                              st.lists(st.integers(0, 2), min_size=1, max_size=14)),
                    max_size=12),
       num_blocks=st.integers(2, 8))
def test_without_tiers_a_tiered_run_is_the_device_run(ops: list[tuple[str, list[int]]],
                                                       num_blocks: int) -> None:
    """With no host and no remote tier, every state and delta is the plain core's."""
    dev = _device(num_blocks)
    tiered = TieredState.create(dev)
    live: list[str] = []
    for n, (op, tokens) in enumerate(ops):
        if op == "free" and live:
            rid = live.pop(0)
            dev, d1 = kf.free_request(dev, rid)
            tiered, d2 = free_tiered(tiered, rid)
        else:
            rid = f"r{n}"
            h = BlockHashes.of(tokens, BS)
            hit = kf.lookup_prefix(dev, h, max_tokens=len(tokens) - 1)
            thit = lookup_tiers(tiered, h, max_tokens=len(tokens) - 1)
            assert thit.device == hit and thit.num_tokens == hit.num_tokens and not thit.sources
            new = len(tokens) - hit.num_tokens
            plain = kf.allocate_batch(dev, [(rid, hit.num_tokens, new, 0, 0, None, h, hit)])
            res = allocate_tiered(tiered, [(rid, hit.num_tokens, new, 0, 0, None, h, thit)])
            assert res.refused == plain.refused
            dev, d1, tiered, d2 = plain.state, plain.delta, res.state, res.delta
            live += [] if plain.refused else [rid]
        assert tiered.device == dev and d2.device == d1 and not d2.order
        check_tiered_invariants(tiered)


def _hybrid(num_blocks: int = 11) -> KVState:
    """Full attention and a window of two blocks, sharing one pool (vLLM's hybrid layout)."""
    return KVState.create({"f": FullAttention(num_blocks=num_blocks, block_size=BS),
                           "w": kf.SlidingWindow(num_blocks=num_blocks, block_size=BS,
                                                 sliding_window=2 * BS)},
                          256, enable_prefix_caching=True, layout="shared")


def test_a_hybrid_hit_below_the_device_loads_every_groups_blocks() -> None:
    """Each group's block of a hash is kept under its own tier key; a hit below the device
    loads, position after position, the block of each group into that group's table, the
    window's blocks included; once the request computes on, they are the device's hit."""
    from kvfunc.events import MEDIUM_CPU, BlockStored, events_from_tier_delta

    log = Log(TieredState.create(_hybrid(), host_blocks=32, write_policy="write-through"))
    a = _tokens(1, 17)
    h = BlockHashes.of(a, BS)
    log.run("a", a)
    stores = list(log.state.moves.values())
    assert [(m.key, m.digest) for m in stores] == [
        (k, log.state.tier_key(k, d)) for k in ("f", "w") for d in h.hashes[:4]]
    before = log.state
    log.settle_all()
    events = events_from_tier_delta(log.deltas[-1], before)
    host_events = [(e.group, e.block_hashes) for e in events
                   if isinstance(e, BlockStored) and e.medium == MEDIUM_CPU]
    assert host_events == [(k, (d,)) for k in ("f", "w") for d in h.hashes[:4]]  # plain hashes
    log.free("a")
    log.run("b", _tokens(2, 20))                       # takes the whole pool: a's blocks go
    log.free("b")
    hit = lookup_tiers(log.state, h, max_tokens=16)
    assert hit.device.num_tokens == 0 and hit.num_tokens == 16
    assert hit.hashes == tuple(log.state.tier_key(k, d) for d in h.hashes[:4] for k in ("f", "w"))
    assert hit.sources == ("host",) * 8
    res = log.run("a2", a)
    tables = kf.get_block_ids(log.state.device, "a2")
    loads = [(m[7], m[4]) for m in res.delta.moves() if m[1] == "host->device"]
    assert loads == [(k, tables[k][p]) for p in range(4) for k in ("f", "w")]
    log.settle_all()
    assert kf.lookup_prefix(log.state.device, h, max_tokens=16).num_tokens == 0  # not yet
    longer = BlockHashes.of([*a, 7], BS)
    log.keep(*allocate_tiered(log.state, [("a2", 17, 1)], block_hashes={"a2": longer})[:2])
    log.free("a2")
    assert kf.lookup_prefix(log.state.device, h, max_tokens=16).num_tokens == 16


def test_group_key_names_the_one_group_and_refuses_several() -> None:
    """``group_key`` is the key of a one-group device; a hybrid one has ``keys`` instead."""
    assert TieredState.create(_device()).group_key == "f"
    hybrid = TieredState.create(_hybrid())
    assert hybrid.keys == ("f", "w")
    with pytest.raises(kf.NotSupportedError):
        _ = hybrid.group_key


def test_a_hybrid_window_block_missing_below_ends_the_hit() -> None:
    """A position whose window block is in no lower tier ends the hit there, though full
    attention's block is below: the device caches the window block it would take for it."""
    log = Log(TieredState.create(_hybrid(), host_blocks=32, write_policy="write-through"))
    a = _tokens(1, 17)
    h = BlockHashes.of(a, BS)
    log.run("a", a)
    w2 = next(i for i, m in log.state.moves.items()
              if m.key == "w" and m.digest == log.state.tier_key("w", h.hashes[2]))
    log.complete(done=[i for i in log.state.moves if i != w2], failed=[w2])
    log.free("a")
    log.run("b", _tokens(2, 20))
    log.free("b")
    hit = lookup_tiers(log.state, h, max_tokens=16)
    assert (hit.device.num_tokens, hit.num_tokens, len(hit.sources)) == (0, 8, 4)


def test_a_hybrid_failed_window_load_recomputes_from_its_position() -> None:
    """A failed load of a window block reports its position; nothing of the admission is a
    device hit until the request computes again from there."""
    log = Log(TieredState.create(_hybrid(), host_blocks=32, write_policy="write-through"))
    a = _tokens(1, 17)
    log.run("a", a)
    log.settle_all()
    log.free("a")
    log.run("b", _tokens(2, 20))
    log.free("b")
    res = log.run("a2", a)
    failed = [m[0] for m in res.delta.moves() if m[7] == "w" and m[1] == "host->device"][1]
    out = log.complete(done=[i for i in log.state.moves if i != failed], failed=[failed])
    assert out.recompute_from == {"a2": BS}
    h = BlockHashes.of(a, BS)
    assert kf.lookup_prefix(log.state.device, h, max_tokens=16).num_tokens == 0
    longer = BlockHashes.of([*a, 7], BS)
    log.keep(*allocate_tiered(log.state, [("a2", BS, 14)], block_hashes={"a2": longer})[:2])
    assert kf.lookup_prefix(log.state.device, h, max_tokens=16).num_tokens == 16


@pytest.mark.parametrize("hybrid", [False, True])
def test_a_store_of_an_evicted_block_comes_before_the_load_into_it(hybrid: bool) -> None:
    """When an admission's loads go into blocks the device just evicted, the stores of those
    blocks' old contents come first in the delta (the shell runs moves in row order)."""
    groups: dict[str, kf.Policy] = {"f": FullAttention(num_blocks=9 if hybrid else 5,
                                                         block_size=2)}
    if hybrid:
        groups["w"] = kf.SlidingWindow(num_blocks=9, block_size=2, sliding_window=2)
    dev = KVState.create(groups, 64, enable_prefix_caching=True,
                         layout="shared" if hybrid else "per-type")
    log = Log(TieredState.create(dev, host_blocks=16))
    a, b = BlockHashes.of(range(8), 2), BlockHashes.of(range(50, 58), 2)
    for rid, h in (("a", a), ("b", b)):
        log.keep(*allocate_tiered(log.state, [(rid, 0, 8)], block_hashes={rid: h})[:2])
        log.free(rid)
    log.settle_all()
    hit = lookup_tiers(log.state, a, max_tokens=7)
    res = allocate_tiered(log.state, [("a2", hit.num_tokens, 1, 0, 0, None, a, hit)])
    log.keep(res.state, res.delta)
    rows = list(res.delta.moves())
    stored_from = {row[3]: i for i, row in enumerate(rows) if row[1] == "device->host"}
    loaded_into = {row[4]: i for i, row in enumerate(rows) if row[1] == "host->device"}
    both = stored_from.keys() & loaded_into.keys()
    assert both and all(stored_from[blk] < loaded_into[blk] for blk in both)


def test_cache_loaded_caches_at_admission_and_a_failed_load_forgets_what_follows() -> None:
    """With ``cache_loaded`` (a caller whose loads and forward pass run before anyone reads
    the blocks) an admission caches its new blocks at once; a failed load then makes the
    device forget the request's blocks from the failed one on, loaded or computed."""
    log = Log(TieredState.create(_device(5), host_blocks=8))
    a = _tokens(1, 13)
    log.stored_below(a, 16)
    h = BlockHashes.of(a, BS)
    hit = lookup_tiers(log.state, h, max_tokens=12)
    entry = ("a2", hit.num_tokens, 1, 0, 0, None, h, hit)
    with pytest.raises(kf.InvalidTypeError):
        allocate_tiered(log.state, [entry], cache_loaded=1)  # type: ignore[arg-type]
    res = allocate_tiered(log.state, [entry], cache_loaded=True)
    log.keep(res.state, res.delta)
    assert len(res.delta.device.stored_block_ids) == 3
    loads = [m[0] for m in res.delta.moves() if m[1] == "host->device"]
    out = log.complete(done=[loads[0], loads[2]], failed=[loads[1]])
    assert out.recompute_from == {"a2": BS}
    assert kf.lookup_prefix(log.state.device, h, max_tokens=12).num_tokens == BS
    table = kf.get_block_ids(log.state.device, "a2")["f"]
    hash_of = log.state.device.pools[0].hash_of
    assert hash_of is not None and [hash_of[b] is not None for b in table] == [
        True, False, False, False]  # loaded after the failed one, or computed: forgotten
