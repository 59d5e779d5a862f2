"""Benchmark of DataDist transfers between two processes on loopback, each with its baseline.

Theory of operation
-------------------
This process is the decoder; it starts a prompt process (``--prompt``),
driven by JSON lines on its stdin.  Each side holds a blocks cache of
``TENSORS`` tensors (8 layers, K and V) per transport: ``tcp`` (the
default) and, when the ``mooncake`` extra is installed, Mooncake.  Every
lane moves ``BLOCKS`` blocks of every tensor (64 MiB), and every pulled or
pushed block is checked against the prompt side's data.

Lanes, interleaved round after round (each round runs them in a rotated
order; medians are compared, and each round's own ratio is shown as the
machine's noise):

* ``raw tcp``: one contiguous 64 MiB tensor over a plain TCP socket
  (``sendall`` / ``recv_into``) between the same two processes: the wire.
* ``raw gloo``: the same over a gloo ``send``/``recv`` (for reference).
* ``pull contiguous``: ``pull_blocks`` of 16 runs of 16 consecutive blocks.
  Target: >= 0.9 of ``raw tcp``'s throughput.
* ``pull scattered``: ``pull_blocks`` of 256 scattered blocks.  Target:
  time <= ``raw tcp`` + ``copy``, where ``copy`` is a 64 MiB
  ``index_select`` of the same rows timed here in the same round.
* ``mooncake raw write``: one 64 MiB region written by the decoder's
  Mooncake engine into the prompt side's registered memory (the engine's
  synchronous call); ``mooncake raw write polled``: the same submitted and
  polled as the pull's reads are (shown for reference).
* ``mooncake pull``: ``pull_blocks`` of the 256 scattered blocks over
  Mooncake (both sides stage them).  Target: >= 0.85 of ``mooncake raw
  write``'s throughput.
* ``mooncake pull contiguous``: the 16 runs of 16 blocks over Mooncake,
  read in place: checked to copy nothing through staging on either side.

Then a **layer-wise push**: the prompt side pushes the scattered blocks
with ``transfer_cache_async`` (tcp) while a thread simulates the model,
one layer every ``delay`` seconds, ``delay`` being one layer's transfer
time measured first.  Target: total <= (compute + one layer) x 1.2.

Then, with Mooncake, the **crossover** (``datadist_crossover.py``): pulls
forced in place and forced staged for runs of 1-32 blocks, which sets the
staging rule; and the **fairness** section (``datadist_fairness.py``):
honest pulls alone and beside a flooding decoder, 1, 4 and 16 honest
decoders.

Run ``python benchmarks/bench_datadist.py [--quick] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch._C._distributed_c10d import PrefixStore, TCPStore

import kvfunc.datadist as dd
from kvfunc.datadist import _slices
from kvfunc.datadist._mooncake_engine import POLL_S

sys.path.insert(0, str(Path(__file__).parent))  # the sections' modules, run or imported
import datadist_crossover
import datadist_fairness

TENSORS = 16  # 8 layers x (K, V)
BLOCK_SHAPE = (16, 8, 64)  # block size 16, 8 heads, head dim 64: 16 KiB in fp16
SEED = 0
DEFAULT_STAGE_BELOW = _slices.STAGE_BELOW


def set_stage_below(value: int) -> None:
    """Force this process's staging threshold (-1: back to the default)."""
    _slices.STAGE_BELOW = DEFAULT_STAGE_BELOW if value < 0 else value


def sizes(quick: bool) -> tuple[int, int, int]:
    """(blocks moved, blocks per cache, rounds)."""
    return (32, 64, 2) if quick else (256, 512, 15)


def desc(num_blocks: int) -> dd.CacheDesc:
    """The blocks cache both sides hold."""
    return dd.CacheDesc(TENSORS, (num_blocks, *BLOCK_SHAPE), dd.DataType.DT_FLOAT16)


def has_mooncake() -> bool:
    """Whether the Mooncake transfer engine can be imported here."""
    try:
        import mooncake.engine  # noqa: F401
    except ImportError:
        return False
    return True


def options(pool_bytes: int, transport: str, **extra: Any) -> dict[str, Any]:
    """Cluster options: CPU pool of ``pool_bytes``, a transport, a generous timeout."""
    return {"llm.MemPoolConfig": json.dumps({"memory_size": pool_bytes, "page_shift": 16}),
            "llm.Device": "cpu", "llm.SyncKvCacheWaitTime": 60_000,
            "llm.TransferBackend": transport, **extra}


def contiguous_ids(n: int, num_blocks: int, seed: int) -> list[int]:
    """``n`` block ids in runs of 16 consecutive blocks, the runs shuffled."""
    runs = torch.randperm(num_blocks // 16, generator=torch.Generator().manual_seed(seed))
    return [16 * int(r) + k for r in runs[:max(n // 16, 1)] for k in range(16)][:n]


def scattered_ids(n: int, num_blocks: int, seed: int) -> list[int]:
    """``n`` distinct, shuffled block ids (paged blocks are rarely contiguous)."""
    return torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))[:n].tolist()


def fill(cache: dd.Cache) -> None:
    """Deterministic contents, so the decoder can check what arrived."""
    gen = torch.Generator().manual_seed(SEED)
    for t in cache.tensors:
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))


class Prompt:
    """The prompt side (child process): a cluster per transport, raw senders."""

    def __init__(self, quick: bool) -> None:
        moved, num_blocks, _ = sizes(quick)
        d = desc(num_blocks)
        self.nbytes = moved * TENSORS * d.row_nbytes
        self.clusters: dict[str, dd.LLMDataDist] = {}
        self.caches: dict[str, dd.Cache] = {}
        for cid, transport in enumerate(["tcp"] + ["mooncake"] * has_mooncake()):
            cluster = dd.LLMDataDist(dd.LLMRole.PROMPT, 2 * cid, options(
                2 * d.nbytes + (1 << 20), transport, **{"llm.listenIpInfo": "127.0.0.1:0"}))
            self.caches[transport] = cluster.cache_manager.allocate_blocks_cache(
                d, dd.BlocksCacheKey(2 * cid))
            fill(self.caches[transport])
            self.clusters[transport] = cluster
        if "mooncake" in self.clusters:  # where the raw Mooncake write lands
            scratch = dd.CacheDesc(1, (self.nbytes,), dd.DataType.DT_UINT8)
            self.scratch = self.clusters["mooncake"].cache_manager.allocate_cache(scratch)
        self.fair = datadist_fairness.prompt_cluster(TENSORS, BLOCK_SHAPE, SEED + 1)
        self.raw = torch.randn(self.nbytes // 4)  # same bytes, contiguous
        self.raw_store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.raw_server = socket.create_server(("127.0.0.1", 0))

    def serve(self) -> None:
        info: dict[str, Any] = {"listen": {t: c.listen_address for t, c in
                                           self.clusters.items()},
                                "raw_port": self.raw_store.port,
                                "fair": self.fair.listen_address,
                                "tcp_port": self.raw_server.getsockname()[1]}
        if "mooncake" in self.clusters:
            info["mooncake"] = [self.clusters["mooncake"]._engine.session,
                                self.scratch.tensors[0].data_ptr()]
        print(json.dumps(info), flush=True)
        threading.Thread(target=self._raw_tcp, daemon=True).start()
        group = dist_group(self.raw_store, 0)
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["op"] == "raw":
                group.send([self.raw], 1, cmd["tag"]).wait()
                print(json.dumps({}), flush=True)
            elif cmd["op"] == "push":
                print(json.dumps({"seconds": self.push(**cmd["args"])}), flush=True)
            elif cmd["op"] == "stage_below":
                set_stage_below(cmd["value"])
                print(json.dumps({}), flush=True)
            elif cmd["op"] == "staged":
                staged = self.clusters["mooncake"]._engine.staging.staged_bytes
                print(json.dumps({"bytes": staged}), flush=True)
            else:
                break
        for cluster in [*self.clusters.values(), self.fair]:
            cluster.finalize()

    def _raw_tcp(self) -> None:
        conn, _ = self.raw_server.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        payload = memoryview(self.raw.numpy()).cast("B")
        while conn.recv(1):
            conn.sendall(payload)

    def push(self, dst_cache_id: int, src: list[int], dst: list[int], delay: float) -> float:
        """Seconds from the start of layer 0's compute until the push is done."""
        done = [threading.Event() for _ in range(TENSORS // 2)]

        class Sync:
            def synchronize_layer(self, i: int, timeout_in_millis: int | None) -> bool:
                return done[i].wait(None if timeout_in_millis is None
                                    else timeout_in_millis / 1000)

        task = self.clusters["tcp"].cache_manager.transfer_cache_async(
            self.caches["tcp"], Sync(), [dd.TransferConfig(1, dst_cache_id)], src, dst)
        start = time.perf_counter()
        for event in done:  # the simulated model: one layer every `delay` seconds
            if delay:
                time.sleep(delay)
            event.set()
        task.synchronize()
        return time.perf_counter() - start


def dist_group(store: Any, rank: int) -> Any:
    """The gloo baseline's own two-rank group."""
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
    child = subprocess.Popen([sys.executable, __file__, "--prompt"] + (["--quick"] * args.quick),
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        result = Decoder(child, args.quick).run()
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


class Decoder:
    """The decoder side (this process): every lane, timed and checked."""

    def __init__(self, child: subprocess.Popen[str], quick: bool) -> None:
        assert child.stdin is not None and child.stdout is not None
        self.stdin, self.stdout = child.stdin, child.stdout
        self.moved, self.num_blocks, self.rounds = sizes(quick)
        self.hello = json.loads(self.stdout.readline())
        d = self.desc = desc(self.num_blocks)
        self.nbytes = self.moved * TENSORS * d.row_nbytes
        self.clusters: dict[str, dd.LLMDataDist] = {}
        self.dst: dict[str, dd.Cache] = {}
        for cid, (transport, address) in enumerate(self.hello["listen"].items()):
            cluster = dd.LLMDataDist(dd.LLMRole.DECODER, 2 * cid + 1,
                                     options(d.nbytes + (1 << 20), transport))
            status, _ = cluster.link_clusters([dd.ClusterInfo(2 * cid, *address)], 30_000)
            assert dd.LLMStatusCode.LLM_SUCCESS == status, status
            self.clusters[transport] = cluster
            self.dst[transport] = cluster.cache_manager.allocate_blocks_cache(d)
        self.group = dist_group(TCPStore("127.0.0.1", self.hello["raw_port"],
                                         is_master=False), 1)
        self.sock = socket.create_connection(("127.0.0.1", self.hello["tcp_port"]))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.raw = torch.empty(self.nbytes // 4)
        self.contig = (contiguous_ids(self.moved, self.num_blocks, 1),
                       contiguous_ids(self.moved, self.num_blocks, 2))
        self.scattered = (scattered_ids(self.moved, self.num_blocks, 1),
                          scattered_ids(self.moved, self.num_blocks, 2))
        self.copy_src = torch.ones(TENSORS * self.num_blocks, d.row_nbytes, dtype=torch.uint8)
        self.copy_rows = torch.tensor([i * self.num_blocks + b for i in range(TENSORS)
                                       for b in self.scattered[0]])
        self.copy_out = torch.empty(len(self.copy_rows), d.row_nbytes, dtype=torch.uint8)
        gen = torch.Generator().manual_seed(SEED)
        self.want = [torch.randn(t.shape, generator=gen).to(t.dtype)
                     for t in self.dst["tcp"].tensors]
        self.staged: dict[str, set[tuple[int, int]]] = {}  # per lane: bytes staged per side

    def ask(self, op: str, **fields: Any) -> dict[str, Any]:
        self.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.stdin.flush()
        reply: dict[str, Any] = json.loads(self.stdout.readline())
        return reply

    def check(self, transport: str, ids: tuple[list[int], list[int]]) -> None:
        """Every moved block equals the prompt side's (the same deterministic fill)."""
        src, dst = ids
        for want, t in zip(self.want, self.dst[transport].tensors, strict=True):
            assert torch.equal(want[src], t[dst]), "moved blocks differ"
            t[dst] = 0

    def time_raw_tcp(self) -> float:
        view = memoryview(self.raw.numpy()).cast("B")
        start = time.perf_counter()
        self.sock.sendall(b"r")
        got = 0
        while got < self.nbytes:
            got += self.sock.recv_into(view[got:])
        return time.perf_counter() - start

    def time_raw_gloo(self, tag: int) -> float:
        start = time.perf_counter()
        work = self.group.recv([self.raw], 0, tag)
        self.stdin.write(json.dumps({"op": "raw", "tag": tag}) + "\n")
        self.stdin.flush()
        work.wait()
        self.stdout.readline()
        return time.perf_counter() - start

    def time_pull(self, transport: str, ids: tuple[list[int], list[int]]) -> float:
        cid = 2 * list(self.clusters).index(transport)
        start = time.perf_counter()
        self.clusters[transport].cache_manager.pull_blocks(
            dd.BlocksCacheKey(cid), self.dst[transport], *ids)
        seconds = time.perf_counter() - start
        self.check(transport, ids)
        return seconds

    def time_copy(self) -> float:
        """One 64 MiB gather of the scattered rows (one visible copy of the same bytes)."""
        start = time.perf_counter()
        torch.index_select(self.copy_src, 0, self.copy_rows, out=self.copy_out)
        return time.perf_counter() - start

    def time_mooncake_raw(self, polled: bool = False) -> float:
        """One 64 MiB write of one region: the engine's synchronous call (it spins a core
        while it waits), or submitted and polled every POLL_S as the pull's reads are."""
        engine = self.clusters["mooncake"]._engine.engine
        session, remote = self.hello["mooncake"]
        local = self.dst["mooncake"].tensors[0].data_ptr()
        start = time.perf_counter()
        if polled:
            batch = engine.batch_transfer_async_write(session, [local], [remote], [self.nbytes])
            while (status := engine.transfer_check_status(batch)) in (0, -2):
                time.sleep(POLL_S)
            status = 0 if status == 1 else status
        else:
            status = engine.batch_transfer_sync_write(session, [local], [remote], [self.nbytes])
        seconds = time.perf_counter() - start
        assert 0 == status, status
        return seconds

    def lanes(self) -> dict[str, Callable[[int], float]]:
        out: dict[str, Callable[[int], float]] = {
            "raw tcp": lambda r: self.time_raw_tcp(),
            "raw gloo": self.time_raw_gloo,
            "pull contiguous": lambda r: self.time_pull("tcp", self.contig),
            "pull scattered": lambda r: self.time_pull("tcp", self.scattered),
            "copy": lambda r: self.time_copy()}
        if "mooncake" in self.clusters:
            out["mooncake raw write"] = lambda r: self.time_mooncake_raw()
            out["mooncake raw write polled"] = lambda r: self.time_mooncake_raw(polled=True)
            out["mooncake pull"] = lambda r: self.time_staged("mooncake pull", self.scattered)
            out["mooncake pull contiguous"] = lambda r: self.time_staged(
                "mooncake pull contiguous", self.contig)
        return out

    def staging(self) -> tuple[int, int]:
        """Bytes each side's Mooncake engine has copied through its staging arena."""
        return (self.ask("staged")["bytes"],
                self.clusters["mooncake"]._engine.staging.staged_bytes)

    def time_staged(self, lane: str, ids: tuple[list[int], list[int]]) -> float:
        """A Mooncake pull, timed; what each side staged for it is recorded per lane."""
        before = self.staging()
        seconds = self.time_pull("mooncake", ids)
        after = self.staging()
        self.staged.setdefault(lane, set()).add((after[0] - before[0], after[1] - before[1]))
        return seconds

    def report_staging(self) -> None:
        """Scattered blocks are staged on both sides; contiguous runs move in place."""
        print(f"  mooncake staging (prompt, decoder bytes per pull): scattered "
              f"{sorted(self.staged['mooncake pull'])}, contiguous "
              f"{sorted(self.staged['mooncake pull contiguous'])}")
        assert {(self.nbytes, self.nbytes)} == self.staged["mooncake pull"]
        assert {(0, 0)} == self.staged["mooncake pull contiguous"], "contiguous runs copied"

    def run(self) -> dict[str, Any]:
        lanes = self.lanes()
        names = list(lanes)
        for name in names:  # warm every path up
            lanes[name](0)
        times: dict[str, list[float]] = {name: [] for name in names}
        for r in range(self.rounds):
            for k in range(len(names)):  # a rotated order each round
                name = names[(k + r) % len(names)]
                times[name].append(lanes[name](r + 1))
        med = {name: statistics.median(ts) for name, ts in times.items()}
        mib = self.nbytes / (1 << 20)
        print(f"{mib:.0f} MiB of {TENSORS} tensors x {self.moved} blocks, median of "
              f"{self.rounds} interleaved rounds")
        for name in names:
            print(f"  {name:<26} {med[name] * 1e3:8.1f} ms  {mib / med[name]:8.1f} MiB/s")
        result: dict[str, Any] = {"mib": mib, "ms": {n: [t * 1e3 for t in ts]
                                                     for n, ts in times.items()}}

        def ratio(label: str, num: str, den: str, target: str) -> None:
            own = sorted(a / b for a, b in zip(times[num], times[den], strict=True))
            value = med[num] / med[den]
            result[label] = value
            print(f"  {label:<38} {value:6.2f}   ({target}; rounds' own "
                  f"{own[0]:.2f}-{own[-1]:.2f})")

        ratio("ratio contiguous/raw tcp throughput", "raw tcp", "pull contiguous",
              "target >= 0.90")
        bound = [a + b for a, b in zip(times["raw tcp"], times["copy"], strict=True)]
        times["raw tcp + copy"] = bound
        med["raw tcp + copy"] = statistics.median(bound)
        ratio("ratio scattered/(raw tcp + copy) time", "pull scattered", "raw tcp + copy",
              "target <= 1.00")
        ratio("ratio scattered/raw tcp throughput", "raw tcp", "pull scattered", "shown")
        ratio("ratio raw gloo/raw tcp throughput", "raw tcp", "raw gloo", "shown")
        if "mooncake" in self.clusters:
            ratio("ratio mooncake pull/raw write throughput", "mooncake raw write",
                  "mooncake pull", "target >= 0.85")
            ratio("ratio mooncake pull/raw write polled throughput",
                  "mooncake raw write polled", "mooncake pull", "shown")
            ratio("ratio mooncake contiguous/raw write throughput", "mooncake raw write",
                  "mooncake pull contiguous", "shown")
            self.report_staging()
        result["layerwise_ratio"] = self.layerwise()
        if "mooncake" in self.clusters:
            result["crossover"] = self.crossover()
        for cluster in self.clusters.values():
            cluster.finalize()
        quick = self.moved < 256
        result["fairness"] = datadist_fairness.run(
            tuple(self.hello["fair"]), TENSORS, BLOCK_SHAPE, SEED + 1,
            rounds=1 if quick else 5, pulls=1 if quick else 4)
        return result

    def crossover(self) -> dict[str, Any]:
        def both(value: int) -> None:
            set_stage_below(value)
            self.ask("stage_below", value=value)

        return datadist_crossover.run(
            lambda src, dst: self.time_pull("mooncake", (src, dst)), both, self.moved,
            self.num_blocks, self.desc.row_nbytes, TENSORS, max(self.rounds * 3 // 5, 1))

    def layerwise(self) -> float:
        dst = self.dst["tcp"]

        def push(delay: float) -> float:
            seconds = float(self.ask("push", args={
                "dst_cache_id": dst.cache_id, "src": self.scattered[0],
                "dst": self.scattered[1], "delay": delay})["seconds"])
            self.check("tcp", self.scattered)
            return seconds

        layers = TENSORS // 2
        push(0.0)  # warm up
        alone = statistics.median(push(0.0) for _ in range(self.rounds))
        layer_s = alone / layers
        total = statistics.median(push(layer_s) for _ in range(self.rounds))
        bound = layers * layer_s + layer_s
        print(f"layer-wise transfer_cache_async over tcp: {layers} layers, median of "
              f"{self.rounds}")
        print(f"  push alone (no compute)          {alone * 1e3:8.1f} ms  "
              f"(one layer {layer_s * 1e3:.1f} ms)")
        print(f"  simulated compute                {layers * layer_s * 1e3:8.1f} ms")
        print(f"  compute + push, overlapped       {total * 1e3:8.1f} ms  "
              f"(serial would be {(layers * layer_s + alone) * 1e3:.1f} ms)")
        print(f"  ratio total/(compute + 1 layer)  {total / bound:8.2f}   (target <= 1.20)")
        return total / bound


if __name__ == "__main__":
    main()
