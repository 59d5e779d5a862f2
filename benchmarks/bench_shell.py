"""Benchmark of the torch shell: incremental block tables, block copies and swaps.

Theory of operation
-------------------
**Tables.**  ``R`` requests run with prompts drawn from a seeded stdlib
``random`` generator (block size 16, tables up to ``W`` blocks wide); every
decode step gives each request one token, so about ``R / 16`` requests cross
a block boundary and take a new block.  All states, deltas and inputs are
computed before timing.  Two paths turn a step into block tables and slot
mappings on the CPU:

* (a) incremental: ``BlockTableBuffer.apply(delta)``, ``block_tables()`` and
  ``slot_mappings(...)``;
* (b) rebuild: ``kvfunc.compat.prepare_block_tables`` +
  ``prepare_slot_mapping`` on a ``KVCacheManager`` holding the step's state
  (restored untimed), as the seed does.

Each round replays every step through one path, then every step through the
other (the order alternates between rounds; the buffer starts fresh each
time), with the garbage collector off; the figure is the median time per
step over all rounds.  The outputs of both paths in the first round are
compared at every step.

**Blocks.**  A cache of ``L`` tensors totalling 256 MiB (fp16,
``[blocks, 16, 8, 128]``) and a host copy of the same shape.  One call
copies ``n`` blocks per tensor (sources and destinations disjoint); the raw
baseline is ``index_copy_(0, dst, index_select(0, src))`` per tensor with
prebuilt index tensors, in the same run: every round runs kvfunc's call and
the raw one back to back (ops and the order in each pair shuffled, seeded).
kvfunc's calls take Python lists of ids (what a delta holds) and check them
first.  Throughput is bytes copied / median time; the kvfunc/raw share is the
median over rounds of the paired ratio raw time / kvfunc time, which cancels
most of a shared machine's drift.

Run ``python benchmarks/bench_shell.py [--quick] [--json PATH]``; torch runs
on one thread (the figures are about overhead, not parallelism).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import sys
from collections.abc import Callable, Sequence
from time import perf_counter_ns
from types import SimpleNamespace
from typing import Any

import torch

import kvfunc as kf
from kvfunc.compat import (
    FullAttentionManager,
    KVCacheManager,
    prepare_block_tables,
    prepare_slot_mapping,
)
from kvfunc.shell import BlockTableBuffer, copy_blocks, swap_blocks, zero_blocks

BLOCK_SIZE = 16
SEED = 0
TARGET_TABLES = 0.1  # incremental <= 0.1x rebuild, same run
TARGET_BLOCKS = 0.8  # kvfunc throughput >= 80 % of raw, same run


class Settings:
    """Sizes of one run (full or ``--quick``)."""

    def __init__(self, quick: bool) -> None:
        self.quick = quick
        self.num_running = 16 if quick else 256
        self.width = 64 if quick else 512
        self.num_steps = 8 if quick else 64
        self.table_rounds = 2 if quick else 9
        self.cache_bytes = (16 if quick else 256) * 2**20
        self.num_tensors = 4 if quick else 16
        self.copied_fraction = 0.25
        self.block_rounds = 2 if quick else 31


def _median_us(samples: Sequence[int]) -> float:
    return statistics.median(samples) / 1000.0


def _verdict(ok: bool, quick: bool) -> str:
    if quick:
        return "not judged (--quick sizes are too small to mean anything)"
    return "PASS" if ok else "FAIL"


# ----------------------------------------------------------------------------
# tables

def table_trace(s: Settings) -> tuple[kf.KVState, list[tuple[kf.KVState, Any, torch.Tensor]]]:
    """The state after prefill and, per decode step, ``(state, delta, positions)``."""
    rng = random.Random(SEED)
    max_len = s.width * BLOCK_SIZE
    lengths = [rng.randrange(max_len // 8, max_len - s.num_steps - 1)
               for _ in range(s.num_running)]
    pool = s.num_running * s.width + 1
    state = kf.KVState.create({"full": kf.FullAttention(num_blocks=pool,
                                                        block_size=BLOCK_SIZE)}, max_len)
    state = kf.allocate_batch(state, [(i, 0, n) for i, n in enumerate(lengths)]).state
    start = state
    steps = []
    for _ in range(s.num_steps):
        result = kf.allocate_batch(state, [(i, n, 1) for i, n in enumerate(lengths)])
        assert result.refused == ()
        steps.append((result.state, result.delta, torch.tensor(lengths)))
        state = result.state
        lengths = [n + 1 for n in lengths]
    return start, steps


def bench_tables(s: Settings, out: dict[str, Any]) -> None:
    start, steps = table_trace(s)
    rids = list(range(s.num_running))
    requests = [SimpleNamespace(request_id=r) for r in rids]
    cu = torch.arange(1, s.num_running + 1)
    new_blocks = [len(d.appended_block_ids) for _, d, _ in steps]
    print(f"\n== block tables + slot mappings: {s.num_running} running requests, width "
          f"{s.width} blocks, block size {BLOCK_SIZE}, {len(steps)} decode steps "
          f"({statistics.mean(new_blocks):.1f} new blocks per step on average, "
          f"{min(new_blocks)}..{max(new_blocks)}); median per step over {s.table_rounds} "
          "rounds ==")
    times: dict[str, list[int]] = {"incremental": [], "rebuild": []}
    outputs: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def incremental(record: list[tuple[torch.Tensor, torch.Tensor]] | None) -> list[int]:
        buf = BlockTableBuffer.from_state(start, s.num_running, widths=s.width)
        spent = []
        for _, delta, positions in steps:
            t0 = perf_counter_ns()
            buf.apply(delta)
            tables = buf.block_tables()
            slots = buf.slot_mappings(rids, positions, cu)
            spent.append(perf_counter_ns() - t0)
            if record is not None:
                record.append((tables["full"].clone(), slots["full"]))
        return spent

    pool = start.groups[0].policy.num_blocks
    mgr = KVCacheManager(start.max_model_len, [FullAttentionManager(
        "FullAttention", pool, BLOCK_SIZE, manager_key="full")], None)

    def rebuild(record: list[tuple[torch.Tensor, torch.Tensor]] | None) -> list[int]:
        spent = []
        for state, _, positions in steps:
            mgr.restore(state)  # the manager as it stands after the step's allocation
            t0 = perf_counter_ns()
            tables = prepare_block_tables(requests, mgr, s.width, "cpu", s.num_running)
            slots = prepare_slot_mapping(positions, cu, mgr, tables)
            spent.append(perf_counter_ns() - t0)
            if record is not None:
                record.append((tables["full"], slots["full"]))
        return spent

    paths = {"incremental": incremental, "rebuild": rebuild}
    for rnd in range(s.table_rounds):
        order = list(paths) if rnd % 2 == 0 else list(reversed(paths))
        for name in order:
            record = outputs.setdefault(name, []) if rnd == 0 else None
            gc.collect()
            gc.disable()
            try:
                times[name] += paths[name](record)
            finally:
                gc.enable()
    checked = 0
    for (ta, sa), (tb, sb) in zip(outputs["incremental"], outputs["rebuild"], strict=True):
        assert torch.equal(ta, tb), "block tables differ between the two paths"
        assert torch.equal(sa, sb), "slot mappings differ between the two paths"
        checked += 1
    med = {k: _median_us(v) for k, v in times.items()}
    ratio = med["incremental"] / med["rebuild"]
    for name, label in (("incremental", "(a) BlockTableBuffer apply + slot_mappings"),
                        ("rebuild", "(b) prepare_block_tables + prepare_slot_mapping")):
        lo, hi = min(times[name]) / 1000, max(times[name]) / 1000
        print(f"{label:52s} {med[name]:9.1f} µs/step   min..max {lo:.1f}..{hi:.1f}")
    print(f"ratio (a)/(b) = {ratio:.3f}x   target <= {TARGET_TABLES}x: "
          f"{_verdict(ratio <= TARGET_TABLES, s.quick)}")
    print(f"cross-check [tables]: block tables and slot mappings identical at {checked} steps: OK")
    out["tables"] = {"us_per_step": med, "ratio": ratio, "target": ratio <= TARGET_TABLES,
                     "new_blocks_mean": statistics.mean(new_blocks), "checked_steps": checked}


# ----------------------------------------------------------------------------
# blocks

def _paired(ops: dict[str, tuple[Callable[[], None], Callable[[], None]]], rounds: int
            ) -> dict[str, tuple[list[int], list[int]]]:
    """Per op, ``(raw times, kvfunc times)``: each round runs each op's two paths back to
    back, ops and the order inside each pair shuffled per round (seeded)."""
    times: dict[str, tuple[list[int], list[int]]] = {op: ([], []) for op in ops}
    for raw, ours in ops.values():  # warm up once each
        raw()
        ours()
    names = list(ops)
    rng = random.Random(SEED)
    for _ in range(rounds):
        rng.shuffle(names)
        for op in names:
            sides = [0, 1]
            rng.shuffle(sides)
            for side in sides:
                t0 = perf_counter_ns()
                ops[op][side]()
                times[op][side].append(perf_counter_ns() - t0)
    return times


def bench_blocks(s: Settings, out: dict[str, Any]) -> None:
    block_shape = (BLOCK_SIZE, 8, 128)
    block_bytes = BLOCK_SIZE * 8 * 128 * 2
    num_blocks = s.cache_bytes // (s.num_tensors * block_bytes)
    cache = [torch.randn(num_blocks, *block_shape).half() for _ in range(s.num_tensors)]
    host = [torch.zeros_like(t) for t in cache]
    n = int(num_blocks * s.copied_fraction)
    rng = random.Random(SEED)
    picked = rng.sample(range(num_blocks), 2 * n)
    src, dst = picked[:n], picked[n:]
    src_t, dst_t = torch.tensor(src), torch.tensor(dst)
    moved = n * block_bytes * s.num_tensors
    print(f"\n== blocks: cache {s.cache_bytes / 2**20:.0f} MiB = {s.num_tensors} fp16 tensors "
          f"[{num_blocks}, {', '.join(map(str, block_shape))}], host copy of the same shape; "
          f"one call moves {n} blocks per tensor = {moved / 2**20:.0f} MiB; {s.block_rounds} "
          "rounds, paired ==")

    def raw_copy() -> None:
        for t in cache:
            t.index_copy_(0, dst_t, t.index_select(0, src_t))

    def raw_swap() -> None:
        for d, h in zip(cache, host, strict=True):
            h.index_copy_(0, dst_t, d.index_select(0, src_t).to(h.device))

    def raw_zero() -> None:
        for t in host:
            t.index_fill_(0, dst_t, 0)

    ops = {"copy": (raw_copy, lambda: copy_blocks(cache, src, dst)),
           "swap": (raw_swap, lambda: swap_blocks(cache, host, src, dst)),
           "zero": (raw_zero, lambda: zero_blocks(host, dst))}
    times = _paired(ops, s.block_rounds)
    result: dict[str, Any] = {}
    for op, (raw_t, ours_t) in times.items():
        raw, ours = _median_us(raw_t), _median_us(ours_t)
        share = statistics.median(r / o for r, o in zip(raw_t, ours_t, strict=True))
        gbps_raw, gbps = moved / raw / 1e3, moved / ours / 1e3
        target = "" if op == "zero" else (f"   target >= {TARGET_BLOCKS:.0%}: "
                                          f"{_verdict(share >= TARGET_BLOCKS, s.quick)}")
        print(f"{op:5s} raw {raw / 1e3:7.2f} ms ({gbps_raw:5.2f} GB/s)   kvfunc "
              f"{ours / 1e3:7.2f} ms ({gbps:5.2f} GB/s)   kvfunc/raw throughput "
              f"{share:6.1%}{target}")
        result[op] = {"ms_raw": raw / 1e3, "ms_kvfunc": ours / 1e3, "throughput_share": share,
                      "gb_per_s": gbps, "gb_per_s_raw": gbps_raw}
    # The copies above ran for real: check the last one against a reference copy.
    expect = [t.clone() for t in cache]
    for t in expect:
        t[dst_t] = t[src_t]
    copy_blocks(cache, src, dst)
    assert all(torch.equal(a, b) for a, b in zip(cache, expect, strict=True))
    print("cross-check [blocks]: copy_blocks equals an indexed assignment: OK")
    out["blocks"] = result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    parser.add_argument("--json", metavar="PATH", help="also write every figure as JSON")
    args = parser.parse_args(argv)
    s = Settings(args.quick)
    torch.set_num_threads(1)
    print(f"kvfunc bench_shell{' --quick' if s.quick else ''}: Python "
          f"{platform.python_version()}, torch {torch.__version__} (1 thread), "
          f"{os.cpu_count()} CPUs, {platform.machine()}")
    out: dict[str, Any] = {"quick": s.quick}
    bench_tables(s, out)
    bench_blocks(s, out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
