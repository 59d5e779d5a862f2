"""Runs of blocks that one call moves: a transition's delta keeps them (new blocks, freed
blocks, slid-out positions) unspelled until read, every way of reading it giving the rows a
keyword-built delta has; and a run that names a block twice drops one holder per mention."""

from __future__ import annotations

import pickle

import pytest

import kvfunc as kf
from kvfunc.core._delta import FIELDS


def _program(caching: bool) -> list[kf.BlocksChanged]:
    """Deltas of a program whose transitions record runs of every kind: a prompt's blocks (A),
    a window's slid-out positions (N), a request freed (F), detached blocks let go (X)."""
    policies = {"full": kf.FullAttention(num_blocks=64, block_size=4),
                "swa": kf.SlidingWindow(num_blocks=64, block_size=4, sliding_window=8)}
    state = kf.KVState.create(policies, 256, enable_prefix_caching=caching)
    deltas = []
    res = kf.allocate_batch(state, [("a", 0, 30), ("b", 0, 21)])
    deltas.append(res.delta)
    res = kf.allocate_batch(res.state, [("a", 30, 9)])  # with caching, the window slides here
    deltas.append(res.delta)
    state, delta = kf.recycle_skipped_blocks(res.state, "a", 39)
    deltas.append(delta)
    state, delta = kf.free_request(state, "a")
    deltas.append(delta)
    detached = kf.detach_request(state, "b")
    deltas.append(detached.delta)
    deltas.append(kf.free_detached(detached.state, dict(detached.block_ids))[1])
    return deltas


def _keyword_built(d: kf.BlocksChanged) -> kf.BlocksChanged:
    """The same delta built by keyword from its columns (no builder rows behind it)."""
    return kf.BlocksChanged(d.version, d.order, **dict(zip(FIELDS[2:], d.columns(), strict=True)))


def _hashed_program(layout: str) -> list[kf.BlocksChanged]:
    """Deltas of a program with block hashes: prompts cache runs of blocks (T), are freed,
    and a later prompt takes the cached blocks back, evicting a run (E); a decode step takes
    one cached block (one E)."""
    policies = {"full": kf.FullAttention(num_blocks=24, block_size=4),
                "swa": kf.SlidingWindow(num_blocks=24, block_size=4, sliding_window=8)}
    state = kf.KVState.create(policies, 256, enable_prefix_caching=True, layout=layout)
    deltas, tokens = [], {"a": list(range(40)), "b": list(range(100, 141))}
    for rid in ("a", "b"):
        h = kf.BlockHashes.of(tokens[rid], 4)
        res = kf.allocate_slots(state, rid, 0, len(tokens[rid]), block_hashes=h)
        state, delta = kf.free_request(res.state, rid, block_hashes=h)
        deltas += [res.delta, delta]
    res = kf.allocate_slots(state, "c", 0, 44)  # takes the cached blocks: evicts runs
    deltas.append(res.delta)
    res = kf.allocate_slots(res.state, "c", 44, 1)  # a new block: one more eviction
    return [*deltas, res.delta]


def _deltas(kind: str) -> list[kf.BlocksChanged]:
    return (_program(kind == "caching") if kind in ("plain", "caching")
            else _hashed_program(kind))


@pytest.mark.parametrize("kind", ["plain", "caching", "shared", "per-type"])
def test_runs_read_as_their_rows(kind: str) -> None:
    """Operations read first, columns read first, equality, hash, repr and pickle all agree
    with the keyword-built delta, and each transition's order (one code per row of its runs)
    is the one pinned here."""
    first_ops = [list(d.operations()) for d in _deltas(kind)]
    for d, ops in zip(_deltas(kind), first_ops, strict=True):
        built = _keyword_built(d)  # columns read first on this copy
        assert ops == list(built.operations()) == list(d.operations())
        assert (d, hash(d), repr(d)) == (built, hash(built), repr(built))
        assert pickle.loads(pickle.dumps(d)) == built
    orders = [d.order for d in _deltas(kind)]
    assert orders == ORDERS_BY_KIND[kind]


#: The program's orders: runs of A, N, F and X rows, each one code per row.
ORDERS = ["RR" + "A" * 16 + "RR" + "A" * 12, "AAAA", "NNNFFF", "L" + "F" * 10 + "LFF", "DD",
          "X" * 6 + "F" * 6 + "XXXFFF"]
ORDERS_CACHING = ["RR" + "A" * 16 + "RR" + "A" * 12, "NNNNNFFFFFAAAA", "NNNFFF",
                  "L" + "F" * 10 + "LFF", "DD", "X" * 6 + "F" * 6 + "X" * 6 + "F" * 6]
_ADMIT_A, _FREE = "RR" + "A" * 20 + "T" * 20, "L" + "F" * 10 + "L" + "F" * 10
ORDERS_BY_KIND = {
    "plain": ORDERS, "caching": ORDERS_CACHING,
    "shared": [_ADMIT_A, _FREE, "RR" + "E" * 8 + "A" * 11 + "E" * 11 + "A" * 11 + "T" * 20,
               "L" + "F" * 11 + "L" + "F" * 11, "RR" + "E" * 9 + "A" * 11 + "E" * 11 + "A" * 11,
               "N" * 9 + "F" * 9 + "AA"],
    "per-type": [_ADMIT_A, _FREE, "RR" + "A" * 22 + "T" * 20, "L" + "F" * 11 + "L" + "F" * 11,
                 "RR" + "E" * 8 + "A" * 11 + "E" * 8 + "A" * 11, "N" * 9 + "F" * 9 + "EAA"]}


@pytest.mark.parametrize("layout", ["shared", "per-type"])
def test_a_run_of_stored_or_evicted_blocks_spells_each_blocks_row(layout: str) -> None:
    """The T rows of a stored run carry each block's position, digest, parent digest and
    tokens; the E rows of an evicted run each block's group and digest (untagged)."""
    deltas = _hashed_program(layout)
    h = kf.BlockHashes.of(list(range(40)), 4).hashes
    stored = [op for op in deltas[0].operations() if type(op) is kf.Stored]
    assert [(op.key, op.position, op.block_hash, op.parent_hash, op.token_ids)
            for op in stored if op.key == "full"] == [
        ("full", i, h[i], h[i - 1] if i else None, tuple(range(4 * i, 4 * i + 4)))
        for i in range(10)]
    evicting = 2 if layout == "shared" else 4  # the admission that takes cached blocks
    cached = {(op.key, op.block_id, op.block_hash) for d in deltas[:evicting]
              for op in d.operations() if type(op) is kf.Stored}
    evicted = [(op.key, op.block_id, op.block_hash) for op in deltas[evicting].operations()
               if type(op) is kf.Evicted]
    assert {key for key, _, _ in evicted} == {"full", "swa"}
    assert len(set(evicted)) == len(evicted) >= 16  # one row per block, none twice
    assert set(evicted) <= cached  # each block with the group and (untagged) digest it cached


def test_a_freed_run_holds_the_blocks_in_release_order() -> None:
    """The F run of a free lists the request's blocks as the queue took them back: logical
    order without caching, last block first with it (vLLM's)."""
    for caching, expected in ((False, (1, 2, 3, 4, 5, 6, 7, 8, 15, 16, 7, 8)),
                              (True, (16, 15, 8, 7, 6, 5, 4, 3, 2, 1, 4, 5))):
        freed = _program(caching)[3]
        assert freed.freed_block_ids == expected
        assert [op.block_id for op in freed.operations() if type(op) is kf.Freed] == list(expected)


@pytest.mark.parametrize("order", ["a first", "b first"])
def test_letting_go_of_a_block_detached_twice_in_one_call_frees_it_once(order: str) -> None:
    """Two requests sharing a cached prefix are detached, then all their blocks let go in
    one ``free_detached`` (vLLM's deferred frees of two requests at once): the shared block
    is named twice, loses both holders and is freed once, where its last holder goes; the
    counts, the free queue and a replay of the delta all agree."""
    policies = {"full": kf.FullAttention(num_blocks=8, block_size=4)}
    state = kf.KVState.create(policies, 64, enable_prefix_caching=True)
    h = kf.BlockHashes.of(list(range(8)), 4)
    state = kf.allocate_slots(state, "a", 0, 8, block_hashes=h).state
    hit = kf.lookup_prefix(state, h, max_tokens=7)
    state = kf.allocate_slots(state, "b", 4, 4, block_hashes=h, prefix_hit=hit).state
    first, second = ("a", "b") if order == "a first" else ("b", "a")
    one = kf.detach_request(state, first)
    two = kf.detach_request(one.state, second)
    ids = [*one.block_ids["full"], *two.block_ids["full"]]
    assert len(ids) == 4 and len(set(ids)) == 3  # the prefix block, named twice
    freed, delta = kf.free_detached(two.state, {"full": ids})
    kf.check_invariants(freed)
    assert kf.num_free_blocks(freed, "full") == 7
    last_mention = {b: i for i, b in enumerate(ids)}
    assert delta.freed_block_ids == tuple(sorted(last_mention, key=last_mention.__getitem__))
    again = kf.replay(two.state, [delta])
    assert again == freed
    assert again.pool_of("full").free_block_ids() == freed.pool_of("full").free_block_ids()
