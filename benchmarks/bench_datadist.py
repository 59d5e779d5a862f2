"""Benchmark of DataDist transfers between two processes over gloo on loopback.

Theory of operation
-------------------
This process is the decoder; it starts a prompt cluster as a child process
(``--prompt``), driven by JSON lines on its stdin.  Both hold one blocks
cache of ``TENSORS`` tensors (8 layers, K and V) in their DataDist pools.

* **Pull.** The decoder pulls ``BLOCKS`` scattered blocks of every tensor
  (64 MiB in all) with ``pull_blocks``; the baseline is a raw gloo
  ``send``/``recv`` of one contiguous 64 MiB tensor between the same two
  processes on a process group of their own.  Raw and pull alternate, round
  after round; medians are compared (each round's own ratio is shown too,
  as a measure of the machine's noise).  Target: pull >= 70 % of raw.
* **Layer-wise push.** The prompt cluster pushes the same blocks with
  ``transfer_cache_async`` while a thread simulates the model: layer ``i``
  is "computed" ``delay`` seconds after layer ``i - 1`` (a sleep: device
  compute does not use the host CPU).  ``delay`` is one layer's transfer
  time, measured first by a push with no compute, so compute and transfer
  are balanced.  Target: total <= (compute time + one layer's transfer) x 1.2.

Every pulled and pushed block is checked against the prompt side's data.
Run ``python benchmarks/bench_datadist.py [--quick] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import torch
from torch._C._distributed_c10d import PrefixStore, TCPStore

import kvfunc.datadist as dd
from kvfunc.core import LLMStatusCode

TENSORS = 16  # 8 layers x (K, V)
BLOCK_SHAPE = (16, 8, 64)  # block size 16, 8 heads, head dim 64: 16 KiB in fp16
SEED = 0


def sizes(quick: bool) -> tuple[int, int, int]:
    """(blocks moved, blocks per cache, rounds)."""
    return (32, 64, 2) if quick else (256, 512, 15)


def desc(num_blocks: int) -> dd.CacheDesc:
    """The blocks cache both sides hold."""
    return dd.CacheDesc(TENSORS, (num_blocks, *BLOCK_SHAPE), dd.DataType.DT_FLOAT16)


def options(pool_bytes: int, **extra: Any) -> dict[str, Any]:
    """Cluster options: CPU pool of ``pool_bytes``, gloo, a generous timeout."""
    return {"llm.MemPoolConfig": json.dumps({"memory_size": pool_bytes, "page_shift": 16}),
            "llm.Device": "cpu", "llm.SyncKvCacheWaitTime": 60_000, **extra}


def block_ids(n: int, num_blocks: int, seed: int) -> list[int]:
    """``n`` distinct, shuffled block ids (paged blocks are never contiguous)."""
    return torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))[:n].tolist()


def fill(cache: dd.Cache) -> None:
    """Deterministic contents, so the decoder can check what arrived."""
    gen = torch.Generator().manual_seed(SEED)
    for t in cache.tensors:
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))


class Prompt:
    """The prompt side (child process)."""

    def __init__(self, quick: bool) -> None:
        moved, num_blocks, _ = sizes(quick)
        d = desc(num_blocks)
        self.dd = dd.LLMDataDist(dd.LLMRole.PROMPT, 0, options(
            d.nbytes + (1 << 20), **{"llm.listenIpInfo": "127.0.0.1:0"}))
        self.cache = self.dd.cache_manager.allocate_blocks_cache(d, dd.BlocksCacheKey(0))
        fill(self.cache)
        self.raw = torch.randn(moved * TENSORS * d.row_nbytes // 4)  # same bytes, contiguous
        self.raw_store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.group: Any = None

    def serve(self) -> None:
        print(json.dumps({"listen": self.dd.listen_address, "raw_port": self.raw_store.port}),
              flush=True)
        self.group = dist_group(self.raw_store, 0)
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["op"] == "raw":
                self.group.send([self.raw], 1, cmd["tag"]).wait()
                print(json.dumps({}), flush=True)
            elif cmd["op"] == "push":
                print(json.dumps({"seconds": self.push(**cmd["args"])}), flush=True)
            else:
                break
        self.dd.finalize()

    def push(self, dst_cache_id: int, src: list[int], dst: list[int], delay: float) -> float:
        """Seconds from the start of layer 0's compute until the push is done."""
        layers = TENSORS // 2
        done = [threading.Event() for _ in range(layers)]

        class Sync:
            def synchronize_layer(self, i: int, timeout_in_millis: int | None) -> bool:
                return done[i].wait(None if timeout_in_millis is None
                                    else timeout_in_millis / 1000)

        task = self.dd.cache_manager.transfer_cache_async(
            self.cache, Sync(), [dd.TransferConfig(1, dst_cache_id)], src, dst)
        start = time.perf_counter()
        for event in done:  # the simulated model: one layer every `delay` seconds
            if delay:
                time.sleep(delay)
            event.set()
        task.synchronize()
        return time.perf_counter() - start


def dist_group(store: Any, rank: int) -> Any:
    """The baseline's own two-rank gloo group."""
    return torch.distributed.ProcessGroupGloo(PrefixStore("raw", store), rank, 2,
                                              datetime.timedelta(seconds=60))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--prompt", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.prompt:
        Prompt(args.quick).serve()
        return
    moved, num_blocks, rounds = sizes(args.quick)
    child = subprocess.Popen([sys.executable, __file__, "--prompt"] + (["--quick"] * args.quick),
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        result = run(child, moved, num_blocks, rounds)
    finally:
        if child.poll() is None:
            assert child.stdin is not None
            child.stdin.write('{"op": "exit"}\n')
            child.stdin.flush()
            child.wait(timeout=60)
        if child.stdin:
            child.stdin.close()
        if child.stdout:
            child.stdout.close()
    result["quick"] = args.quick
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


def run(child: subprocess.Popen[str], moved: int, num_blocks: int, rounds: int
        ) -> dict[str, Any]:
    assert child.stdin is not None and child.stdout is not None
    stdin, stdout = child.stdin, child.stdout

    def ask(op: str, **fields: Any) -> dict[str, Any]:
        stdin.write(json.dumps({"op": op, **fields}) + "\n")
        stdin.flush()
        reply: dict[str, Any] = json.loads(stdout.readline())
        return reply

    hello = json.loads(stdout.readline())
    d = desc(num_blocks)
    decoder = dd.LLMDataDist(dd.LLMRole.DECODER, 1, options(2 * d.nbytes + (1 << 20)))
    cm = decoder.cache_manager
    status, _ = decoder.link_clusters([dd.ClusterInfo(0, *hello["listen"])], 30_000)
    assert LLMStatusCode.LLM_SUCCESS == status, status
    group = dist_group(TCPStore("127.0.0.1", hello["raw_port"], is_master=False), 1)
    dst = cm.allocate_blocks_cache(d)
    src_ids, dst_ids = block_ids(moved, num_blocks, 1), block_ids(moved, num_blocks, 2)
    nbytes = moved * TENSORS * d.row_nbytes
    reference = cm.allocate_blocks_cache(d)
    fill(reference)
    raw = torch.empty(nbytes // 4)

    def time_raw(tag: int) -> float:
        start = time.perf_counter()
        work = group.recv([raw], 0, tag)
        stdin.write(json.dumps({"op": "raw", "tag": tag}) + "\n")
        stdin.flush()
        work.wait()
        stdout.readline()
        return time.perf_counter() - start

    def time_pull() -> float:
        for t in dst.tensors:
            t.zero_()
        start = time.perf_counter()
        cm.pull_blocks(dd.BlocksCacheKey(0), dst, src_ids, dst_ids)
        seconds = time.perf_counter() - start
        for r, t in zip(reference.tensors, dst.tensors, strict=True):
            assert torch.equal(r[src_ids], t[dst_ids]), "pulled blocks differ"
        return seconds

    time_raw(0), time_pull()  # warm up both paths
    raws, pulls = [], []
    for r in range(rounds):  # alternate which path goes first
        if r % 2:
            raws.append(time_raw(r + 1))
            pulls.append(time_pull())
        else:
            pulls.append(time_pull())
            raws.append(time_raw(r + 1))
    raw_s, pull_s = statistics.median(raws), statistics.median(pulls)
    mib = nbytes / (1 << 20)
    print(f"pull: {mib:.0f} MiB in {moved} scattered blocks x {TENSORS} tensors, "
          f"median of {rounds}")
    print(f"  raw gloo send/recv (one tensor)  {raw_s * 1e3:8.1f} ms  "
          f"{mib / raw_s:7.1f} MiB/s")
    print(f"  pull_blocks                      {pull_s * 1e3:8.1f} ms  "
          f"{mib / pull_s:7.1f} MiB/s")
    paired = sorted(r / p for r, p in zip(raws, pulls, strict=True))
    print(f"  ratio pull/raw throughput        {raw_s / pull_s:8.2f}   (target >= 0.70; "
          f"rounds' own ratios {paired[0]:.2f}-{paired[-1]:.2f})")

    def push(delay: float) -> float:
        for t in dst.tensors:
            t.zero_()
        seconds = float(ask("push", args={"dst_cache_id": dst.cache_id, "src": src_ids,
                                          "dst": dst_ids, "delay": delay})["seconds"])
        for r, t in zip(reference.tensors, dst.tensors, strict=True):
            assert torch.equal(r[src_ids], t[dst_ids]), "pushed blocks differ"
        return seconds

    layers = TENSORS // 2
    push(0.0)  # warm up
    alone = statistics.median(push(0.0) for _ in range(rounds))
    layer_s = alone / layers
    totals = [push(layer_s) for _ in range(rounds)]
    total = statistics.median(totals)
    bound = layers * layer_s + layer_s
    print(f"layer-wise transfer_cache_async: {layers} layers, median of {rounds}")
    print(f"  push alone (no compute)          {alone * 1e3:8.1f} ms  "
          f"(one layer {layer_s * 1e3:.1f} ms)")
    print(f"  simulated compute                {layers * layer_s * 1e3:8.1f} ms  "
          f"({layers} x {layer_s * 1e3:.1f} ms)")
    print(f"  compute + push, overlapped       {total * 1e3:8.1f} ms  "
          f"(serial would be {(layers * layer_s + alone) * 1e3:.1f} ms)")
    print(f"  ratio total/(compute + 1 layer)  {total / bound:8.2f}   (target <= 1.20)")
    decoder.finalize()
    return {"mib": mib, "raw_ms": [r * 1e3 for r in raws], "pull_ms": [p * 1e3 for p in pulls],
            "pull_ratio": raw_s / pull_s,
            "layer_ms": layer_s * 1e3, "push_alone_ms": alone * 1e3,
            "overlapped_ms": [t * 1e3 for t in totals], "layerwise_ratio": total / bound}


if __name__ == "__main__":
    main()
