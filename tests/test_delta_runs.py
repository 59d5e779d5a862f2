"""A transition's delta keeps runs of rows (new blocks, freed blocks, slid-out positions)
unspelled until read; every way of reading it gives the rows a keyword-built delta has."""

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
    res = kf.allocate_batch(res.state, [("a", 30, 9)])  # 36 tokens: 28 of them slid out
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


@pytest.mark.parametrize("caching", [False, True])
def test_runs_read_as_their_rows(caching: bool) -> None:
    """Operations read first, columns read first, equality, hash, repr and pickle all agree
    with the keyword-built delta, and the runs hold the blocks the state moved."""
    first_ops = [list(d.operations()) for d in _program(caching)]
    for d, ops in zip(_program(caching), first_ops, strict=True):
        built = _keyword_built(d)  # columns read first on this copy
        assert ops == list(built.operations()) == list(d.operations())
        assert (d, hash(d), repr(d)) == (built, hash(built), repr(built))
        assert pickle.loads(pickle.dumps(d)) == built
    orders = [d.order for d in _program(caching)]
    assert orders == (ORDERS_CACHING if caching else ORDERS)


#: The program's orders: runs of A, N, F and X rows, each one code per row.
ORDERS = ["RR" + "A" * 16 + "RR" + "A" * 12, "AAAA", "NNNFFF", "L" + "F" * 10 + "LFF", "DD",
          "X" * 6 + "F" * 6 + "XXXFFF"]
ORDERS_CACHING = ["RR" + "A" * 16 + "RR" + "A" * 12, "NNNNNFFFFFAAAA", "NNNFFF",
                  "L" + "F" * 10 + "LFF", "DD", "X" * 6 + "F" * 6 + "X" * 6 + "F" * 6]


def test_a_freed_run_holds_the_blocks_in_release_order() -> None:
    """The F run of a free lists the request's blocks as the queue took them back: logical
    order without caching, last block first with it (vLLM's)."""
    for caching, expected in ((False, (1, 2, 3, 4, 5, 6, 7, 8, 15, 16, 7, 8)),
                              (True, (16, 15, 8, 7, 6, 5, 4, 3, 2, 1, 4, 5))):
        freed = _program(caching)[3]
        assert freed.freed_block_ids == expected
        assert [op.block_id for op in freed.operations() if type(op) is kf.Freed] == list(expected)
