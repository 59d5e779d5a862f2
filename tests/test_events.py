"""KV events: derived from deltas, encoded as vLLM lays them out, replayed by a subscriber.

The central property: a subscriber that sees only the encoded event batches
(never the state) rebuilds, after every transition, exactly the
``{hash: block ids}`` index of every group of the state, through prefix
hits, evictions in small pools, forks (copy-on-write), frees, batched steps
and resets, on full-attention, full + sliding-window and full + Mamba states.
"""

from __future__ import annotations

import contextlib
from typing import Any

import msgpack
import pytest
from hypothesis import event, given
from hypothesis import strategies as st

import kvfunc as kf
from kvfunc.events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CachedBlocksView,
    KVEventBatch,
    decode_event_batch,
    encode_event_batch,
    events_from_delta,
)

HBS = 4  # hash block size
PREFIXES = [tuple(range(100, 100 + n)) for n in (5, 9, 16)]  # shared system prompts
MAX_LEN = 64


def _groups() -> st.SearchStrategy[dict[str, Any]]:
    full = st.builds(lambda n: kf.FullAttention(num_blocks=n, block_size=HBS), st.integers(5, 10))
    swa = st.builds(lambda n, m, w: kf.SlidingWindow(num_blocks=n, block_size=m * HBS,
                                                     sliding_window=w),
                    st.integers(5, 12), st.sampled_from([1, 2]), st.integers(1, 12))
    mamba = st.builds(lambda n: kf.Mamba(num_blocks=n, block_size=2 * HBS), st.integers(5, 10))
    return st.one_of(st.builds(lambda f: {"full": f}, full),
                     st.builds(lambda f, w: {"full": f, "swa": w}, full, swa),
                     st.builds(lambda f, m: {"full": f, "mamba": m}, full, mamba))


# (kind, a, b): admit a prompt with shared prefix a (none for a == len(PREFIXES)) and b tokens
# of its own; decode request a (every request: step); fork or free request a; reset.
# Admissions weigh most: finishing requests to make room for them makes the pools evict.
_KINDS = ["admit"] * 6 + ["decode", "step", "fork", "free", "free", "reset"]
_OPS = st.lists(st.tuples(st.sampled_from(_KINDS), st.integers(0, len(PREFIXES)),
                          st.integers(0, 12)), min_size=4, max_size=40)


class Engine:
    """Drives a state with a random program, one operation (one or more transitions) at a time."""

    def __init__(self, state: kf.KVState) -> None:
        self.state = state
        self.tokens: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}
        self.next_id = 0

    def _hashes(self, rid: int) -> kf.BlockHashes:
        return kf.BlockHashes.of(self.tokens[rid], HBS)

    def _pick(self, i: int) -> int | None:
        rids = sorted(self.tokens)
        return rids[i % len(rids)] if rids else None

    def run(self, op: tuple[Any, ...]) -> list[tuple[kf.BlocksChanged, kf.KVState]]:
        """Apply one operation; ``(delta, state after it)`` of each transition it ran."""
        if op[0] != "admit":
            delta = self._run(op)
            return [] if delta is None else [(delta, self.state)]
        steps: list[tuple[kf.BlocksChanged, kf.KVState]] = []
        while True:  # like a scheduler, finish the oldest requests until the new one fits
            delta = self._admit(op[1], op[2])
            if delta is not None:
                return [*steps, (delta, self.state)]
            if not self.tokens:
                return steps
            oldest = min(self.tokens)
            del self.tokens[oldest], self.computed[oldest]
            self.state, freed = kf.free_request(self.state, oldest)
            steps.append((freed, self.state))

    def _admit(self, prefix: int, extra: int) -> kf.BlocksChanged | None:
        caching = self.state.prefix_caching
        rid, self.next_id = self.next_id, self.next_id + 1
        shared = PREFIXES[prefix] if prefix < len(PREFIXES) else ()
        toks = [*shared, *range(1000 * rid, 1000 * rid + extra + 1)]
        h = kf.BlockHashes.of(toks, HBS)
        hit = kf.lookup_prefix(self.state, h, max_tokens=len(toks) - 1) if caching else None
        done = hit.num_tokens if hit else 0
        r = kf.allocate_slots(self.state, rid, done, len(toks) - done,
                              block_hashes=h if caching else None, prefix_hit=hit)
        if not r.ok:
            return None
        self.tokens[rid] = toks
        self.computed[rid] = len(toks)
        self.state = r.state
        return r.delta

    def _run(self, op: tuple[Any, ...]) -> kf.BlocksChanged | None:
        kind = op[0]
        caching = self.state.prefix_caching
        if kind in ("decode", "step"):
            rids = [self._pick(op[1])] if kind == "decode" else sorted(self.tokens)
            bump = op[2] % 4
            reqs: list[kf.SlotRequest] = []
            for rid in rids:
                if rid is None or len(self.tokens[rid]) >= MAX_LEN - 1:
                    continue
                self.tokens[rid].append(7 * rid + len(self.tokens[rid]) + bump)
                reqs.append(kf.SlotRequest(rid, self.computed[rid], 1,
                                           block_hashes=self._hashes(rid) if caching else None))
            if not reqs:
                return None
            b = kf.allocate_batch(self.state, reqs)
            for rid in (int(req.request_id) for req in reqs):
                if rid in b.refused:
                    self.tokens[rid].pop()
                else:
                    self.computed[rid] += 1
            self.state = b.state
            return b.delta
        if kind == "fork":
            parent = self._pick(op[1])
            if parent is None or not caching:
                return None
            child, self.next_id = self.next_id, self.next_id + 1
            self.state, delta = kf.fork_request(self.state, parent, child)
            self.tokens[child] = list(self.tokens[parent])
            self.computed[child] = self.computed[parent]
            return delta
        if kind == "free":
            rid = self._pick(op[1])
            if rid is None:
                return None
            del self.tokens[rid], self.computed[rid]
            self.state, delta = kf.free_request(self.state, rid)
            return delta
        if not caching:
            return None
        self.state, delta = kf.reset_prefix_cache(self.state)
        return delta


@given(groups=_groups(), ops=_OPS)
def test_subscriber_rebuilds_the_cached_blocks(groups: dict[str, Any],
                                               ops: list[tuple[Any, ...]]) -> None:
    """Replaying only the decoded event batches gives every group's cached blocks, each step."""
    engine = Engine(kf.KVState.create(groups, MAX_LEN, enable_prefix_caching=True))
    view = CachedBlocksView()
    for ts, (delta, state) in enumerate(step for op in ops for step in engine.run(op)):
        events = events_from_delta(delta, state)
        for name in ("evicted_keys", "shared_keys", "copied_keys", "cleared_keys"):
            if getattr(delta, name):
                event(name)
        if any(isinstance(e, BlockStored) and len(e.block_hashes) > 1 for e in events):
            event("merged store")
        batch = decode_event_batch(encode_event_batch(KVEventBatch(float(ts), events, 0)))
        assert batch.events == events
        view = view.apply(batch)
        assert view.matches(state)
        for key in state.manager_keys:
            assert view.cached(key) == state.pool_of(key).cached(key)
            assert view.num_cached_blocks(key) == kf.num_cached_blocks(state, key)
    assert view == CachedBlocksView.of_state(engine.state)


@given(groups=_groups(), ops=_OPS)
def test_events_are_ordered_and_chained(groups: dict[str, Any], ops: list[tuple[Any, ...]]
                                        ) -> None:
    """Per delta: the events follow its operations in order (a clear, then each removal and
    store where it happened); a BlockStored's blocks chain; counts match rows."""
    engine = Engine(kf.KVState.create(groups, MAX_LEN, enable_prefix_caching=True))
    for delta, state in (step for op in ops for step in engine.run(op)):
        events = events_from_delta(delta, state)
        happened = [(type(op).__name__, op.key, getattr(op, "block_id", None))
                    for op in delta.operations()
                    if isinstance(op, kf.Evicted | kf.Stored | kf.Cleared)]
        told = [(name, e.group, b) for e in events if not isinstance(e, AllBlocksCleared)
                for name, b in zip(["Evicted" if isinstance(e, BlockRemoved) else "Stored"]
                                   * len(e.block_ids), e.block_ids, strict=True)]
        assert told == [h for h in happened if h[0] != "Cleared"]
        if delta.cleared_keys:
            assert [AllBlocksCleared(delta.cleared_keys)] == [
                e for e in events if isinstance(e, AllBlocksCleared)]
        stored = [e for e in events if isinstance(e, BlockStored)]
        removed = [e for e in events if isinstance(e, BlockRemoved)]
        assert sum(len(e.block_hashes) for e in stored) == len(delta.stored_keys)
        assert sum(len(e.block_hashes) for e in removed) == len(delta.evicted_keys)
        for e in stored:
            assert e.block_size == state.group(e.group).policy.block_size
            assert e.medium == MEDIUM_GPU and e.block_ids is not None
            assert len(e.token_ids) in (0, e.block_size * len(e.block_hashes))
            rows = [(h, p) for k, h, p in zip(delta.stored_keys, delta.stored_hashes,
                                              delta.stored_parent_hashes, strict=True)
                    if k == e.group and h in e.block_hashes]
            parents = dict(rows)
            assert parents[e.block_hashes[0]] == e.parent_block_hash
            for prev, h in zip(e.block_hashes, e.block_hashes[1:], strict=False):
                assert parents[h] == prev


@given(groups=_groups(), ops=_OPS)
def test_a_batch_delivered_twice_leaves_the_same_blocks(groups: dict[str, Any],
                                                        ops: list[tuple[Any, ...]]) -> None:
    """At-least-once delivery: applying each batch twice in a row caches the same blocks."""
    engine = Engine(kf.KVState.create(groups, MAX_LEN, enable_prefix_caching=True))
    view = CachedBlocksView()
    for delta, state in (step for op in ops for step in engine.run(op)):
        batch = KVEventBatch(0.0, events_from_delta(delta, state))
        view = view.apply(batch).apply(batch)
    want = CachedBlocksView.of_state(engine.state)
    assert {k: {h: set(b) for h, b in v.items()} for k, v in view.groups.items()} == \
        {k: {h: set(b) for h, b in v.items()} for k, v in want.groups.items()}


@given(groups=_groups(), ops=_OPS)
def test_a_state_without_caching_has_no_events(groups: dict[str, Any],
                                               ops: list[tuple[Any, ...]]) -> None:
    """Every delta of a state created without prefix caching gives no event."""
    engine = Engine(kf.KVState.create(groups, MAX_LEN))
    for delta, state in (step for op in ops for step in engine.run(op)):
        assert events_from_delta(delta, state) == ()
    assert CachedBlocksView.of_state(engine.state) == CachedBlocksView()


def _cached_state() -> tuple[kf.KVState, kf.AllocationResult, kf.BlockHashes]:
    s = kf.KVState.create({"full": kf.FullAttention(num_blocks=5, block_size=4)}, 64,
                          enable_prefix_caching=True)
    h = kf.BlockHashes.of(range(13), 4)
    return s, kf.allocate_slots(s, "a", 0, 13, block_hashes=h), h


def test_a_prompt_is_one_chained_store() -> None:
    """A prompt's full blocks become one BlockStored with vLLM's fields filled in."""
    s, r, h = _cached_state()
    assert events_from_delta(r.delta, s) == (
        BlockStored(h.hashes, None, tuple(range(12)), 4, None, "GPU", "full", (1, 2, 3)),)
    (e,) = events_from_delta(r.delta, {"full": 4}, medium=None)
    assert isinstance(e, BlockStored) and e.medium is None


def test_evictions_come_before_stores() -> None:
    """A transition that evicts to cache a new prompt emits the removals first."""
    s, r, h = _cached_state()
    s2, _ = kf.free_request(r.state, "a")
    other = kf.BlockHashes.of(range(50, 63), 4)
    r2 = kf.allocate_slots(s2, "b", 0, 13, block_hashes=other)
    events = events_from_delta(r2.delta, s)
    assert [type(e) for e in events] == [BlockRemoved, BlockStored]
    removed = events[0]
    assert isinstance(removed, BlockRemoved)
    assert removed.group == "full" and set(removed.block_hashes) <= set(h.hashes)
    view = CachedBlocksView().apply(events_from_delta(r.delta, s)).apply(events)
    assert view.matches(r2.state)


def test_a_reset_clears_every_group() -> None:
    """reset_prefix_cache is one AllBlocksCleared naming every group; the view empties."""
    s, r, _ = _cached_state()
    s2, d = kf.reset_prefix_cache(r.state)
    assert events_from_delta(d, s) == (AllBlocksCleared(("full",)),)
    view = CachedBlocksView.of_state(r.state)
    assert view.num_cached_blocks("full") == 3
    assert view.apply(events_from_delta(d, s)).matches(s2)
    assert view.apply([AllBlocksCleared()]) == CachedBlocksView()
    assert view.apply([AllBlocksCleared(("other",))]) == view


def test_router_score_counts_the_cached_prefix() -> None:
    """cached_prefix_blocks counts leading hashes the group caches, stopping at a miss."""
    _, r, h = _cached_state()
    view = CachedBlocksView.of_state(r.state)
    assert view.cached_prefix_blocks("full", h.hashes) == 3
    assert view.cached_prefix_blocks("full", (h.hashes[0], b"x", h.hashes[2])) == 1
    assert view.cached_prefix_blocks("missing", h.hashes) == 0


def test_events_from_delta_rejects_bad_arguments() -> None:
    """Wrong types and missing or bad block sizes raise typed kvfunc errors."""
    s, r, _ = _cached_state()
    with pytest.raises(kf.InvalidTypeError):
        events_from_delta("delta", s)  # type: ignore[arg-type]
    with pytest.raises(kf.InvalidTypeError):
        events_from_delta(r.delta, 4)  # type: ignore[arg-type]
    with pytest.raises(kf.MissingKeyError):
        events_from_delta(r.delta, {"swa": 4})
    with pytest.raises(kf.InvalidArgumentError):
        events_from_delta(r.delta, {"full": 0})
    assert events_from_delta(kf.BlocksChanged(), {}) == ()


def test_view_rejects_events_it_cannot_place() -> None:
    """Stores without block ids (another publisher's) and non-events raise typed errors."""
    with pytest.raises(kf.InvalidArgumentError):
        CachedBlocksView().apply([BlockStored((b"h",), None, (), 4)])
    with pytest.raises(kf.InvalidArgumentError):
        CachedBlocksView().apply([BlockRemoved((b"h",), None, "g", (1, 2))])
    with pytest.raises(kf.InvalidTypeError):
        CachedBlocksView().apply(["event"])  # type: ignore[list-item]
    with pytest.raises(kf.InvalidTypeError):
        CachedBlocksView.of_state("state")  # type: ignore[arg-type]


# -- the codec ---------------------------------------------------------------------------

_HASH = st.binary(min_size=1, max_size=33)
_INT64 = st.integers(-(2 ** 63), 2 ** 63 - 1)


@st.composite
def _events(draw: st.DrawFn) -> Any:
    n = draw(st.integers(0, 4))
    hashes = tuple(draw(st.lists(_HASH, min_size=n, max_size=n)))
    ids = draw(st.one_of(st.none(), st.lists(st.integers(0, 2 ** 31), min_size=n, max_size=n)
                         .map(tuple)))
    medium = draw(st.one_of(st.none(), st.text(max_size=4)))
    group = draw(st.text(max_size=6))
    kind = draw(st.sampled_from(["stored", "removed", "cleared"]))
    if kind == "stored":
        return BlockStored(hashes, draw(st.one_of(st.none(), _HASH)),
                           tuple(draw(st.lists(_INT64, max_size=8))), draw(st.integers(1, 64)),
                           draw(st.one_of(st.none(), _INT64)), medium, group, ids)
    if kind == "removed":
        return BlockRemoved(hashes, medium, group, ids)
    return AllBlocksCleared(tuple(draw(st.lists(st.text(max_size=4), max_size=3))))


@given(ts=st.floats(allow_nan=False), events=st.lists(_events(), max_size=6),
       rank=st.one_of(st.none(), st.integers(0, 64)))
def test_encoding_round_trips(ts: float, events: list[Any], rank: int | None) -> None:
    """decode(encode(batch)) == batch for any well-typed batch."""
    batch = KVEventBatch(ts, tuple(events), rank)
    assert decode_event_batch(encode_event_batch(batch)) == batch


def test_layout_is_vllms_arrays() -> None:
    """Arrays tagged with the class name, vLLM's fields first, kvfunc's after them."""
    e = BlockStored((b"h0", b"h1"), b"p", (1, 2, 3, 4), 2, None, "GPU", "full", (5, 6))
    batch = KVEventBatch(3.0, (e, BlockRemoved((b"h0",), "GPU"), AllBlocksCleared()))
    assert msgpack.unpackb(encode_event_batch(batch)) == [
        3.0,
        [["BlockStored", [b"h0", b"h1"], b"p", [1, 2, 3, 4], 2, None, "GPU", "full", [5, 6]],
         ["BlockRemoved", [b"h0"], "GPU"],
         ["AllBlocksCleared"]],
        None]


def test_vllm_payload_decodes_with_defaults() -> None:
    """A payload without kvfunc's fields (vLLM's) decodes; extra trailing fields are ignored."""
    data = msgpack.packb([1, [["BlockStored", [b"a"], None, [1, 2], 2, None, "GPU"],
                              ["BlockRemoved", [b"a"], None, "g", [3], "future field"],
                              ["AllBlocksCleared"]]])
    assert decode_event_batch(data) == KVEventBatch(1.0, (
        BlockStored((b"a",), None, (1, 2), 2, None, "GPU"),
        BlockRemoved((b"a",), None, "g", (3,)), AllBlocksCleared()))


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)  # type: ignore[no-any-return]


_STORED = ["BlockStored", [b"a"], None, [1], 1, None, "GPU", "g", [1]]
MALFORMED = {
    "empty": b"",
    "reserved byte": b"\xc1",
    "truncated": encode_event_batch(KVEventBatch(1.0, (AllBlocksCleared(),)))[:-3],
    "trailing bytes": encode_event_batch(KVEventBatch(1.0, ())) + b"\x00",
    "not an array": _pack({"ts": 1.0}),
    "too short": _pack([1.0]),
    "ts a string": _pack(["now", []]),
    "ts a bool": _pack([True, []]),
    "events not an array": _pack([1.0, "events"]),
    "rank a string": _pack([1.0, [], "0"]),
    "event not an array": _pack([1.0, [7]]),
    "event map": _pack([1.0, [{"type": "AllBlocksCleared"}]]),
    "empty event": _pack([1.0, [[]]]),
    "unknown tag": _pack([1.0, [["BlockMoved", [b"a"]]]]),
    "tag not a string": _pack([1.0, [[b"BlockStored", [b"a"]]]]),
    "too few fields": _pack([1.0, [["BlockStored", [b"a"], None, [1]]]]),
    "hash a string": _pack([1.0, [["BlockRemoved", ["a"]]]]),
    "hash an int": _pack([1.0, [["BlockRemoved", [1]]]]),
    "parent an int": _pack([1.0, [["BlockStored", [b"a"], 3, [1], 1]]]),
    "token a float": _pack([1.0, [["BlockStored", [b"a"], None, [1.5], 1]]]),
    "token a bool": _pack([1.0, [["BlockStored", [b"a"], None, [True], 1]]]),
    "block size zero": _pack([1.0, [["BlockStored", [b"a"], None, [1], 0]]]),
    "lora id a string": _pack([1.0, [["BlockStored", [b"a"], None, [1], 1, "x"]]]),
    "medium an int": _pack([1.0, [["BlockRemoved", [b"a"], 1]]]),
    "group an int": _pack([1.0, [["BlockRemoved", [b"a"], None, 1]]]),
    "block ids short": _pack([1.0, [["BlockRemoved", [b"a", b"b"], None, "g", [1]]]]),
    "block id negative": _pack([1.0, [["BlockRemoved", [b"a"], None, "g", [-1]]]]),
    "groups not strings": _pack([1.0, [["AllBlocksCleared", [1]]]]),
    "ext type": _pack([1.0, [msgpack.ExtType(5, b"x")]]),
    "invalid utf-8": b"\x92\x01\x91\x91\xa2\xff\xfe",
    "map key a list": b"\x81\x91\x01\x01",
    "stored ok but ids wrong": _pack([1.0, [_STORED[:-1] + [[1, 2]]]]),
}


@pytest.mark.parametrize("data", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_bytes_raise_a_typed_error(data: bytes) -> None:
    """Malformed payloads raise InvalidArgumentError, never anything else."""
    with pytest.raises(kf.InvalidArgumentError, match="malformed KV event batch"):
        decode_event_batch(data)


@given(st.binary(max_size=64))
def test_random_bytes_decode_or_raise_a_kvfunc_error(data: bytes) -> None:
    """Arbitrary bytes either decode to a batch or raise a KVFuncError."""
    try:
        batch = decode_event_batch(data)
    except kf.KVFuncError:
        return
    assert isinstance(batch, KVEventBatch)


@given(events=st.lists(_events(), max_size=4), at=st.integers(0, 10 ** 6), byte=st.integers(0, 255))
def test_corrupted_payloads_decode_or_raise_a_kvfunc_error(events: list[Any], at: int,
                                                           byte: int) -> None:
    """A valid payload with one byte changed decodes or raises a KVFuncError, nothing else."""
    data = bytearray(encode_event_batch(KVEventBatch(1.0, tuple(events))))
    data[at % len(data)] = byte
    with contextlib.suppress(kf.KVFuncError):
        decode_event_batch(bytes(data))


def test_codec_rejects_wrong_types() -> None:
    """Non-bytes input and non-batch or non-event values raise InvalidTypeError."""
    with pytest.raises(kf.InvalidTypeError):
        decode_event_batch("\x90")  # type: ignore[arg-type]
    with pytest.raises(kf.InvalidTypeError):
        encode_event_batch((1.0, ()))  # type: ignore[arg-type]
    with pytest.raises(kf.InvalidTypeError):
        encode_event_batch(KVEventBatch(1.0, ("event",)))  # type: ignore[arg-type]
    with pytest.raises(kf.InvalidTypeError):
        encode_event_batch(KVEventBatch("now", ()))  # type: ignore[arg-type]
    with pytest.raises(kf.InvalidTypeError):
        encode_event_batch(KVEventBatch(1.0, (BlockRemoved((object(),)),)))  # type: ignore[arg-type]
    assert decode_event_batch(memoryview(encode_event_batch(KVEventBatch(2.0, ())))).ts == 2.0
