"""Readers of outside data under attack: block hashes, prefix hits, deltas and their replay.

Each reader gets junk of many types in every field (``junk.py``) and
plausible lies (a hit larger than its query, a stored block without its
tokens, a count off by one).  The answer is a typed kvfunc error with a
short message, and nothing the reader was given changes: a state replays
as before, a hash lineage goes on hashing as a fresh one would.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from junk import IntSubclass, junk, short

import kvfunc as kf
from kvfunc.cli._log import DeltaLogWriter, verify_log
from kvfunc.core._delta import COLUMN_NAMES
from kvfunc.events import CachedBlocksView, events_from_delta


def raises_typed(call: Callable[[], Any]) -> kf.KVFuncError:
    """The kvfunc error ``call`` raises (anything else fails the test); its message is short."""
    with pytest.raises(kf.KVFuncError) as info:
        call()
    assert short(str(info.value)), str(info.value)
    return info.value


def is_int64(value: Any) -> bool:
    return type(value) is int and -(2 ** 63) <= value < 2 ** 63


def is_token_list(value: Any) -> bool:
    return (isinstance(value, list | tuple | range) and all(is_int64(t) for t in value))


# -- block hashes --------------------------------------------------------------------------

@given(tokens=st.lists(st.integers(0, 2 ** 40), max_size=12), at=st.integers(0, 12),
       bad=junk())
def test_a_junk_token_anywhere_is_a_typed_error(tokens: list[int], at: int, bad: Any) -> None:
    """A bool, a float, a str, a huge int... in a full block: InvalidTypeError, nothing hashed.

    (A partial last block is read when it fills: ``update`` reads only new full blocks.)
    """
    assume(not is_int64(bad))
    h = kf.BlockHashes.of(tokens, 4)
    attacked = [*tokens[:at], bad, *tokens[at:], 0, 0, 0, 0]
    assert isinstance(raises_typed(lambda: kf.BlockHashes.of(attacked, 4)), kf.InvalidTypeError)
    grown = [*tokens, bad, 0, 0, 0]
    assert isinstance(raises_typed(lambda: h.update(grown)), kf.InvalidTypeError)
    longer = [*tokens, 5, 6, 7, 8]
    assert h.update(longer) == kf.BlockHashes.of(longer, 4)  # the lineage is as it was


@given(field=st.sampled_from(["token_ids", "block_size", "hash_fn", "extra_keys",
                              "cache_salt"]), value=junk())
def test_junk_in_any_argument_of_of_is_a_typed_error(field: str, value: Any) -> None:
    """BlockHashes.of with junk tokens, block size, function, keys or salt raises typed."""
    args: dict[str, Any] = {"token_ids": [1, 2, 3, 4], "block_size": 2, "hash_fn": "sha256",
                            "extra_keys": (), "cache_salt": None, field: value}
    ok = {"token_ids": is_token_list(value) and not isinstance(value, str | bytes),
          "block_size": type(value) is int and value > 0,
          "hash_fn": value in kf.HASH_FUNCTIONS if type(value) is str else False,
          "extra_keys": isinstance(value, Sequence) and not isinstance(value, str | bytes) and all(
              type(k) in (str, bytes, int) for k in value),
          "cache_salt": value is None or type(value) in (str, bytes, int)}[field]
    assume(not ok)
    raises_typed(lambda: kf.BlockHashes.of(**args))


@given(field=st.sampled_from(["block_size", "hash_fn", "root", "hashes", "blocks"]),
       value=junk())
def test_junk_in_any_argument_of_the_constructor_is_a_typed_error(field: str, value: Any
                                                                    ) -> None:
    """BlockHashes(...) with one junk field: a typed error (a str root, hashes=5, ...)."""
    good = kf.BlockHashes.of([1, 2, 3, 4], 2)
    assume(not (type(value) is type(getattr(good, field)) and value == getattr(good, field)))
    args: dict[str, Any] = {"block_size": 2, "hash_fn": "sha256", "root": good.root,
                            "hashes": good.hashes, "blocks": good.blocks, field: value}
    assert kf.BlockHashes(**{**args, field: getattr(good, field)}) == good
    raises_typed(lambda: kf.BlockHashes(**args))


@pytest.mark.parametrize("call", [
    lambda: kf.BlockHashes.of(None, 2), lambda: kf.BlockHashes.of([True, 2], 2),
    lambda: kf.BlockHashes(2, "sha256", b"r", hashes=5),
    lambda: kf.BlockHashes(2, "sha256", "root"),
    lambda: kf.BlockHashes.of_digests([5], [1, 2], 2),
    lambda: kf.BlockHashes.of_digests([None], [1, 2], 2),
    lambda: kf.BlockHashes.of_digests([b"d"], [], 2),
    lambda: kf.BlockHashes.of_digests([b"d"], "ab", 2),
    lambda: kf.BlockHashes.of_digests([b"d0"], [1, 2], 2).extended([b"d1"], [1, 2]),
    lambda: kf.BlockHashes.of_digests([b"d0"], [1, 2], 2).extended([b"d1"], None),
    lambda: kf.BlockHashes.of_digests([b"d0"], None, 2).extended([b"d1"], [1, 2, 3, 4]),
    lambda: kf.BlockHashes.of_digests([b"d0"], None, 2).extended([], [1, 2]),
    lambda: kf.BlockHashes.of_digests([b"d0"], None, 2).extended([5], None),
    lambda: kf.BlockHashes.of_digests([b"d0"], None, 0),
    lambda: kf.BlockHashes.of_digests([b"d0"], None, 2).blocks,
    lambda: kf.BlockHashes.of_digests([b"d0"], None, 2).block_token_ids(0),
    lambda: kf.BlockHashes.of_digests([b"d0"], None, 2).token_ids_by_block(0, 1, 2),
    lambda: kf.BlockHashes.of([1, 2], 2).update(None),
    lambda: kf.BlockHashes.of([1, 2], 2).update(5),
    lambda: kf.BlockHashes.of([1, 2], 2).update(iter([1, 2, 3, 4])),
    lambda: kf.BlockHashes.of([1, 2], 2).parent_hash("1"),
    lambda: kf.BlockHashes.of([1, 2], 2).parent_hash(5),
    lambda: kf.BlockHashes.of([1, 2], 2).block_token_ids(True),
    lambda: kf.BlockHashes.of([1, 2], 2).block_token_ids(3),
    lambda: kf.BlockHashes.of([1, 2], 2).token_ids_by_block("a", 1, 2),
    lambda: kf.BlockHashes(2, "sha256", b"r", hashes=[b"forged"], blocks=[(1, 2)]),
], ids=["of None", "a bool token", "hashes=5", "a str root", "int digest", "None digest",
        "digests without tokens", "tokens as text", "extended without tokens",
        "kept tokens extended with None", "no tokens extended with tokens",
        "no tokens extended by nothing with tokens", "no tokens, an int digest",
        "no tokens, block size 0", "no tokens: blocks", "no tokens: block_token_ids",
        "no tokens: token_ids_by_block", "update None",
        "update int", "update iterator", "parent str", "parent past the end", "index bool",
        "index past the end", "first str", "forged digests"])
def test_the_issues_block_hash_cases_are_typed_errors(call: Callable[[], Any]) -> None:
    """Each case the issue lists (and their neighbours) raises a kvfunc error, not a TypeError."""
    raises_typed(call)


def test_a_bool_token_is_refused_like_a_bool_key() -> None:
    """[True, 2] no longer hashes like [1, 2]: bools are refused as tokens and as keys."""
    for call in (lambda: kf.BlockHashes.of([True, 2], 2),
                 lambda: kf.BlockHashes.of([1, 2], 2, extra_keys=[True])):
        assert isinstance(raises_typed(call), kf.InvalidTypeError)


@pytest.mark.parametrize("tokens", [[0, IntSubclass(3)], [0, 1, 2, IntSubclass(3)],
                                    [0, 1, IntSubclass(3)]],
                         ids=["the one block", "a later block", "the partial block"])
def test_an_int_subclass_token_is_refused_on_every_path(tokens: list[int]) -> None:
    """An int subclass is refused whether its block is the only one (the decode fast path),
    one of several, or the partial tail: no path hashes it as the int it claims to be."""
    assert isinstance(raises_typed(lambda: kf.BlockHashes.of(tokens, 2)), kf.InvalidTypeError)
    if len(tokens) % 2 == 0:  # update reads a partial block when it fills
        start = kf.BlockHashes.of(tokens[:2] if len(tokens) > 3 else [], 2)
        assert isinstance(raises_typed(lambda: start.update(tokens)), kf.InvalidTypeError)


class _Lying(Sequence[int]):
    """Tokens whose length and slices disagree, or whose slices are not lists."""

    def __init__(self, size: int, sliced: Any) -> None:
        self.size, self.sliced = size, sliced

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            if isinstance(self.sliced, BaseException):
                raise self.sliced
            return self.sliced
        return 1


@pytest.mark.parametrize("tokens", [
    "abcdefgh", b"abcdefgh", {0: 1}, None, 5, iter(range(8)),
    _Lying(1000, [1]), _Lying(1000, [1] * 9), _Lying(8, 7), _Lying(8, "ab"),
    _Lying(8, IndexError("boom")), _Lying(8, ValueError("boom")),
    [1, 2, 3, 4, 5, True], (1, 2, 3, 4, 5, IntSubclass(6)), [1, 2, 3, 4, 5, 2 ** 63],
], ids=["str", "bytes", "dict", "None", "int", "iterator", "long but a short slice",
        "a slice too long", "a slice not a sequence", "a slice of text", "a slice raising",
        "a slice raising ValueError", "a bool", "an int subclass in a tuple", "past int64"])
def test_extending_external_hashes_with_junk_tokens_is_a_typed_error(tokens: Any) -> None:
    """``extended`` reads only the new blocks' slice of the tokens: whatever the sequence
    says its length is, a slice that is short, long, not a sequence or holds a non-int is a
    typed error, and the value extended is unchanged."""
    h = kf.BlockHashes.of_digests([b"d0", b"d1"], [1, 2, 3, 4], 2)
    raises_typed(lambda: h.extended([b"d2"], tokens))
    assert h.num_blocks == 2 and h.hashes == (b"d0", b"d1")
    good = h.extended([b"d2"], (1, 2, 3, 4, 5, 6))  # a tuple's slice is a tuple: accepted
    assert good.blocks[2] == (5, 6) and h.extended([b"d2"], _Lying(6, [5, 6])).blocks[2] == (5, 6)


def test_hashes_that_keep_no_tokens_name_the_same_blocks_and_refuse_token_reads() -> None:
    """``of_digests(..., None, ...)`` keeps no tokens: the value equals (and hashes, pickles,
    looks up and caches as) the one made with tokens, extends with ``None``, and refuses
    every token read with a typed error that leaves it as it was."""
    with_tokens = kf.BlockHashes.of_digests([b"d0", b"d1"], [1, 2, 3, 4, 5], 2)
    bare = kf.BlockHashes.of_digests([b"d0", b"d1"], None, 2)
    assert bare == with_tokens and hash(bare) == hash(with_tokens)
    assert (bare.num_blocks, bare.num_tokens, bare.hashes) == (2, 4, (b"d0", b"d1"))
    assert pickle.loads(pickle.dumps(bare)) == bare
    assert isinstance(raises_typed(lambda: pickle.loads(pickle.dumps(bare)).blocks),
                      kf.NotSupportedError)
    for read in (lambda: bare.blocks, lambda: bare.block_token_ids(0),
                 lambda: bare.token_ids_by_block(0, 2, 2), lambda: bare.extended([b"x"], [1])):
        assert isinstance(raises_typed(read), kf.KVFuncError)
    assert (bare.num_blocks, bare.hashes, bare._tokens) == (2, (b"d0", b"d1"), None)  # as it was
    longer = bare.extended([b"d2"], None)
    assert longer.hashes == (b"d0", b"d1", b"d2") and bare.num_blocks == 2
    assert bare.extended([b"x"], None).hashes == (b"d0", b"d1", b"x")  # copies: d2 is taken
    assert longer == with_tokens.extended([b"d2"], [1, 2, 3, 4, 5, 6])
    s = kf.KVState.create({"full": kf.FullAttention(num_blocks=8, block_size=2)}, 64,
                          enable_prefix_caching=True)
    states, tokens = [], []
    for h in (bare, with_tokens):
        r = kf.allocate_slots(s, "a", 0, 5, block_hashes=h)
        assert r.ok and r.state.pools[0].by_key == {b"d0": 1, b"d1": 2}
        assert kf.lookup_prefix(r.state, h, max_tokens=4).num_tokens == 4
        assert kf.replay(s, [r.delta]) == r.state  # the delta's rows replay, tokens or not
        (event,) = events_from_delta(r.delta, r.state)
        states.append(r.state)
        tokens.append((r.delta.stored_token_ids, event.token_ids, event.block_hashes))
    assert states[0] == states[1]
    assert tokens == [((None, None), (), (b"d0", b"d1")),
                      (((1, 2), (3, 4)), (1, 2, 3, 4), (b"d0", b"d1"))]


def test_tokenless_stored_rows_round_trip_a_delta_log_and_junk_beside_them_is_refused(
        tmp_path: Any) -> None:
    """Stored rows without tokens (None) survive a delta log written and verified; a token
    column that holds a tuple with a non-int, or a tuple of None, beside them is refused."""
    s = kf.KVState.create({"full": kf.FullAttention(num_blocks=8, block_size=2)}, 64,
                          enable_prefix_caching=True)
    r = kf.allocate_slots(s, "a", 0, 5, block_hashes=kf.BlockHashes.of_digests(
        [b"d0", b"d1"], None, 2))
    path = tmp_path / "run.jsonl"
    with path.open("w") as out:
        log = DeltaLogWriter(out, s)
        log.write(0, r.delta)
        log.close(r.state)
    assert verify_log(path) == (r.state, 1)
    for bad in ((None, (1, True)), (None, (None,)), (None, ("3", 4))):
        d = kf.BlocksChanged(order="TT", stored_keys=("full", "full"),
                             stored_request_ids=("a", "a"), stored_positions=(0, 1),
                             stored_block_ids=(1, 2), stored_hashes=(b"h0", b"h1"),
                             stored_parent_hashes=(None, b"h0"), stored_token_ids=bad)
        error = raises_typed(lambda d=d: events_from_delta(d, {"full": 2}))
        assert "stored_token_ids holds" in str(error)
    assert events_from_delta(r.delta, r.state)[0].token_ids == ()  # None rows: well formed


def test_vllm_hashes_that_outrun_the_requests_tokens_are_refused_and_leave_nothing_seen(
        ) -> None:
    """vLLM's digests are kept without tokens, so the manager checks that the request's
    tokens fill the blocks they name: a typed error otherwise, the step left unseen (a retry
    refuses again instead of skipping its caching), and once the tokens are there the same
    step converts."""
    from types import SimpleNamespace

    from kvfunc.vllm._hashes import RequestHashes
    r = SimpleNamespace(request_id="a", block_hashes=[b"h0", b"h1"], all_token_ids=[1, 2, 3])
    cache = RequestHashes(2)
    for _ in range(2):
        assert isinstance(raises_typed(lambda: cache.for_step(r, 3)), kf.InvalidArgumentError)
    assert len(cache) == 0
    r.all_token_ids.append(4)
    got = cache.for_step(r, 3)
    assert got is not None and got.hashes == (b"h0", b"h1")
    r.block_hashes.append(b"h2")  # extended past the tokens: refused, the value kept
    assert isinstance(raises_typed(lambda: cache.of(r)), kf.InvalidArgumentError)
    assert cache.of(SimpleNamespace(request_id="a", block_hashes=[b"h0", b"h1"],
                                    all_token_ids=[1, 2, 3, 4])) is got


class _PosesAsInt(type):
    """A metaclass whose classes compare equal to ``int`` (an equality check would pass them)."""

    def __eq__(cls, other: object) -> bool:
        return other is int or cls is other

    __hash__ = type.__hash__


class _Impostor(int, metaclass=_PosesAsInt):
    """An int subclass whose type claims to equal ``int``."""


def test_a_token_whose_type_claims_to_equal_int_is_refused() -> None:
    """The token check asks for ``int`` itself, not for a type equal to it: a metaclass that
    answers True to ``== int`` does not get an int subclass through, on any path."""
    assert [_Impostor].count(int) == 1  # the disguise works on a check by equality
    tokens = [0, 1, 2, _Impostor(3)]
    for call in (lambda: kf.BlockHashes.of(tokens, 2), lambda: kf.BlockHashes.of(tokens, 4),
                 lambda: kf.BlockHashes.of(tokens[:2], 2).update(tokens),
                 lambda: kf.BlockHashes.of_digests([b"d0", b"d1"], tokens, 2)):
        assert isinstance(raises_typed(call), kf.InvalidTypeError)


@pytest.mark.parametrize("where", ["extra_keys", "cache_salt"])
def test_an_int_subclass_key_or_salt_is_refused(where: str) -> None:
    """A key or salt whose type is an int subclass is refused like a bool (its str() could lie)."""
    args: dict[str, Any] = {"extra_keys": (0, IntSubclass(3))} if where == "extra_keys" else {
        "cache_salt": IntSubclass(3)}
    error = raises_typed(lambda: kf.BlockHashes.of([1, 2, 3, 4], 2, **args))
    assert isinstance(error, kf.InvalidTypeError)


def test_a_value_rebuilt_from_its_fields_is_checked_and_equal() -> None:
    """Pickling goes through the checking constructor: a real value comes back equal."""
    h = kf.BlockHashes.of(range(10), 4, cache_salt="t")
    assert pickle.loads(pickle.dumps(h)) == h
    external = kf.BlockHashes.of_digests([b"d0", b"d1"], list(range(8)), 4)
    assert pickle.loads(pickle.dumps(external)) == external


@pytest.mark.parametrize("block_size", [0, -4, True, 2.0, "2", None])
def test_hashes_computed_elsewhere_refuse_a_bad_block_size(block_size: Any) -> None:
    """``of_digests`` checks the block size as the constructor does, with or without digests."""
    for digests, tokens in (([], []), ([b"d0"], [1, 2])):
        raises_typed(lambda d=digests, t=tokens: kf.BlockHashes.of_digests(d, t, block_size))


def test_hashes_computed_elsewhere_equal_the_constructors_value() -> None:
    """``of_digests`` makes, without the constructor, the value the constructor makes."""
    tokens = list(range(9))
    made = kf.BlockHashes.of_digests([b"d0", b"d1"], tokens, 4)
    built = kf.BlockHashes(4, "external", b"", [b"d0", b"d1"], [tokens[:4], tokens[4:8]])
    assert made == built and made.blocks == built.blocks and made.num_tokens == 8
    assert kf.BlockHashes.of_digests([], [], 4) == kf.BlockHashes(4, "external", b"")


# -- prefix hits -------------------------------------------------------------------------------

@given(field=st.sampled_from(["num_tokens", "block_ids", "query_tokens"]), value=junk())
def test_a_prefix_hit_with_a_junk_field_cannot_be_made(field: str, value: Any) -> None:
    """PrefixHit(...) and attrs.evolve with junk counts or tables raise typed errors."""
    args: dict[str, Any] = {"num_tokens": 4, "block_ids": {"full": (1,)}, "query_tokens": 8}
    valid = {"num_tokens": type(value) is int and 0 <= value <= 8,
             "query_tokens": type(value) is int and value >= 4,
             "block_ids": isinstance(value, dict) and all(
                 type(k) is str and type(t) is tuple and all(type(b) is int and b >= 0
                                                             for b in t)
                 for k, t in value.items())}[field]
    assume(not valid)
    raises_typed(lambda: kf.PrefixHit(**{**args, field: value}))
    raises_typed(lambda: attrs.evolve(kf.PrefixHit(**args), **{field: value}))


def test_a_hit_cannot_claim_more_tokens_than_it_looked_up() -> None:
    """query_tokens "junk" and 8 on a 16-token hit are refused; real hits rate at most 1."""
    raises_typed(lambda: kf.PrefixHit(16, {"full": (1, 2)}, "junk"))
    raises_typed(lambda: kf.PrefixHit(16, {"full": (1, 2)}, 8))
    s = kf.KVState.create({"full": kf.FullAttention(num_blocks=8, block_size=4)}, 64,
                          enable_prefix_caching=True)
    h = kf.BlockHashes.of(range(9), 4)
    s = kf.free_request(kf.allocate_slots(s, "a", 0, 9, block_hashes=h).state, "a")[0]
    hit = kf.lookup_prefix(s, h)
    r = kf.allocate_slots(s, "b", hit.num_tokens, 1, block_hashes=h, prefix_hit=hit)
    stats = kf.PrefixCacheStats.of([r.delta])
    assert (stats.hit_tokens, stats.query_tokens, stats.hit_rate) == (8, 8, 1.0)


@pytest.mark.parametrize("max_tokens", [True, "8", 8.0, -1, [8]])
def test_lookup_prefix_refuses_a_junk_cap(max_tokens: Any) -> None:
    """max_tokens must be None or a non-negative int; a bool is not one."""
    s = kf.KVState.create({"full": kf.FullAttention(num_blocks=8, block_size=4)}, 64,
                          enable_prefix_caching=True)
    raises_typed(lambda: kf.lookup_prefix(s, kf.BlockHashes.of(range(9), 4),
                                          max_tokens=max_tokens))


@pytest.mark.xfail(strict=True, reason="PrefixCacheStats.add (_prefix_ops.py) sums a delta's "
                   "hit columns as read, without the checks of BlocksChanged.operations(); "
                   "fix: fold over delta.operations() (checked) or check the columns there")
def test_stats_of_a_delta_with_junk_hit_columns_is_a_typed_error() -> None:
    """A hand-made delta whose hit counts are not ints: a typed error, not a TypeError."""
    bad = kf.BlocksChanged(order="H", hit_request_ids=("a",), hit_tokens=("x",),
                           hit_query_tokens=(None,))
    raises_typed(lambda: kf.PrefixCacheStats.of([bad]))


# -- deltas and their replay -------------------------------------------------------------------

def caching_log(layout: str) -> tuple[kf.KVState, list[kf.BlocksChanged], kf.KVState]:
    """A log of every kind of row (R L N F A S T E Z H Y) on a small caching state."""
    groups = {"full": kf.FullAttention(num_blocks=12, block_size=4),
              "swa": kf.SlidingWindow(num_blocks=12, block_size=4, sliding_window=8)}
    s0 = kf.KVState.create(groups, 64, enable_prefix_caching=True, layout=layout)
    log: list[kf.BlocksChanged] = []
    s = s0

    def keep(result: Any) -> None:
        nonlocal s
        s, delta = (result.state, result.delta) if hasattr(result, "delta") else result
        log.append(delta)

    a, c = kf.BlockHashes.of(range(13), 4), kf.BlockHashes.of(range(100, 120), 4)
    keep(kf.allocate_slots(s, "a", 0, 13, block_hashes=a))
    keep(kf.free_request(s, "a", priority=3))
    hit = kf.lookup_prefix(s, a, max_tokens=12)
    keep(kf.allocate_slots(s, "b", hit.num_tokens, 13 - hit.num_tokens, block_hashes=a,
                           prefix_hit=hit))
    keep(kf.allocate_slots(s, "b", 13, 8, block_hashes=a.update([*range(13), *[7] * 8])))
    keep(kf.recycle_skipped_blocks(s, "b", 21))
    keep(kf.allocate_slots(s, "c", 0, 20, block_hashes=c, prefix_hit=kf.lookup_prefix(s, c)))
    keep(kf.fork_request(s, "b", "d"))
    for rid, priority in zip("bcd", (-1, 0, 2), strict=True):
        keep(kf.free_request(s, rid, priority=priority))
    keep(kf.reset_prefix_cache(s))
    return s0, [d for d in log if not d.is_empty], s


LOGS = {layout: caching_log(layout) for layout in ("per-type", "shared")}


def test_the_attack_log_holds_every_kind_of_row() -> None:
    """The fuzz below mutates a log that has rows of every family (so each reader is hit)."""
    for s0, log, final in LOGS.values():
        assert set("RLNFASTZHY") <= set("".join(d.order for d in log))
        assert kf.replay(s0, log) == final


def with_cell(d: kf.BlocksChanged, name: str, row: int, value: Any) -> kf.BlocksChanged:
    """``d`` rebuilt by keyword with one cell of column ``name`` replaced."""
    columns = {n: getattr(d, n) for n in COLUMN_NAMES}
    col = list(columns[name])
    col[row % len(col)] = value
    columns[name] = tuple(col)
    return kf.BlocksChanged(d.version, d.order, **columns)


def near(value: Any) -> st.SearchStrategy[Any]:
    """Plausible lies about a cell: its neighbours, zero, a sign flip, a huge count."""
    if type(value) is int:
        return st.sampled_from([value + 1, value - 1, 0, -value, 2 ** 40, -1, 64])
    return st.sampled_from([b"", b"x" * 32, None, (), (1, 2, 3, 4), "full", "swa", 0])


@given(layout=st.sampled_from(sorted(LOGS)), data=st.data())
def test_a_log_with_one_bad_cell_replays_checked_or_is_refused(layout: str, data: Any) -> None:
    """One cell of one delta changed (junk or a lie): replay refuses it or lands on a sound state.

    Events and a subscriber's view read the same delta: a typed error or events.
    """
    s0, log, final = LOGS[layout]
    i = data.draw(st.integers(0, len(log) - 1))
    d = log[i]
    name = data.draw(st.sampled_from([n for n in COLUMN_NAMES if getattr(d, n)]))
    row = data.draw(st.integers(0, 100))
    old = getattr(d, name)[row % len(getattr(d, name))]
    bad = with_cell(d, name, row, data.draw(st.one_of(junk(), near(old))))
    attacked = [*log[:i], bad, *log[i + 1:]]
    try:
        replayed = kf.replay(s0, attacked)
    except kf.ReplayMismatchError as exc:  # at the bad delta, or where its lie shows later
        where = int(str(exc).split()[1].rstrip(",:"))
        assert short(str(exc)) and i <= where < len(log), str(exc)
    else:
        assert kf.check_invariants(replayed) is None
    try:
        CachedBlocksView().apply(events_from_delta(bad, s0))
    except kf.KVFuncError as exc:
        assert short(str(exc)), str(exc)
    assert kf.replay(s0, log) == final  # the state and the log were not touched


@given(order=st.text(alphabet="RLNFASCTEZHDXYQ ", max_size=12))
def test_a_junk_order_is_refused_or_fits(order: str) -> None:
    """Any ``order`` string over a real delta's columns: refused as malformed, or it replays."""
    s0, log, _ = LOGS["per-type"]
    d = log[2]
    columns = {n: getattr(d, n) for n in COLUMN_NAMES}
    try:
        kf.replay(s0, [*log[:2], kf.BlocksChanged(d.version, order, **columns)])
    except kf.ReplayMismatchError as exc:
        assert short(str(exc))


def hit_row(rid: Any, tokens: Any, query: Any) -> kf.BlocksChanged:
    return kf.BlocksChanged(order="H", hit_request_ids=(rid,), hit_tokens=(tokens,),
                            hit_query_tokens=(query,))


def stored_row(position: int, tokens: Any, parent: Any) -> kf.BlocksChanged:
    """A delta that registers "z", gives it a block and caches it at ``position``."""
    return kf.BlocksChanged(
        order="RAT", registered_keys=("full",), registered_request_ids=("z",),
        appended_keys=("full",), appended_request_ids=("z",), appended_block_ids=(1,),
        stored_keys=("full",), stored_request_ids=("z",), stored_positions=(position,),
        stored_block_ids=(1,), stored_hashes=(b"h" * 32,), stored_parent_hashes=(parent,),
        stored_token_ids=(tokens,))


ONE_GROUP = {"full": kf.FullAttention(num_blocks=8, block_size=4)}
BAD_DELTAS = {
    "a hit on a state without caching": (False, [hit_row("a", 0, 4)], "no prefix cache"),
    "a hit of 64 tokens out of 4": (True, [hit_row("a", 64, 4)], "out of 4 looked up"),
    "a negative hit": (True, [hit_row("a", -4, 4)], "out of 4 looked up"),
    "a hit count that is a str": (True, [hit_row("a", "4", 4)], "hit_tokens holds '4'"),
    "a hit count that is a bool": (True, [hit_row("a", 0, True)], "hit_query_tokens holds"),
    "a hit for nobody": (True, [hit_row("a", 0, 4)], "'a' is not registered"),
    "a stored block without its tokens": (True, [stored_row(0, (), None)], "0 token ids"),
    "a stored block with a str token": (True, [stored_row(0, (1, 2, "3", 4), None)],
                                        "stored_token_ids holds"),
    "a first block with a parent": (True, [stored_row(0, (1, 2, 3, 4), b"p")], "parent hash"),
    "an int digest": (True, [kf.BlocksChanged(order="Z", cleared_keys=(5,))], "cleared_keys"),
    "an unknown column": (True, None, "no column"),
}


@pytest.mark.parametrize("name", BAD_DELTAS)
def test_the_issues_replay_cases_are_refused(name: str) -> None:
    """Hit rows without caching, garbage counts, 64 of 4, rows without tokens: refused."""
    caching, deltas, says = BAD_DELTAS[name]
    s0 = kf.KVState.create(ONE_GROUP, 64, enable_prefix_caching=caching)
    if deltas is None:
        error = raises_typed(lambda: kf.BlocksChanged(hit_counts=(1,)))
        assert isinstance(error, kf.InvalidTypeError)
    else:
        error = raises_typed(lambda: kf.replay(s0, deltas))
        assert isinstance(error, kf.ReplayMismatchError)
    assert says in str(error)


@pytest.mark.parametrize("deltas", [None, 5, "abc", kf.BlocksChanged(), [None], [5], [{}]])
def test_replay_of_something_that_is_not_a_log_is_a_typed_error(deltas: Any) -> None:
    """replay(state, None) and friends raise kvfunc errors, not TypeError or AttributeError."""
    raises_typed(lambda: kf.replay(kf.KVState.create(ONE_GROUP, 64), deltas))


@pytest.mark.parametrize("args", [(None, {}, 64), (5, {}, 64), ("info", {}, 64)])
def test_from_cache_info_of_something_that_is_not_one_is_a_typed_error(args: Any) -> None:
    """KVState.from_cache_info(None, ...) raises InvalidTypeError."""
    raises_typed(lambda: kf.KVState.from_cache_info(*args))


@pytest.mark.xfail(strict=True, reason="group_cache_entries (_state.py) reads layer.caches and "
                   "cache.needs_block without checking the records' types; fix: check each "
                   "layer is a LayerCacheInfo-like record and each cache a CacheEntry there")
@pytest.mark.parametrize("layers", [[None], [kf.LayerCacheInfo(0, [None])]])
def test_from_cache_info_with_junk_records_is_a_typed_error(layers: list[Any]) -> None:
    """A ModelCacheInfo whose layers or caches are not records: a typed error."""
    raises_typed(lambda: kf.KVState.from_cache_info(kf.ModelCacheInfo(1, layers), {}, 64))
