"""The host pool and the block mover: layouts, every copy plan, handles, and bad inputs."""

from __future__ import annotations

import ctypes
import gc
import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvfunc.core import BlockIndexError, InvalidArgumentError, InvalidTypeError
from kvfunc.shell import BlockMover, DeviceError, HostBlockPool, MoveHandle, _tiers
from kvfunc.shell._move_plan import Segment, plan_move, row_runs
from kvfunc.shell._tensors import block_pages
from kvfunc.shell._tiers import (
    LARGE_ROW_BYTES,
    ROW_COPY_MIN_BYTES,
    ROWS_PER_INDEXED_COPY,
    STRIDED_ROW_BYTES,
    copy_rows_cuda,
)


def cache(num_blocks: int, shapes: list[tuple[int, ...]], seed: int = 0,
          dtypes: tuple[torch.dtype, ...] = (torch.float16,)) -> dict[str, torch.Tensor]:
    """Device tensors ``{"t<i>": [num_blocks, *shape]}`` of seeded random bytes, dtypes in turn."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for i, shape in enumerate(shapes):
        dtype = dtypes[i % len(dtypes)]
        size = torch.empty((), dtype=dtype).element_size()
        raw = torch.randint(0, 256, (num_blocks, *shape[:-1], shape[-1] * size), generator=gen,
                            dtype=torch.uint8)
        out[f"t{i}"] = raw.view(dtype)
    return out


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's blocks as a contiguous uint8 copy, ``[num_blocks, block_bytes]``."""
    return t.contiguous().view(torch.uint8).reshape(t.shape[0], -1).clone()


def expected_after(dst: torch.Tensor, src: torch.Tensor, src_ids: list[int],
                   dst_ids: list[int]) -> torch.Tensor:
    """What ``dst`` holds (as bytes) after copying ``src[src_ids[i]] -> dst[dst_ids[i]]``."""
    want = as_bytes(dst)
    if src_ids:
        want[dst_ids] = as_bytes(src)[src_ids]
    return want


@st.composite
def moves(draw: st.DrawFn) -> tuple[int, int, list[int], list[int]]:
    """Source and destination block counts and a move's ids, often in runs, destinations
    distinct."""
    num_src = draw(st.integers(1, 24))
    num_dst = draw(st.integers(1, 24))
    n = draw(st.integers(0, min(num_src, num_dst)))
    pattern = draw(st.sampled_from(["runs", "src-runs", "dst-runs", "random"]))
    if pattern == "runs" or pattern == "dst-runs":
        d0 = draw(st.integers(0, num_dst - n))
        dst = list(range(d0, d0 + n))
    else:
        dst = draw(st.permutations(range(num_dst)))[:n]
    if pattern == "runs" or pattern == "src-runs":
        s0 = draw(st.integers(0, num_src - n))
        src = list(range(s0, s0 + n))
    else:
        src = draw(st.lists(st.integers(0, num_src - 1), min_size=n, max_size=n))
    return num_src, num_dst, src, dst


@given(moves(), st.sampled_from(["layer", "block"]), st.sampled_from(["store", "load"]),
       st.sampled_from([[(4, 2)], [(2, 8), (3,)], [(1024, 8)]]))
def test_moves_equal_an_indexed_copy(move: tuple[int, int, list[int], list[int]], layout: str,
                                     direction: str, shapes: list[tuple[int, ...]]) -> None:
    """Every plan (runs, gather, scatter, rows, staged) writes dst[d[i]] = src[s[i]] and no more."""
    num_src, num_dst, src_ids, dst_ids = move
    num_dev, num_host = (num_src, num_dst) if direction == "store" else (num_dst, num_src)
    dev = cache(num_dev, shapes, seed=1, dtypes=(torch.float16, torch.float32))
    host = HostBlockPool.like(dev, num_host, layout=layout)
    for t in host.tensors:
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape,
                                                dtype=torch.uint8))
    assert_moves_as_indexed(dev, host, direction, src_ids, dst_ids, pages=False)


def assert_moves_as_indexed(dev: dict[str, torch.Tensor], host: HostBlockPool, direction: str,
                            src_ids: list[int], dst_ids: list[int], *, pages: bool) -> None:
    """One move (whole pages or not, as ``pages`` says) writes what an indexed copy of each
    tensor would, leaves its sources alone, and finishes every layer."""
    pairs = list(zip(dev.values(), host.tensors, strict=True))
    if direction == "load":
        pairs = [(h, d) for d, h in pairs]
    want = [expected_after(d, s, src_ids, dst_ids) for s, d in pairs]
    before_src = [as_bytes(s) for s, _ in pairs]
    mover = BlockMover.create(dev, host)
    try:
        assert pages == mover._paged
        handle = mover.move(direction, src_ids, dst_ids)
        assert handle.wait(30) and all(layer.done() for layer in handle.layers)
    finally:
        mover.close()
    assert all(torch.equal(w, as_bytes(d)) for w, (_, d) in zip(want, pairs, strict=True))
    assert all(torch.equal(b, as_bytes(s)) for b, (s, _) in zip(before_src, pairs, strict=True))


def block_major(num_blocks: int, shapes: list[tuple[int, ...]], seed: int = 0,
                dtypes: tuple[torch.dtype, ...] = (torch.float16,)) -> dict[str, torch.Tensor]:
    """:func:`cache`'s tensors, laid out block-major in one buffer (as ``layout="block"``)."""
    src = cache(num_blocks, shapes, seed, dtypes)
    parts = [(name, t.dtype, tuple(t.shape[1:])) for name, t in src.items()]
    _, _, views = block_pages(parts, num_blocks, lambda n: torch.zeros(n, dtype=torch.uint8))
    for v, t in zip(views, src.values(), strict=True):
        v.copy_(t)
    return dict(zip(src, views, strict=True))


@given(moves(), st.sampled_from(["store", "load"]),
       st.sampled_from([[(4, 2), (4, 2)], [(2, 8), (3,), (5,)], [(1024, 8), (512, 8)],
                        [(4096, 4), (4096, 4)]]))
def test_moves_of_whole_pages_equal_an_indexed_copy(
        move: tuple[int, int, list[int], list[int]], direction: str,
        shapes: list[tuple[int, ...]]) -> None:
    """A block-major cache and a pool of the block layout move whole pages: every plan, small
    and large pages, writes dst[d[i]] = src[s[i]] of every tensor and no more."""
    num_src, num_dst, src_ids, dst_ids = move
    num_dev, num_host = (num_src, num_dst) if direction == "store" else (num_dst, num_src)
    dev = block_major(num_dev, shapes, seed=2, dtypes=(torch.float16, torch.float32))
    host = HostBlockPool.like(dev, num_host, layout="block")
    host.buffers[0].copy_(torch.randint(0, 256, host.buffers[0].shape, dtype=torch.uint8))
    assert_moves_as_indexed(dev, host, direction, src_ids, dst_ids, pages=True)


def test_pages_are_copied_only_where_both_sides_lay_the_same_parts_side_by_side(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One copy a move for a block-major cache and a block pool; a copy per tensor for a pool
    of the layer layout, tensors in another order, a gap between them, or separate tensors; a
    tensor in the gap is never written."""
    calls: list[int] = []
    real = _tiers.copy_rows_cpu
    monkeypatch.setattr(_tiers, "copy_rows_cpu", lambda *a: calls.append(1) or real(*a))
    dev = block_major(6, [(8,), (4,), (8,)], seed=4)
    gap = {"t0": dev["t0"], "t2": dev["t2"]}
    reordered = {"t1": dev["t1"], "t0": dev["t0"]}
    copied = {k: t.clone() for k, t in dev.items()}
    shorter = {"t0": dev["t0"], "t1": dev["t1"][:5], "t2": dev["t2"]}
    cases = [(dev, "block", 1), (dev, "layer", 3), (reordered, "block", 2), (gap, "block", 2),
             (copied, "block", 3), (shorter, "block", 3)]
    for tensors, layout, copies in cases:
        host = HostBlockPool.like(tensors, 4, layout=layout)
        mover = BlockMover.create(tensors, host)
        try:
            calls.clear()
            assert mover.store([4, 1, 3], [0, 3, 2]).wait(30)
            assert copies == len(calls)
            assert all(torch.equal(as_bytes(h)[[0, 3, 2]], as_bytes(t)[[4, 1, 3]])
                       for t, h in zip(tensors.values(), host.tensors, strict=True))
            middle = as_bytes(dev["t1"])
            for t in host.tensors:
                t.view(torch.uint8).fill_(9)
            assert mover.load([0, 3], [2, 4]).wait(30)
            assert torch.equal(middle, as_bytes(dev["t1"])) or "t1" in tensors
            assert all(bool((t[[2, 4]].view(torch.uint8) == 9).all()) for t in tensors.values())
        finally:
            mover.close()


def test_named_layers_copy_a_page_of_each_layer_in_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``layers`` named, a move goes layer by layer: one page of a layer's tensors where
    they lie side by side on both sides, else a copy per tensor; without, one whole page."""
    copied: list[int] = []
    real = _tiers.copy_rows_cpu
    monkeypatch.setattr(_tiers, "copy_rows_cpu",
                        lambda plan, src, dst: copied.append(src.row_bytes) or real(plan, src, dst))
    dev = block_major(6, [(8,), (8,), (4,), (4,)], seed=6)  # fp16 blocks of 16, 16, 8, 8 bytes
    host = HostBlockPool.like(dev, 4, layout="block")
    cases = [([["t0", "t1"], ["t2", "t3"]], [32, 16]),
             ([["t0"], ["t1"], ["t2"], ["t3"]], [16, 16, 8, 8]),
             ([["t0", "t2"], ["t1", "t3"]], [16, 8, 16, 8]),
             ([["t0", "t1", "t2", "t3"]], [48]),
             (None, [48])]
    for layers, rows in cases:
        mover = BlockMover.create(dev, host, layers=layers)
        try:
            for direction, src, dst in (("store", [4, 1, 3], [0, 3, 2]),
                                        ("load", [0, 2], [5, 1])):
                pairs = list(zip(dev.values(), host.tensors, strict=True))
                if direction == "load":
                    pairs = [(h, d) for d, h in pairs]
                want = [expected_after(d, s, src, dst) for s, d in pairs]
                copied.clear()
                handle = mover.move(direction, src, dst)
                assert handle.wait(30) and len(handle.layers) == len(layers or dev)
                assert rows == copied
                assert all(torch.equal(w, as_bytes(d)) for w, (_, d) in
                           zip(want, pairs, strict=True))
        finally:
            mover.close()


def test_tensors_whose_blocks_overlap_the_next_block_are_copied_tensor_by_tensor() -> None:
    """Parts side by side that reach past the next block's start are no pages: a load writes
    each tensor in turn, as an indexed copy of each would."""
    buf = torch.zeros(6 * 16, dtype=torch.uint8)
    t0 = torch.empty(0, dtype=torch.uint8).set_(buf.untyped_storage(), 0, (5, 8), (16, 1))
    t1 = torch.empty(0, dtype=torch.uint8).set_(buf.untyped_storage(), 8, (5, 16), (16, 1))
    host = HostBlockPool.like([t0, t1], 2, layout="block")
    host.tensors[0].copy_(torch.tensor([[1] * 8, [2] * 8], dtype=torch.uint8))
    host.tensors[1].copy_(torch.tensor([[3] * 16, [4] * 16], dtype=torch.uint8))
    want = buf.clone()
    for i, t in enumerate((t0, t1)):
        view = torch.empty(0, dtype=torch.uint8).set_(want.untyped_storage(), t.storage_offset(),
                                                      t.shape, t.stride())
        view[[0, 1]] = host.tensors[i][[0, 1]]
    mover = BlockMover.create([t0, t1], host)
    try:
        assert mover.load([0, 1], [0, 1]).wait(30)
    finally:
        mover.close()
    assert torch.equal(want, buf)


def test_a_storage_that_shares_its_data_pointer_with_a_larger_one_is_no_page() -> None:
    """Two storages over the same memory, the first smaller: no page is built past its end
    (that raised an untyped RuntimeError), and the move is an indexed copy of each tensor."""
    base = torch.arange(4096, dtype=torch.int32).view(torch.uint8)[:4096]
    small = torch.frombuffer(memoryview(base.numpy())[:100], dtype=torch.uint8)
    dev = {"a": small[0:40].view(1, 40), "b": base[40:140].view(1, 100)}
    host = HostBlockPool.like(dev, 2, layout="block")
    host.buffers[0].zero_()
    assert_moves_as_indexed(dev, host, "store", [0], [1], pages=False)


def test_layers_follow_the_pools_order_whatever_the_order_of_the_device_mapping(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``layers`` names the pool's tensors: layer 0 copies "k" even when the device mapping
    lists "v" first."""
    copied: list[int] = []
    real = _tiers.copy_rows_cpu
    monkeypatch.setattr(_tiers, "copy_rows_cpu",
                        lambda plan, src, dst: copied.append(src.tensor.data_ptr())
                        or real(plan, src, dst))
    k, v = torch.zeros(4, 8), torch.ones(4, 8)
    host = HostBlockPool.like({"k": k, "v": v}, 4)
    mover = BlockMover.create({"v": v, "k": k}, host, layers=[["k"], ["v"]])
    try:
        assert mover.store([1, 2], [0, 3]).wait(30)
    finally:
        mover.close()
    assert [k.data_ptr(), v.data_ptr()] == copied
    assert torch.equal(host.tensors[0][[0, 3]], k[[1, 2]])
    assert torch.equal(host.tensors[1][[0, 3]], v[[1, 2]])


def test_short_indexed_copies_and_large_rows_go_row_by_row(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks scattered on both sides, a gather or scatter whose copies average fewer than
    ROWS_PER_INDEXED_COPY rows, a gather of rows of LARGE_ROW_BYTES, or a gather of rows of
    STRIDED_ROW_BYTES into rows that are not side by side, copy row by row (rows of
    ROW_COPY_MIN_BYTES and more); a long gather of smaller rows, or a long scatter of large
    ones, is one indexed copy."""
    rows: list[int] = []
    real = _tiers._copy_each_row
    monkeypatch.setattr(_tiers, "_copy_each_row", lambda *a: rows.append(1) or real(*a))
    n = ROWS_PER_INDEXED_COPY
    long_src, short_src = list(range(2 * n, 0, -2)), [9, 2, 7, 4]
    long_dst, short_dst = list(range(n)), [0, 1, 5, 6]
    cases = [(ROW_COPY_MIN_BYTES, long_src, long_dst, "gather", 0),
             (ROW_COPY_MIN_BYTES, short_src, short_dst, "gather", 1),
             (LARGE_ROW_BYTES, long_src, long_dst, "gather", 1),
             (ROW_COPY_MIN_BYTES // 2, short_src, short_dst, "gather", 0),
             (LARGE_ROW_BYTES, long_dst, long_src, "scatter", 0),
             (ROW_COPY_MIN_BYTES, short_dst, short_src, "scatter", 1),
             (ROW_COPY_MIN_BYTES, short_src, [3, 0, 8, 5], "scattered", 1),
             (ROW_COPY_MIN_BYTES // 2, short_src, [3, 0, 8, 5], "scattered", 0),
             (STRIDED_ROW_BYTES, long_src, long_dst, "gather", 0),  # into rows side by side
             (STRIDED_ROW_BYTES, long_src, long_dst, "gather-strided", 1),
             (STRIDED_ROW_BYTES // 2, long_src, long_dst, "gather-strided", 0)]
    for row_bytes, src, dst, kind, by_row in cases:
        strided = kind == "gather-strided"  # two tensors in a block-layout pool: a row stride
        kind = kind.removesuffix("-strided")  # of two rows
        assert kind == plan_move(np.array(src), np.array(dst)).kind
        dev = cache(2 * n + 1, [(row_bytes // 2,)] * (1 + strided), seed=5)
        host = HostBlockPool.like(dev, 2 * n + 1, layout="block" if strided else "layer")
        mover = BlockMover.create(dev, host)
        try:
            rows.clear()
            assert mover.store(src, dst).wait(30)
            assert (by_row * len(dev), True) == (len(rows), torch.equal(
                as_bytes(host.tensors[0])[dst], as_bytes(dev["t0"])[src]))
        finally:
            mover.close()


def test_each_plan_kind_is_taken_and_correct() -> None:
    """runs, gather, scatter, per-row and staged copies are each chosen where they fit."""
    cases = {"runs": ([4, 5, 6, 7], [0, 1, 2, 3]), "gather": ([9, 2, 7, 4], [0, 1, 2, 3]),
             "scatter": ([4, 5, 6, 7], [3, 0, 9, 6]), "scattered": ([9, 2, 7, 4], [3, 0, 8, 5])}
    for row_shape in [(ROW_COPY_MIN_BYTES // 2,), (4,)]:  # per-row copies, then staged
        dev = cache(12, [row_shape, row_shape], seed=3)
        host = HostBlockPool.like(dev, 10, layout="block")
        mover = BlockMover.create(dev, host)
        try:
            for kind, (src, dst) in cases.items():
                assert kind == plan_move(np.array(src), np.array(dst)).kind
                want = [expected_after(h, d, src, dst) for d, h in
                        zip(dev.values(), host.tensors, strict=True)]
                assert mover.store(src, dst).wait(30)
                assert all(torch.equal(w, as_bytes(h)) for w, h in
                           zip(want, host.tensors, strict=True))
        finally:
            mover.close()


def test_a_move_that_is_one_run_is_one_copy_whatever_the_order_of_its_pairs() -> None:
    """One pair, or pairs that form one run on both sides in any order, plan one slice copy."""
    one = plan_move(np.array([7]), np.array([2]))
    assert ("runs", (Segment(7, 2, 1),)) == (one.kind, one.segments)
    run = plan_move(np.array([9, 7, 8]), np.array([4, 2, 3]))
    assert ("runs", (Segment(7, 2, 3),)) == (run.kind, run.segments)
    two = plan_move(np.array([9, 7]), np.array([2, 4]))  # neither side steps by one
    assert 1 < two.num_copies
    back = plan_move(np.array([8, 7]), np.array([2, 3]))  # one run on each side, not together
    assert ("gather", 1) == (back.kind, back.num_copies)


def test_a_layer_is_done_once_the_worker_reports_it_and_a_failure_frees_every_waiter() -> None:
    """A CPU move's layers finish in order: ``finish_layer`` marks the next one done and
    wakes its waiters; ``fail`` marks them all, and each waiter gets the error."""
    h = MoveHandle(3)
    assert not h.layers[0].wait(0.01) and not h.done()
    h.finish_layer()
    assert h.layers[0].wait(0.01) and h.layers[0].done() and not h.layers[1].done()
    seen: list[object] = []

    def waiter(layer: int) -> None:
        try:
            seen.append(h.layers[layer].wait(30))
        except DeviceError as exc:
            seen.append(exc)

    def blocked(n: int) -> None:  # until ``n`` waiters sleep on the move (CPython's list)
        for _ in range(500):
            if len(h._cond._waiters) == n:  # type: ignore[attr-defined]
                return
            time.sleep(0.01)
        raise AssertionError(f"{n} waiters never blocked")

    threads = [threading.Thread(target=waiter, args=(i,), daemon=True) for i in (1, 1, 2, 2)]
    for t in threads:
        t.start()
    blocked(4)
    h.finish_layer()  # layer 1: both its waiters wake at once with True, layer 2's still wait
    for t in threads[:2]:
        t.join(5)
    assert [True, True] == seen and not any(t.is_alive() for t in threads[:2])
    assert all(t.is_alive() for t in threads[2:])
    blocked(2)
    h.fail(RuntimeError("the copy broke"))  # wakes both of layer 2's waiters, with the error
    for t in threads[2:]:
        t.join(5)
    assert not any(t.is_alive() for t in threads[2:])
    assert all(isinstance(e, DeviceError) for e in seen[2:]) and 4 == len(seen)
    with pytest.raises(DeviceError, match="the copy broke"):
        h.wait(0.01)


def test_polling_done_lets_the_worker_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU layer that is not done gives up the GIL before it says so (a polling loop would
    starve the worker for whole switch intervals): a busy poll sees the move land."""
    import kvfunc.shell._move_handles as handles

    real_sleep, slept, me = time.sleep, [], threading.get_ident()

    def sleep(seconds: float) -> None:  # records this thread's sleeps only
        if threading.get_ident() == me:
            slept.append(seconds)
        real_sleep(seconds)

    monkeypatch.setattr(handles.time, "sleep", sleep)
    worker = handles.MoveWorker()
    try:
        h = MoveHandle(1, worker=worker)
        assert not h.done() and [0] == slept
        h.finish_layer()
        assert h.done() and [0] == slept  # a layer that is done answers at once
    finally:
        worker.stop()
    dev = cache(256, [(4096,)] * 8, seed=11)  # 16 MiB: the move outlasts the first poll
    host = HostBlockPool.like(dev, 256)
    mover = BlockMover.create(dev, host)
    try:
        slept.clear()
        handle, polls = mover.store(list(range(256)), list(range(256))), 0
        while not handle.done() and polls < 10_000_000:
            polls += 1
        assert handle.done() and 0 < polls
        assert [0] * polls == slept  # each "not yet" gave the worker a turn
        assert all(torch.equal(as_bytes(d), as_bytes(h)) for d, h in
                   zip(dev.values(), host.tensors, strict=True))
    finally:
        mover.close()


def test_a_waiter_that_runs_queued_moves_keeps_its_timeout() -> None:
    """A caller whose wait runs queued jobs itself stops when its time is up (it runs at
    most the job it started), and says False."""
    import kvfunc.shell._move_handles as handles

    worker = handles.MoveWorker()
    worker.stop()  # no thread: only waiting callers run the jobs
    h = MoveHandle(1, worker=worker)
    for _ in range(10):
        worker.submit(lambda: time.sleep(0.05))
    worker.submit(h.finish_layer)
    t0 = time.monotonic()
    assert not h.wait(0.01)
    assert time.monotonic() - t0 < 0.45  # one job of 50 ms at most, not all ten (0.5 s)
    assert h.wait(30)  # the rest, then the move's own job


def test_an_interrupt_in_a_waiter_running_a_move_frees_every_other_waiter() -> None:
    """A move's job that a waiting caller runs and that is interrupted (a BaseException)
    fails the move before the interrupt goes on: its handle reports a DeviceError at once."""

    class Interrupting:
        def __setitem__(self, key: object, value: object) -> None:
            raise KeyboardInterrupt

    dev = cache(4, [(8,)], seed=12)
    host = HostBlockPool.like(dev, 4)
    mover = BlockMover.create(dev, host)
    try:
        mover.store([0], [0]).wait(30)  # the worker exists; now stop its thread
        assert mover._worker is not None
        mover._worker.stop()
        mover._host[0].np = Interrupting()  # type: ignore[assignment]
        handle = mover.store([1], [1])
        with pytest.raises(KeyboardInterrupt):
            handle.wait(30)
        with pytest.raises(DeviceError):
            handle.wait(0.01)
    finally:
        mover.close()


def test_device_copies_are_one_per_contiguous_range() -> None:
    """A device copy takes runs of both-consecutive ids, single rows where a side is strided."""
    src, dst = np.array([7, 3, 4, 5, 8]), np.array([9, 0, 1, 2, 10])
    assert [(3, 0, 3), (7, 9, 2)] == row_runs(src, dst, False)
    assert [(7, 9, 1), (3, 0, 1), (4, 1, 1), (5, 2, 1), (8, 10, 1)] == row_runs(src, dst, True)


@given(moves(), st.sampled_from(["layer", "block"]))
def test_the_device_path_copies_equal_an_indexed_copy(move: tuple[int, int, list[int], list[int]],
                                                      layout: str) -> None:
    """The CUDA path's copies (one per contiguous range), run here on CPU tensors, store
    exactly ``host[d[i]] = dev[s[i]]`` in both layouts."""
    num_src, num_dst, src_ids, dst_ids = move
    dev = cache(num_src, [(4, 2), (3,)], seed=12)
    host = HostBlockPool.like(dev, num_dst, layout=layout)
    for t in host.tensors:
        t.zero_()
    mover = BlockMover.create(dev, host)
    want = [expected_after(h, d, src_ids, dst_ids)
            for d, h in zip(dev.values(), host.tensors, strict=True)]
    plan = plan_move(np.array(src_ids, dtype=np.int64), np.array(dst_ids, dtype=np.int64))
    for d, h in zip(mover._device, mover._host, strict=True):
        copy_rows_cuda(plan, d, h)
    mover.close()
    assert all(torch.equal(w, as_bytes(h)) for w, h in zip(want, host.tensors, strict=True))


def test_layers_finish_in_order_and_wait_returns_when_all_are_done() -> None:
    """Each layer's handle is done once its tensors are; layers group tensors by name."""
    dev = cache(6, [(8,), (8,), (8,)], seed=4)
    host = HostBlockPool.like(dev, 6)
    mover = BlockMover.create(dev, host, layers=[["t2"], ["t0", "t1"]])
    try:
        handle = mover.store([1, 2], [3, 4])
        assert 2 == len(handle.layers)
        assert handle.layers[0].wait(30) and handle.wait(30)
        assert handle.done() and all(layer.done() for layer in handle.layers)
        assert all(torch.equal(as_bytes(d)[[1, 2]], as_bytes(h)[[3, 4]]) for d, h in
                   zip(dev.values(), host.tensors, strict=True))
    finally:
        mover.close()


def test_moves_run_in_the_order_they_were_made() -> None:
    """A load queued after a store of the same host block reads what the store wrote."""
    dev = cache(4, [(1024,)], seed=5)
    host = HostBlockPool.like(dev, 2)
    mover = BlockMover.create(dev, host)
    try:
        first = as_bytes(dev["t0"])[0]
        handles = [mover.store([0], [1]), mover.load([1], [3])]
        assert handles[1].wait(30) and handles[0].done()
        assert torch.equal(first, as_bytes(dev["t0"])[3])
    finally:
        mover.close()


def test_bad_moves_raise_typed_errors_and_move_nothing() -> None:
    """Unknown direction, unequal lengths, repeated destinations, out-of-range or non-integer
    ids raise before anything is queued; a closed mover refuses moves."""
    dev = cache(4, [(8,)], seed=6)
    host = HostBlockPool.like(dev, 3)
    host.tensors[0].zero_()
    mover = BlockMover.create(dev, host)
    bad: list[tuple[type[Exception], str, list[object], list[object]]] = [
        (InvalidArgumentError, "swap", [0], [0]),
        (InvalidArgumentError, "store", [0, 1], [0]),
        (InvalidArgumentError, "store", [0, 1], [2, 2]),
        (BlockIndexError, "store", [4], [0]),
        (BlockIndexError, "store", [0], [3]),
        (BlockIndexError, "load", [-1], [0]),
        (InvalidTypeError, "load", [0.5], [0]),
    ]
    for error, direction, src, dst in bad:
        with pytest.raises(error):
            mover.move(direction, src, dst)  # type: ignore[arg-type]
    mover.close()
    with pytest.raises(InvalidArgumentError, match="closed"):
        mover.store([0], [0])
    assert 0 == int(host.tensors[0].count_nonzero())


def test_a_failed_move_raises_from_wait() -> None:
    """A copy that fails on the worker reports a DeviceError to every waiter."""
    dev = cache(4, [(8,)], seed=8)
    host = HostBlockPool.like(dev, 4)
    mover = BlockMover.create(dev, host)
    try:
        mover._host[0].np = None  # a broken host side: the copy itself fails
        handle = mover.store([0], [0])
        with pytest.raises(DeviceError, match="moving blocks failed"):
            handle.wait(30)
        with pytest.raises(DeviceError):
            handle.layers[0].done()
    finally:
        mover.close()


def test_mover_refuses_tensors_that_do_not_match_the_pool() -> None:
    """Other keys, dtypes or block shapes than the pool's, or bad layers, are refused."""
    dev = cache(4, [(8,), (8,)], seed=9)
    host = HostBlockPool.like(dev, 2)
    with pytest.raises(InvalidArgumentError):
        BlockMover.create({"t0": dev["t0"], "x": dev["t1"]}, host)
    with pytest.raises(InvalidTypeError):
        BlockMover.create({"t0": dev["t0"], "t1": dev["t1"].view(torch.int16)}, host)
    with pytest.raises(InvalidArgumentError):
        BlockMover.create({"t0": dev["t0"], "t1": torch.zeros(4, 9, dtype=torch.float16)}, host)
    with pytest.raises(InvalidArgumentError, match="exactly once"):
        BlockMover.create(dev, host, layers=[["t0"], ["t0"]])
    with pytest.raises(InvalidArgumentError, match="not one of"):
        BlockMover.create(dev, host, layers=[["t0", "t9"]])
    with pytest.raises(InvalidTypeError):
        BlockMover.create(dev, "host")  # type: ignore[arg-type]


@pytest.mark.parametrize("layout", ["layer", "block"])
def test_host_pool_mirrors_the_device_blocks(layout: str) -> None:
    """One host tensor per cache tensor, same dtype and block shape, regions cover a block."""
    dev = {"k": torch.zeros(5, 4, 2, dtype=torch.bfloat16),
           "v": torch.zeros(5, 3, dtype=torch.int8)}
    host = HostBlockPool.like(dev, 7, layout=layout)
    assert [(torch.bfloat16, (7, 4, 2)), (torch.int8, (7, 3))] == [
        (t.dtype, tuple(t.shape)) for t in host.tensors]
    assert ((16, 3), (0, 16), 19, False) == (host.part_bytes, host.part_offsets,
                                              host.block_bytes, host.pinned)
    regions = host.regions(6)
    assert host.block_bytes == sum(n for _, n in regions)
    for t, off in zip(host.tensors, host.part_offsets, strict=True):
        t[6].view(torch.uint8).fill_(off + 1)
    got = b"".join(ctypes.string_at(addr, n) for addr, n in regions)
    assert bytes([1] * 16 + [17] * 3) == got
    assert ["k", "v"] == list(host.tensor_set())
    with pytest.raises(BlockIndexError):
        host.regions(7)


def test_host_pool_refuses_what_it_cannot_mirror() -> None:
    """Empty sets, several devices, non-contiguous blocks, bad counts, layouts, alignment."""
    with pytest.raises(InvalidArgumentError):
        HostBlockPool.like({}, 2)
    with pytest.raises(InvalidTypeError):
        HostBlockPool.like(torch.zeros(2, 2), 2)
    with pytest.raises(InvalidArgumentError, match="not contiguous"):
        HostBlockPool.like([torch.zeros(4, 3, 2)[:, :, :1]], 2)
    with pytest.raises(InvalidArgumentError, match="empty"):
        HostBlockPool.like([torch.zeros(4, 0)], 2)
    with pytest.raises(InvalidTypeError):
        HostBlockPool.like([torch.zeros(4, 2)], 2.0)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        HostBlockPool.like([torch.zeros(4, 2)], -1)
    with pytest.raises(InvalidArgumentError, match="unknown layout"):
        HostBlockPool.like([torch.zeros(4, 2)], 2, layout="page")
    with pytest.raises(InvalidArgumentError, match="element size"):
        HostBlockPool.like([torch.zeros(4, 3, dtype=torch.int8), torch.zeros(4, 1)], 2,
                           layout="block")


def test_fingerprints_name_the_block_format() -> None:
    """Equal dtypes and block shapes in order give equal fingerprints, whatever the names,
    block counts or layout; any difference gives another."""
    a = HostBlockPool.like({"k": torch.zeros(3, 4), "v": torch.zeros(3, 2)}, 2)
    same = HostBlockPool.like([torch.zeros(9, 4), torch.zeros(9, 2)], 5, layout="block")
    other = [HostBlockPool.like([torch.zeros(3, 2), torch.zeros(3, 4)], 2),
             HostBlockPool.like([torch.zeros(3, 4), torch.zeros(3, 2, dtype=torch.int32)], 2),
             HostBlockPool.like([torch.zeros(3, 4)], 2)]
    assert a.fingerprint == same.fingerprint
    assert a.fingerprint not in {p.fingerprint for p in other}


def test_a_mover_dropped_without_close_ends_its_thread() -> None:
    """Garbage-collecting a mover stops its worker thread once the queued moves are done."""
    dev = cache(4, [(8,)], seed=10)
    mover = BlockMover.create(dev, HostBlockPool.like(dev, 2))
    handle = mover.store([0], [1])
    assert mover._worker is not None
    thread = mover._worker._thread
    del mover
    gc.collect()
    thread.join(30)
    assert not thread.is_alive() and handle.done()


def test_mover_refuses_device_blocks_it_cannot_copy_as_bytes() -> None:
    """Device tensors whose blocks are strided inside or overlap are refused, not misread."""
    dev = cache(4, [(8,)], seed=11)
    host = HostBlockPool.like(dev, 2)
    strided = torch.zeros(4, 16, dtype=torch.float16)[:, ::2]
    overlapping = torch.zeros(1, 8, dtype=torch.float16).expand(4, 8)
    for bad in (strided, overlapping):
        with pytest.raises(InvalidArgumentError, match="contiguous and apart"):
            BlockMover.create({"t0": bad}, host)
