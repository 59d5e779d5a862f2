"""Benchmark of the host tier's block mover against one plain torch copy of the same bytes.

Theory of operation
-------------------
A device cache of ``L`` fp16 tensors (on this machine's CPU, allocated as the
shell allocates a CPU cache, ``create_cache_tensors``: aligned and advised for
transparent huge pages) and a host pool made like it (``HostBlockPool.like``,
advised the same way), in three pairs of layouts (cache/pool): ``layer/layer``
and ``layer/block`` (a tensor per cache entry, the pool either way), and
``block/block`` (a block-major cache, ``layout="block"``, and a pool of the
block layout: the mover copies whole pages).  One move copies ``N`` blocks of
every tensor, device to host (``store``) or host to device (``load``), through
``BlockMover`` (its worker thread included: the time runs from the call to the
end of ``wait()``).  Three patterns of block ids, drawn once from a seeded
stdlib generator:

* ``contiguous``: blocks ``0..N-1`` on both sides;
* ``scattered``: device blocks scattered over a cache of ``4N`` blocks, host
  blocks consecutive (a store into blocks just taken from the host pool, the
  load of a prefix stored together);
* ``scattered-both``: both sides scattered.

The baseline is one ``dst.copy_(src)`` of two flat byte tensors of the same
total size and the same kind of memory (``cpu_bytes``), in the same run: every
round runs each lane and the baseline back to back (lanes and the order in each
pair shuffled, seeded; the garbage collector off during a round).  The figure
is the median over rounds of the paired ratio baseline time / move time: the
mover's share of a plain copy's bandwidth (target >= 0.8).  Each lane's result
is checked against an indexed copy before timing.

Run ``python benchmarks/bench_tiers.py [--quick] [--json PATH]``; torch runs
on one thread on both sides of every ratio.
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
from typing import Any

import torch

from kvfunc.shell import BlockMover, HostBlockPool, empty_aligned
from kvfunc.shell._tensors import block_pages, cpu_bytes

SEED = 0
TARGET = 0.8
#: (cache layout, host pool layout) pairs: a cache per tensor with either pool, and a
#: block-major cache with a block-layout pool (the mover then copies whole pages)
LAYOUTS = (("layer", "layer"), ("layer", "block"), ("block", "block"))
PATTERNS = ("contiguous", "scattered", "scattered-both")
DIRECTIONS = ("store", "load")


class Settings:
    """Sizes of one run (full or ``--quick``): ``(block bytes per tensor, N)`` cases."""

    def __init__(self, quick: bool) -> None:
        self.quick = quick
        self.num_tensors = 4 if quick else 16
        self.cases = [(4096, 16), (16384, 8)] if quick else [
            (4096, 2048), (16384, 64), (16384, 512), (65536, 128)]
        self.rounds = 2 if quick else 9


def ids_for(pattern: str, n: int, rng: random.Random) -> tuple[list[int], list[int]]:
    """``(device ids, host ids)`` of a pattern: a device cache of ``4n``, a host pool of ``2n``."""
    if pattern == "contiguous":
        return list(range(n)), list(range(n))
    device = rng.sample(range(4 * n), n)
    host = list(range(n)) if pattern == "scattered" else rng.sample(range(2 * n), n)
    return device, host


def check(mover: BlockMover, device: dict[str, torch.Tensor], host: HostBlockPool,
          direction: str, dev_ids: list[int], host_ids: list[int]) -> None:
    """One move, compared with an indexed copy of every tensor."""
    if direction == "store":
        want = [h.clone() for h in host.tensors]
        for w, d in zip(want, device.values(), strict=True):
            w[host_ids] = d[dev_ids]
        assert mover.store(dev_ids, host_ids).wait()
        got = list(host.tensors)
    else:
        want = [d.clone() for d in device.values()]
        for w, h in zip(want, host.tensors, strict=True):
            w[dev_ids] = h[host_ids]
        assert mover.load(host_ids, dev_ids).wait()
        got = list(device.values())
    assert all(torch.equal(w.view(torch.int16), g.view(torch.int16))
               for w, g in zip(want, got, strict=True)), f"{direction} moved the wrong bytes"


def paired(lanes: dict[str, tuple[Callable[[], Any], Callable[[], Any]]], rounds: int
           ) -> dict[str, tuple[list[int], list[int]]]:
    """Per lane ``(baseline times, move times)``: each round runs every lane's pair back to
    back, lanes and the order inside each pair shuffled (seeded)."""
    times: dict[str, tuple[list[int], list[int]]] = {k: ([], []) for k in lanes}
    for base, ours in lanes.values():  # warm up once each
        base()
        ours()
    names = list(lanes)
    rng = random.Random(SEED)
    for _ in range(rounds):
        rng.shuffle(names)
        gc.collect()
        gc.disable()
        try:
            for name in names:
                sides = [0, 1]
                rng.shuffle(sides)
                for side in sides:
                    t0 = perf_counter_ns()
                    lanes[name][side]()
                    times[name][side].append(perf_counter_ns() - t0)
        finally:
            gc.enable()
    return times


def device_cache(s: Settings, row_bytes: int, n: int, layout: str) -> dict[str, torch.Tensor]:
    """``4n`` blocks of each tensor, allocated as the shell allocates a CPU cache of ``layout``
    (``create_cache_tensors``: one aligned tensor each, or one aligned block-major buffer)."""
    gen = torch.Generator().manual_seed(SEED)
    shape = (4 * n, row_bytes // 2)
    cpu = torch.device("cpu")
    if layout == "block":
        parts = [(f"t{i}", torch.int16, shape[1:]) for i in range(s.num_tensors)]
        tensors = list(block_pages(parts, shape[0],
                                   lambda k: empty_aligned((k,), torch.uint8, cpu))[2])
    else:
        tensors = [empty_aligned(shape, torch.int16, cpu) for _ in range(s.num_tensors)]
    for t in tensors:
        t.copy_(torch.randint(-2**15, 2**15, t.shape, generator=gen, dtype=torch.int16))
    return {f"t{i}": t.view(torch.float16) for i, t in enumerate(tensors)}


def bench_case(s: Settings, row_bytes: int, n: int, out: dict[str, Any]) -> None:
    total = n * row_bytes * s.num_tensors
    a, b = cpu_bytes(total), cpu_bytes(total)  # the same kind of memory as the caches
    a.fill_(1)
    rng = random.Random(SEED)
    lanes: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {}
    movers = []
    for cache_layout, layout in LAYOUTS:
        device = device_cache(s, row_bytes, n, cache_layout)
        host = HostBlockPool.like(device, 2 * n, layout=layout)
        host.buffers[0].zero_()
        for t in host.buffers[1:]:
            t.zero_()
        mover = BlockMover.create(device, host)
        movers.append(mover)
        for pattern in PATTERNS:
            dev_ids, host_ids = ids_for(pattern, n, rng)
            for direction in DIRECTIONS:
                check(mover, device, host, direction, dev_ids, host_ids)
                src, dst = (dev_ids, host_ids) if direction == "store" else (host_ids, dev_ids)
                lanes[f"{cache_layout}/{layout:5s} {pattern:14s} {direction}"] = (
                    lambda: b.copy_(a),
                    lambda m=mover, d=direction, x=src, y=dst: m.move(d, x, y).wait())
    print(f"\n== {s.num_tensors} tensors x {n} blocks of {row_bytes // 1024} KiB = "
          f"{total / 2**20:.0f} MiB per move; {s.rounds} rounds, paired with one copy_ of "
          "the same bytes ==")
    times = paired(lanes, s.rounds)
    for m in movers:
        m.close()
    result = {}
    for name, (base_t, ours_t) in times.items():
        share = statistics.median(bt / ot for bt, ot in zip(base_t, ours_t, strict=True))
        base, ours = statistics.median(base_t) / 1e6, statistics.median(ours_t) / 1e6
        verdict = "not judged (--quick)" if s.quick else ("PASS" if share >= TARGET else "FAIL")
        print(f"{name}  copy_ {base:7.2f} ms ({total / base / 1e6:5.2f} GB/s)  mover "
              f"{ours:7.2f} ms ({total / ours / 1e6:5.2f} GB/s)  share {share:5.2f}  "
              f"target >= {TARGET}: {verdict}")
        result[" ".join(name.split())] = {"ms_copy": base, "ms_mover": ours, "share": share}
    print(f"cross-check [{row_bytes // 1024} KiB x {n}]: every lane moved the right bytes: OK")
    out[f"{row_bytes}x{n}"] = result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    parser.add_argument("--json", metavar="PATH", help="also write every figure as JSON")
    args = parser.parse_args(argv)
    s = Settings(args.quick)
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    print(f"kvfunc bench_tiers{' --quick' if s.quick else ''}: Python "
          f"{platform.python_version()}, torch {torch.__version__} (1 thread), "
          f"{os.cpu_count()} CPUs, {platform.machine()}")
    out: dict[str, Any] = {"quick": s.quick, "target": TARGET, "cases": {}}
    try:
        for row_bytes, n in s.cases:
            bench_case(s, row_bytes, n, out["cases"])
    finally:
        torch.set_num_threads(previous)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
