"""The fairness section of ``bench_datadist.py``: honest pulls alone and beside a flooder.

The prompt process holds a ``tcp`` PROMPT cluster whose transfer timeout is
2 s, with a blocks cache (what honest decoders pull) and an entry under a
``CacheKey`` (what the flooder pulls).  This process links ``n`` honest
DECODER clusters to it (1, 4, 16) and one flooding DECODER:

* the **flooder** keeps its per-link limit of ``CacheKey`` pulls posted
  (64) and answers each accept with ``{"ok": false}`` 1.7 s after it:
  legal, never a timeout, each request holding a serving thread of the
  prompt cluster all that time;
* each **honest** decoder pulls 16 scattered blocks (4 MiB), one pull after
  the other, every pull checked.

Each round times the honest pulls alone, then beside the flood (started
first, and in effect: the flooder holds its whole share of the prompt's
serving slots throughout), interleaved round after round.  The bound is
the issue's: every honest pull within its time alone (the median alone,
same ``n``) plus one in-flight transfer of the flooder (1.7 s).
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from typing import Any

import torch

import kvfunc.datadist as dd
from kvfunc.datadist._link import MAX_REQUESTS
from kvfunc.datadist._protocol import key_to_json
from kvfunc.datadist._serving import LINK_SHARE

TIMEOUT_MS = 2000  # the prompt's and the decoders' transfer timeout
HOLD_S = 1.7  # the flooder acknowledges each pull this long after its accept
BLOCKS = 64  # blocks of the cache honest decoders pull from
MOVED = 16  # blocks per honest pull
FLOOD_KEY = dd.CacheKey(4, 1)
FLOOD_DESC = dd.CacheDesc(1, (1, 1 << 16), dd.DataType.DT_UINT8)


def blocks_desc(tensors: int, block_shape: tuple[int, ...]) -> dd.CacheDesc:
    """The blocks cache honest decoders pull from (and into)."""
    return dd.CacheDesc(tensors, (BLOCKS, *block_shape), dd.DataType.DT_FLOAT16)


def options(pool_bytes: int, **extra: Any) -> dict[str, Any]:
    """A CPU cluster over tcp with the fairness section's timeout."""
    return {"llm.MemPoolConfig": json.dumps({"memory_size": pool_bytes, "page_shift": 16}),
            "llm.Device": "cpu", "llm.SyncKvCacheWaitTime": TIMEOUT_MS,
            "llm.TransferBackend": "tcp", **extra}


def fill(cache: dd.Cache, seed: int) -> None:
    """Deterministic contents, so a decoder can check what arrived."""
    gen = torch.Generator().manual_seed(seed)
    for t in cache.tensors:
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))


def prompt_cluster(tensors: int, block_shape: tuple[int, ...], seed: int) -> dd.LLMDataDist:
    """The prompt side's fairness cluster (id 4): listening, the blocks cache under
    ``BlocksCacheKey(4)`` and the flooder's entry under ``FLOOD_KEY``."""
    desc = blocks_desc(tensors, block_shape)
    cluster = dd.LLMDataDist(dd.LLMRole.PROMPT, 4, options(
        desc.nbytes + (4 << 20), **{"llm.listenIpInfo": "127.0.0.1:0"}))
    fill(cluster.cache_manager.allocate_blocks_cache(desc, dd.BlocksCacheKey(4)), seed)
    cluster.cache_manager.allocate_cache(FLOOD_DESC, [FLOOD_KEY])
    return cluster


class Flooder:
    """A DECODER cluster (id 5) that keeps ``MAX_REQUESTS`` pulls of ``FLOOD_KEY`` posted
    and answers each accept ``HOLD_S`` later with ``{"ok": false}``."""

    def __init__(self, address: tuple[str, int]) -> None:
        self.dd = dd.LLMDataDist(dd.LLMRole.DECODER, 5, options(4 << 20))
        status, _ = self.dd.link_clusters([dd.ClusterInfo(4, *address)], 30_000)
        assert dd.LLMStatusCode.LLM_SUCCESS == status, status
        self.link = self.dd._links[4]
        self.dst = self.dd.cache_manager.allocate_cache(FLOOD_DESC)
        self.lock = threading.Lock()
        self.held = self.errors = 0
        self.stopping = threading.Event()
        self.threads: list[threading.Thread] = []

    def start(self) -> None:
        """Post the flood; returns once the prompt serves the flooder's whole share."""
        self.stopping.clear()
        self.threads = [threading.Thread(target=self._loop, daemon=True)
                        for _ in range(MAX_REQUESTS)]
        for thread in self.threads:
            thread.start()
        deadline = time.monotonic() + 30
        while self.held < 1 + LINK_SHARE and time.monotonic() < deadline:
            self.stopping.wait(0.001)
        assert self.held == 1 + LINK_SHARE, f"the flooder holds {self.held}"

    def _loop(self) -> None:
        while not self.stopping.is_set():
            try:
                self._pull()
            except dd.LLMError:
                with self.lock:
                    self.errors += 1
                return

    def _pull(self) -> None:
        tid = self.link.new_tid(1)
        incoming = self.link.transport.incoming(self.dst.tensors, [0], tid, [[0]], None)
        self.link.post({"op": "pull", "tid": tid, "key": key_to_json(FLOOD_KEY),
                        "src_rows": None, "n_rows": 1, "desc": FLOOD_DESC.to_json(),
                        "posted": None})
        assert self.link.channel.take(f"x/{tid}/accept", 60)["ok"]
        accepted = time.monotonic()
        with self.lock:
            self.held += 1
        incoming.receive_all(60)
        self.stopping.wait(max(HOLD_S - (time.monotonic() - accepted), 0.0))
        with self.lock:
            self.held -= 1
        self.link.channel.put(f"x/{tid}/ack", {"ok": False})

    def stop(self) -> int:
        """Answer every pull at once, let the queued ones through; the errors seen."""
        self.stopping.set()
        for thread in self.threads:
            thread.join(60)
        return self.errors


class Honest:
    """``n`` honest DECODER clusters (ids 6, 7, ...) linked to the fairness cluster."""

    def __init__(self, n: int, address: tuple[str, int], desc: dd.CacheDesc,
                 seed: int) -> None:
        self.clusters, self.dst = [], []
        for i in range(n):
            cluster = dd.LLMDataDist(dd.LLMRole.DECODER, 6 + i, options(desc.nbytes +
                                                                         (1 << 20)))
            status, _ = cluster.link_clusters([dd.ClusterInfo(4, *address)], 30_000)
            assert dd.LLMStatusCode.LLM_SUCCESS == status, status
            self.clusters.append(cluster)
            self.dst.append(cluster.cache_manager.allocate_blocks_cache(desc))
        gen = torch.Generator().manual_seed(seed)
        self.want = [torch.randn(t.shape, generator=gen).to(t.dtype)
                     for t in self.dst[0].tensors]
        ids = torch.randperm(BLOCKS, generator=torch.Generator().manual_seed(7)).tolist()
        self.src, self.rows = ids[:MOVED], ids[MOVED:2 * MOVED]

    def pulls(self, count: int) -> tuple[list[float], int]:
        """Every decoder pulls ``count`` times, all at once; the seconds of each pull (every
        one checked) and how many failed."""
        seconds: list[float] = []
        failed = [0]
        lock = threading.Lock()

        def run(cluster: dd.LLMDataDist, dst: dd.Cache) -> None:
            for _ in range(count):
                start = time.perf_counter()
                try:
                    cluster.cache_manager.pull_blocks(dd.BlocksCacheKey(4), dst, self.src,
                                                      self.rows)
                except dd.LLMError:
                    with lock:
                        failed[0] += 1
                    continue
                took = time.perf_counter() - start
                assert all(torch.equal(w[self.src], t[self.rows])
                           for w, t in zip(self.want, dst.tensors, strict=True))
                with lock:
                    seconds.append(took)

        threads = [threading.Thread(target=run, args=pair)
                   for pair in zip(self.clusters, self.dst, strict=True)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return seconds, failed[0]

    def close(self) -> None:
        for cluster in self.clusters:
            cluster.finalize()


def run(address: tuple[str, int], tensors: int, block_shape: tuple[int, ...], seed: int,
        rounds: int, pulls: int) -> dict[str, Any]:
    """The section: for 1, 4 and 16 honest decoders, ``rounds`` interleaved rounds of
    ``pulls`` pulls each alone and beside the flood; prints and returns the figures."""
    desc = blocks_desc(tensors, block_shape)
    flooder = Flooder(address)
    out: dict[str, Any] = {}
    print(f"fairness over tcp: honest pulls of {MOVED} blocks "
          f"({MOVED * desc.row_nbytes * tensors >> 20} MiB), alone and beside a decoder "
          f"that keeps {MAX_REQUESTS} CacheKey pulls posted and acknowledges each "
          f"{HOLD_S} s late (timeout {TIMEOUT_MS / 1000:.1f} s), {rounds} rounds")
    for n in (1, 4, 16):
        honest = Honest(n, address, desc, seed)
        alone: list[float] = []
        beside: list[float] = []
        failed = flood_errors = 0
        try:
            honest.pulls(1)  # warm up
            for _ in range(rounds):
                seconds, bad = honest.pulls(pulls)
                alone += seconds
                flooder.start()
                seconds, bad2 = honest.pulls(pulls)
                held = flooder.held
                flood_errors += flooder.stop()
                beside += seconds
                failed += bad + bad2
                assert held >= 1, "the flood ended before the honest pulls did"
        finally:
            honest.close()
        out[str(n)] = report(n, alone, beside, failed, flood_errors)
    flooder.dd.finalize()
    return out


def report(n: int, alone: list[float], beside: list[float], failed: int,
           flood_errors: int) -> dict[str, Any]:
    """Print one line of the fairness table; its figures."""
    med_alone, med_beside = statistics.median(alone), statistics.median(beside)
    bound = med_alone + HOLD_S
    met = failed == 0 and max(beside) <= bound
    print(f"  {n:>2} honest: alone median {med_alone * 1e3:7.1f} ms max "
          f"{max(alone) * 1e3:7.1f} | beside the flood median {med_beside * 1e3:7.1f} ms "
          f"max {max(beside) * 1e3:7.1f} | ratio {med_beside / med_alone:5.2f} | "
          f"failed {failed} | bound {bound * 1e3:.0f} ms {'met' if met else 'NOT met'}")
    return {"alone_ms": [s * 1e3 for s in alone], "beside_ms": [s * 1e3 for s in beside],
            "failed": failed, "flood_errors": flood_errors, "ratio": med_beside / med_alone,
            "bound_met": met}
