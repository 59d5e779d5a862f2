"""KV events under attack: what cannot be decoded cannot be built, and every reader is typed.

An event record checks its fields when it is made, so the encoder never
writes bytes that kvfunc's own decoder refuses, and a subscriber's
:class:`CachedBlocksView` never meets an unhashable field.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from junk import junk, short

import kvfunc as kf
from kvfunc.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CachedBlocksView,
    KVEventBatch,
    decode_event_batch,
    encode_event_batch,
    events_from_delta,
)

GOOD: dict[type, dict[str, Any]] = {
    BlockStored: {"block_hashes": (b"h0", b"h1"), "parent_block_hash": b"p",
                  "token_ids": (1, 2, 3, 4), "block_size": 2, "lora_id": None, "medium": "GPU",
                  "group": "full", "block_ids": (1, 2)},
    BlockRemoved: {"block_hashes": (b"h0",), "medium": "GPU", "group": "full",
                   "block_ids": (1,)},
    AllBlocksCleared: {"groups": ("full",)},
}


def raises_typed(call: Callable[[], Any]) -> kf.KVFuncError:
    """The kvfunc error ``call`` raises (anything else fails the test); its message is short."""
    with pytest.raises(kf.KVFuncError) as info:
        call()
    assert short(str(info.value)), str(info.value)
    return info.value


@given(data=st.data(), kind=st.sampled_from(list(GOOD)), value=junk())
def test_an_event_that_can_be_made_round_trips_through_the_codec(data: Any, kind: type,
                                                                 value: Any) -> None:
    """Junk in one field: the record refuses it typed, or (if it fits) encode/decode keep it."""
    field = data.draw(st.sampled_from(sorted(GOOD[kind])))
    try:
        event = kind(**{**GOOD[kind], field: value})
    except kf.KVFuncError as exc:
        assert short(str(exc)), str(exc)
        return
    batch = KVEventBatch(1.0, (event,), 0)
    assert decode_event_batch(encode_event_batch(batch)) == batch


@given(field=st.sampled_from(["ts", "events", "data_parallel_rank"]), value=junk())
def test_a_batch_that_can_be_made_round_trips_through_the_codec(field: str, value: Any
                                                                ) -> None:
    """Junk ts, events or rank: refused typed when the batch is made, or it round-trips."""
    args: dict[str, Any] = {"ts": 1.0, "events": (AllBlocksCleared(),),
                            "data_parallel_rank": None, field: value}
    try:
        batch = KVEventBatch(**args)
    except kf.KVFuncError as exc:
        assert short(str(exc)), str(exc)
        return
    back = decode_event_batch(encode_event_batch(batch))
    assert back == batch or back.ts != back.ts  # NaN is the one ts unequal to itself


def test_an_int_time_is_kept_as_the_float_the_wire_carries() -> None:
    """2**53 + 1 has no float: the batch holds the float it rounds to, so it round-trips."""
    batch = KVEventBatch(2 ** 53 + 1, (AllBlocksCleared(),))
    assert type(batch.ts) is float
    assert decode_event_batch(encode_event_batch(batch)) == batch


@pytest.mark.parametrize("call", [
    lambda: BlockStored(("ab",), None, (1, 2), 2),
    lambda: BlockStored((b"ab",), None, (1, 2), "4"),
    lambda: BlockRemoved(5),  # type: ignore[arg-type]
    lambda: encode_event_batch(KVEventBatch(1.0, (BlockRemoved(5),))),  # type: ignore[arg-type]
    lambda: BlockRemoved((b"a",), None, ["g"], (1,)),  # type: ignore[arg-type]
    lambda: BlockStored(([1],), None, (), 2, block_ids=(1,)),  # type: ignore[arg-type]
    lambda: BlockStored((b"a",), None, (True, 2), 2),
    lambda: BlockRemoved((b"a", b"b"), None, "g", (1,)),
    lambda: AllBlocksCleared("full"),  # type: ignore[arg-type]
    lambda: KVEventBatch(10 ** 400, ()),
    lambda: KVEventBatch(1.0, ("event",)),  # type: ignore[arg-type]
    lambda: CachedBlocksView().apply(5),  # type: ignore[arg-type]
    lambda: CachedBlocksView().apply([object()]),  # type: ignore[list-item]
    lambda: CachedBlocksView().cached(["full"]),  # type: ignore[arg-type]
    lambda: CachedBlocksView().num_cached_blocks(None),  # type: ignore[arg-type]
    lambda: CachedBlocksView().cached_prefix_blocks("full", [[b"h"]]),  # type: ignore[list-item]
    lambda: CachedBlocksView().cached_prefix_blocks("full", 5),  # type: ignore[arg-type]
    lambda: CachedBlocksView({"full": 1}),  # type: ignore[arg-type]
], ids=["str hash", "str block size", "hashes an int", "encode hashes an int",
        "unhashable group", "unhashable hash", "bool token", "ids short", "groups a str",
        "ts too large", "not an event", "apply an int", "apply a non-event", "cached list",
        "count None", "prefix list", "prefix int", "view of a dict"])
def test_the_issues_event_cases_are_typed_errors(call: Callable[[], Any]) -> None:
    """Wrong-typed fields, bare TypeErrors in encode and apply: each a kvfunc error now."""
    raises_typed(call)


def test_events_from_a_delta_with_junk_stored_tokens_is_a_typed_error() -> None:
    """stored_token_ids=(5,) (not a tuple of ints) is refused as a malformed delta."""
    d = kf.BlocksChanged(order="T", stored_keys=("full",), stored_request_ids=("a",),
                         stored_positions=(0,), stored_block_ids=(1,),
                         stored_hashes=(b"h",), stored_parent_hashes=(None,),
                         stored_token_ids=(5,))
    error = raises_typed(lambda: events_from_delta(d, {"full": 4}))
    assert isinstance(error, kf.ReplayMismatchError) and "stored_token_ids" in str(error)


@pytest.mark.parametrize("medium", [5, b"GPU", ["GPU"], True])
def test_a_junk_medium_is_refused_whether_or_not_there_are_events(medium: Any) -> None:
    """events_from_delta checks ``medium`` first: the same answer for an empty delta."""
    s = kf.KVState.create({"full": kf.FullAttention(num_blocks=8, block_size=4)}, 64,
                          enable_prefix_caching=True)
    r = kf.allocate_slots(s, "a", 0, 9, block_hashes=kf.BlockHashes.of(range(9), 4))
    for delta in (kf.BlocksChanged(), r.delta):
        assert isinstance(raises_typed(lambda d=delta: events_from_delta(d, s, medium=medium)),
                          kf.InvalidTypeError)


def test_lists_are_taken_where_vllm_writes_lists() -> None:
    """msgspec gives lists: an event built from lists holds tuples and equals the tuple one."""
    assert BlockStored([b"h"], None, [1, 2], 2, block_ids=[3]) == BlockStored(
        (b"h",), None, (1, 2), 2, block_ids=(3,))
    assert KVEventBatch(0.0, [AllBlocksCleared()]).events == (AllBlocksCleared(),)
