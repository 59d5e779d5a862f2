"""Hostile arguments to the tier transitions: typed errors, short messages, nothing changed."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvfunc as kf
from kvfunc import BlockHashes, FullAttention, KVState, TieredState

sys.path.insert(0, str(Path(__file__).parent))
from junk import SHORT, junk  # the strategies beside this file


def _busy() -> tuple[TieredState, BlockHashes, kf.TieredHit]:
    """A tiered state with a host hit, stores in flight, and the hit's hashes."""
    dev = KVState.create({"f": FullAttention(num_blocks=5, block_size=4)}, 64,
                         enable_prefix_caching=True)
    t = TieredState.create(dev, host_blocks=6, remote=True)
    h = BlockHashes.of(range(13), 4)
    t = kf.allocate_tiered(t, [("a", 0, 13)], block_hashes={"a": h}).state
    t = kf.allocate_tiered(kf.free_tiered(t, "a")[0], [("b", 0, 16)]).state
    t = kf.complete_moves(t, done=list(t.moves)).state
    t = kf.free_tiered(t, "b")[0]
    return t, h, kf.lookup_tiers(t, h, max_tokens=12)


STATE, HASHES, HIT = _busy()
LOADING = kf.allocate_tiered(STATE, [("c", 12, 1, 0, 0, None, HASHES, HIT)]).state


def _refused(call: Any) -> None:
    before = repr(STATE)
    with pytest.raises(kf.KVFuncError) as info:
        call()
    assert len(str(info.value)) < SHORT, str(info.value)[:SHORT]
    assert repr(STATE) == before


@given(bad=junk())
def test_junk_move_ids(bad: object) -> None:
    """Junk in place of move ids is a typed error (or, if it names no id, a no-op)."""
    try:
        res = kf.complete_moves(STATE, done=bad)  # type: ignore[arg-type]
    except kf.KVFuncError as exc:
        assert len(str(exc)) < SHORT
    else:
        assert res.state.moves == STATE.moves and not res.delta.settled_ids


@given(bad=junk())
def test_junk_entries_and_priorities(bad: object) -> None:
    """Junk entries, hits, priorities and request ids are typed errors and change nothing."""
    for call in (
        lambda: kf.allocate_tiered(STATE, [("c", 12, 1, 0, 0, None, HASHES, bad)]),
        lambda: kf.allocate_tiered(STATE, [(bad, 12, 1, 0, 0, None, HASHES, HIT)]),
        lambda: kf.allocate_tiered(LOADING, [(bad, 12, 1)]),
        lambda: kf.allocate_tiered(STATE, bad),  # type: ignore[arg-type]
        lambda: kf.allocate_tiered(STATE, [bad]),
        lambda: kf.allocate_tiered(STATE, [("c", bad, 1, 0, 0, None, HASHES, HIT)]),
        lambda: kf.allocate_tiered(STATE, [("c", 12, 1, 0, 0, None, bad, HIT)]),
        lambda: kf.allocate_tiered(STATE, [("c", 0, 1)], priorities={"c": bad}),
        lambda: kf.free_tiered(STATE, bad),  # type: ignore[arg-type]
        lambda: kf.lookup_tiers(STATE, bad),  # type: ignore[arg-type]
        lambda: kf.loads_pending(STATE, bad),  # type: ignore[arg-type]
        lambda: kf.replay_tiered(STATE, [bad]),  # type: ignore[list-item]
    ):
        try:
            call()
        except kf.KVFuncError as exc:
            assert len(str(exc)) < SHORT
        assert kf.lookup_tiers(STATE, HASHES, max_tokens=12) == HIT


@given(sources=st.lists(st.sampled_from(["host", "remote", "disk"]), min_size=3, max_size=3),
       blocks=st.lists(st.integers(-2, 8), min_size=3, max_size=3))
def test_forged_hits_are_refused(sources: list[str], blocks: list[int]) -> None:
    """A hit whose blocks the tiers do not hold as it says is refused as stale or foreign."""
    forged = kf.TieredHit(HIT.device, tuple(sources), tuple(blocks), HIT.hashes,
                          HIT.num_tokens, HIT.query_tokens)
    entry = ("c", 12, 1, 0, 0, None, HASHES, forged)
    if forged == HIT:
        assert not kf.allocate_tiered(STATE, [entry]).refused
    else:
        _refused(lambda: kf.allocate_tiered(STATE, [entry]))


def test_a_hit_of_other_hashes_is_refused() -> None:
    """A hit looked up for one prompt cannot load blocks into another prompt's request."""
    other = BlockHashes.of(range(100, 113), 4)
    _refused(lambda: kf.allocate_tiered(STATE, [("c", 12, 1, 0, 0, None, other, HIT)]))
    _refused(lambda: kf.allocate_tiered(STATE, [("c", 8, 1, 0, 0, None, HASHES, HIT)]))
    _refused(lambda: kf.allocate_tiered(STATE, [("c", 12, 1, 0, 0, None, HASHES, HIT),
                                                ("c", 12, 1, 0, 0, None, HASHES, HIT)]))


def test_replay_refuses_a_log_that_does_not_fit() -> None:
    """A delta applied to a state it does not fit is a ReplayMismatchError."""
    r = kf.allocate_tiered(STATE, [("c", 12, 1, 0, 0, None, HASHES, HIT)])
    assert kf.replay_tiered(STATE, [r.delta]) == r.state
    with pytest.raises(kf.ReplayMismatchError):
        kf.replay_tiered(r.state, [r.delta])
    done = kf.complete_moves(r.state, done=list(r.state.moves))
    with pytest.raises(kf.ReplayMismatchError):
        kf.replay_tiered(STATE, [done.delta])


FIELDS = ("moved_ids", "moved_directions", "moved_hashes", "moved_src_block_ids",
          "moved_dst_block_ids", "moved_request_ids", "moved_priorities", "moved_keys",
          "prioritized_request_ids", "prioritized_priorities", "settled_ids",
          "settled_outcomes", "order")


@given(field=st.sampled_from(FIELDS), index=st.integers(0, 3), bad=junk())
def test_a_tampered_log_is_refused_or_replays(field: str, index: int, bad: object) -> None:
    """A log with one cell replaced by junk is a ReplayMismatchError, or replays as written."""
    import attrs

    r = kf.allocate_tiered(STATE, [("c", 12, 1, 0, 0, None, HASHES, HIT)], priorities={"c": 2})
    done = kf.complete_moves(r.state, done=list(r.state.moves)[:2])
    deltas = [r.delta, done.delta]
    k = index % 2
    column = getattr(deltas[k], field)
    if not column:
        return
    if field == "order":
        cells = list(column)
        cells[index % len(cells)] = bad if isinstance(bad, str) else "Q"
        value: Any = "".join(map(str, cells))
    else:
        cells = list(column)
        cells[index % len(cells)] = bad
        value = tuple(cells)
    deltas[k] = attrs.evolve(deltas[k], **{field: value})
    try:
        final = kf.replay_tiered(STATE, deltas)
    except kf.ReplayMismatchError as exc:
        assert len(str(exc)) < SHORT
    else:
        kf.check_tiered_invariants(final)


def test_a_tier_log_with_a_priority_out_of_range_is_refused() -> None:
    """A forged priority row or move beyond ``MAX_PRIORITY`` is refused by replay."""
    from kvfunc.core import FullAttention, KVState
    from kvfunc.core._tier_checks import replay_tiered

    dev = KVState.create({"f": FullAttention(num_blocks=9, block_size=4)}, 64,
                         enable_prefix_caching=True)
    t0 = kf.TieredState.create(dev, host_blocks=4)
    r = kf.allocate_tiered(t0, [("a", 0, 8)],
                           block_hashes={"a": kf.BlockHashes.of(list(range(8)), 4)},
                           priorities={"a": 7})
    assert replay_tiered(t0, [r.delta]) == r.state
    for bad in (kf.MAX_PRIORITY + 1, -(10 ** 6), True):
        forged = kf.TierDelta(device=r.delta.device, order="P", prioritized_request_ids=("a",),
                              prioritized_priorities=(bad,))
        with pytest.raises(kf.ReplayMismatchError, match="priority row"):
            replay_tiered(t0, [forged])


def _hybrid_log() -> tuple[TieredState, kf.TierDelta, TieredState]:
    """A hybrid device's first step (write-through stores of both groups' blocks): the state
    before, the delta, the state after."""
    dev = KVState.create({"f": FullAttention(num_blocks=11, block_size=4),
                          "w": kf.SlidingWindow(num_blocks=11, block_size=4, sliding_window=8)},
                         64, enable_prefix_caching=True, layout="shared")
    t0 = TieredState.create(dev, host_blocks=32, write_policy="write-through")
    r = kf.allocate_tiered(t0, [("a", 0, 17)], block_hashes={"a": BlockHashes.of(range(17), 4)})
    return t0, r.delta, r.state


HYBRID = _hybrid_log()


@given(index=st.integers(0, 7), swap=st.sampled_from(["key", "tag"]))
def test_a_hybrid_log_naming_the_wrong_group_is_refused(index: int, swap: str) -> None:
    """A move whose group is not the one its tier key names, or whose key names no group, is a
    ReplayMismatchError (a short one)."""
    import attrs

    t0, delta, after = HYBRID
    assert kf.replay_tiered(t0, [delta]) == after  # the untampered log replays
    keys, hashes = list(delta.moved_keys), list(delta.moved_hashes)
    i = index % len(keys)
    if swap == "key":
        keys[i] = "w" if keys[i] == "f" else "f"
    else:
        hashes[i] = hashes[i][:-1] + bytes([5])
    bad = attrs.evolve(delta, moved_keys=tuple(keys), moved_hashes=tuple(hashes))
    with pytest.raises(kf.ReplayMismatchError) as info:
        kf.replay_tiered(t0, [bad])
    assert len(str(info.value)) < SHORT


class _Bytes(bytes):
    """A bytes subclass: not a tier key."""


@pytest.mark.parametrize("cell", ["source", "block", "key"])
@pytest.mark.parametrize("kind", ["float", "numpy", "subclass", "bytearray"])
def test_a_hit_with_a_cell_of_a_wrong_type_is_refused(cell: str, kind: str) -> None:
    """A TieredHit whose source, host block or tier key has a wrong type (a float, a numpy
    integer, a subclass, a bytearray) is an InvalidTypeError: its delta would not replay."""
    import numpy as np

    sources, blocks, keys = list(HIT.sources), list(HIT.host_block_ids), list(HIT.hashes)
    if cell == "block":
        blocks[0] = {"float": float(blocks[0]), "numpy": np.int64(blocks[0]),
                     "subclass": kf.core._checks, "bytearray": True}[kind]
    elif cell == "key":
        keys[0] = {"float": 1.0, "numpy": np.bytes_(keys[0]), "subclass": _Bytes(keys[0]),
                   "bytearray": bytearray(keys[0])}[kind]
    else:
        sources[0] = {"float": 1.0, "numpy": np.str_("host"), "subclass": np.str_("host"),
                      "bytearray": bytearray(b"host")}[kind]
    forged = kf.TieredHit(HIT.device, tuple(sources), tuple(blocks), tuple(keys),
                          HIT.num_tokens, HIT.query_tokens)
    with pytest.raises(kf.InvalidTypeError):
        kf.allocate_tiered(STATE, [("c", 12, 1, 0, 0, None, HASHES, forged)])


def test_a_hit_sharing_a_block_being_loaded_is_refused() -> None:
    """While loads write device blocks (which the device does not cache), a forged or stale
    device hit that shares them (a plain PrefixHit, or the device part of a TieredHit) is
    refused."""
    table = kf.get_block_ids(LOADING.device, "c")["f"][:3]
    assert all(b in LOADING.device_pending for b in table)
    raw = kf.PrefixHit(12, {"f": table}, 12)
    for hit in (raw, kf.TieredHit(raw, (), (), (), raw.num_tokens, 12)):
        before = repr(LOADING)
        with pytest.raises(kf.InvalidArgumentError, match="a load is still writing"):
            kf.allocate_tiered(LOADING, [("d", raw.num_tokens, 1, 0, 0, None, HASHES, hit)])
        assert repr(LOADING) == before
    good = kf.lookup_tiers(LOADING, HASHES, max_tokens=12)  # stops before them: taken
    kf.allocate_tiered(LOADING, [("d", good.num_tokens, 1, 0, 0, None, HASHES, good)])


@pytest.mark.parametrize("forgery", ["indexed", "not-evicted", "other-group", "empty-hash"])
def test_a_forged_store_in_a_hybrid_log_is_refused(forgery: str) -> None:
    """A store to the host of a key the host already holds, of a block its delta neither
    cached nor evicted, of a block re-tagged to the other group (key and tag agreeing), or
    of an empty hash: a ReplayMismatchError."""
    import attrs

    t0, delta, after = HYBRID
    hashes, srcs, keys = list(delta.moved_hashes), list(delta.moved_src_block_ids), \
        list(delta.moved_keys)
    i = 1
    if forgery == "indexed":
        hashes[i], keys[i] = hashes[0], keys[0]
    elif forgery == "not-evicted":
        srcs[i] = 10
    elif forgery == "other-group":
        other = "w" if keys[i] == "f" else "f"
        hashes[i], keys[i] = t0.tier_key(other, t0.split_key(hashes[i])[1]), other
    else:
        hashes[i], keys[i] = b"\x01", "w"
    bad = attrs.evolve(delta, moved_hashes=tuple(hashes), moved_src_block_ids=tuple(srcs),
                       moved_keys=tuple(keys))
    base = t0
    if forgery == "indexed":  # the same store twice: once done, then again in a later delta
        base = kf.complete_moves(after, done=[0]).state
        bad = attrs.evolve(bad, moved_ids=tuple(m + base.next_move_id for m in bad.moved_ids),
                           device=kf.BlocksChanged())
    with pytest.raises(kf.ReplayMismatchError) as info:
        kf.replay_tiered(base, [bad])
    assert len(str(info.value)) < SHORT
