"""A DataDist cluster in its own process, driven by JSON lines on stdin (test helper).

``python peer.py ROLE CLUSTER_ID OPTIONS_JSON`` starts an ``LLMDataDist`` and
prints ``{"ready": true, "listen": [host, port]}``; then each stdin line is a
command ``{"op": ..., ...}`` answered by one stdout line ``{"ok": true, ...}``
or ``{"ok": false, "code": ..., "message": ...}``.  Unprompted lines carry
``"event"``.  Cache contents follow :func:`pattern`, so the test process can
compute what any cache should hold.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any

import torch

import kvfunc.datadist as dd
from kvfunc.datadist import _tcp, _wire


def pattern(desc: dd.CacheDesc, seed: int) -> list[torch.Tensor]:
    """Tensor ``i`` of a cache filled with seed ``seed``: distinct values everywhere."""
    numel = 1
    for d in desc.shape:
        numel *= d
    dtype = getattr(torch, desc.data_type.value)
    return [(torch.arange(numel, dtype=torch.float64).view(desc.shape) % 251 + 1000 * i
             + 7 * seed).to(dtype) for i in range(desc.num_tensors)]


class Peer:
    """Executes commands on one cluster."""

    def __init__(self, role: str, cluster_id: int, options: dict[str, Any]) -> None:
        self.dd = dd.LLMDataDist(dd.LLMRole[role], cluster_id, options)
        self.cm = self.dd.cache_manager
        self.caches: dict[int, dd.Cache] = {}
        self.tasks: dict[int, dd.CacheTask] = {}
        self.layers: list[threading.Event] = [threading.Event() for _ in range(64)]
        self.unstall = threading.Event()
        self.out_lock = threading.Lock()

    def emit(self, message: dict[str, Any]) -> None:
        with self.out_lock:
            sys.stdout.write(json.dumps(message) + "\n")
            sys.stdout.flush()

    def op_link(self, clusters: list[list[Any]], timeout: int = 5000) -> dict[str, Any]:
        _, codes = self.dd.link_clusters([dd.ClusterInfo(*c) for c in clusters], timeout)
        return {"codes": [c.name for c in codes]}

    def op_unlink(self, clusters: list[list[Any]]) -> dict[str, Any]:
        _, codes = self.dd.unlink_clusters([dd.ClusterInfo(*c) for c in clusters])
        return {"codes": [c.name for c in codes]}

    def op_alloc(self, desc: dict[str, Any], keys: list[int | None] | None = None,
                 blocks: bool = False, model_id: int | None = None,
                 fill: int | None = None) -> dict[str, Any]:
        d = dd.CacheDesc.from_json(desc)
        if blocks:
            key = None if model_id is None else dd.BlocksCacheKey(self.dd.cluster_id, model_id)
            cache = self.cm.allocate_blocks_cache(d, key)
        else:
            cache = self.cm.allocate_cache(d, [None if r is None else
                                               dd.CacheKey(self.dd.cluster_id, r)
                                               for r in keys or []])
        if fill is not None:
            for t, v in zip(cache.tensors, pattern(d, fill), strict=True):
                t.copy_(v)
        self.caches[cache.cache_id] = cache
        return {"cache_id": cache.cache_id}

    def op_dealloc(self, cache_id: int) -> dict[str, Any]:
        self.cm.deallocate_cache(self.caches.pop(cache_id))
        return {}

    def op_remove_key(self, req_id: int) -> dict[str, Any]:
        self.cm.remove_cache_key(dd.CacheKey(self.dd.cluster_id, req_id))
        return {}

    def op_state(self) -> dict[str, Any]:
        s = self.cm.state
        dd.check_registry(s)
        return {"used": s.used_bytes(), "caches": len(s.caches), "bindings": len(s.bindings),
                "pins": sum(r.pins for r in s.caches.values())}

    def op_staged(self) -> dict[str, Any]:
        """The Mooncake engine's staging: bytes copied through it so far, bytes free now."""
        staging = self.dd._engine.staging
        return {"bytes": staging.staged_bytes, "free": staging.ranges.free_bytes,
                "size": staging.size}

    def op_read(self, cache_id: int) -> dict[str, Any]:
        return {"data": [t.double().flatten().tolist() for t in self.caches[cache_id].tensors]}

    def op_push_blocks(self, cluster: int, dst_cache_id: int, src_cache_id: int,
                       src_blocks: list[int], dst_blocks: list[int]) -> dict[str, Any]:
        self.cm.push_blocks(dd.CacheKeyByIdAndIndex(cluster, dst_cache_id),
                            self.caches[src_cache_id], src_blocks, dst_blocks)
        return {}

    def op_push_cache(self, cluster: int, dst_cache_id: int, batch_index: int,
                      src_cache_id: int, src_batch_index: int) -> dict[str, Any]:
        self.cm.push_cache(dd.CacheKeyByIdAndIndex(cluster, dst_cache_id, batch_index),
                           self.caches[src_cache_id], src_batch_index)
        return {}

    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        return self.layers[layer_index].wait(timeout_in_millis / 1000
                                             if timeout_in_millis else None)

    def op_transfer(self, cluster: int, dst_cache_id: int, src_cache_id: int,
                    src_blocks: list[int], dst_blocks: list[int], tpl: int) -> dict[str, Any]:
        task = self.cm.transfer_cache_async(
            self.caches[src_cache_id], self, [dd.TransferConfig(cluster, dst_cache_id)],
            src_blocks, dst_blocks, tensor_num_per_layer=tpl)
        self.tasks[src_cache_id] = task
        return {}

    def op_layer(self, index: int) -> dict[str, Any]:
        self.layers[index].set()
        return {}

    def op_sync(self, src_cache_id: int, timeout: int = 10000) -> dict[str, Any]:
        self.tasks.pop(src_cache_id).synchronize(timeout)
        return {}

    def op_stall(self) -> dict[str, Any]:
        """Make the next outgoing transfer stop after its first row run until ``unstall``
        (its frame half sent: the receiver is mid-frame)."""
        original = _tcp._Outgoing.send
        peer = self

        def send(self: Any, indices: Any) -> None:
            _tcp._Outgoing.send = original  # type: ignore[method-assign]
            frame, conn = self.frames[0], self.conn
            head = [memoryview(_wire.data_header(self.tag, 0, _wire.frame_bytes(frame))),
                    frame[0]]
            with conn._send_lock:
                conn._send_all(head, time.monotonic() + 30)
                peer.emit({"event": "stalled"})
                peer.unstall.wait(60)
                conn._send_all(list(frame[1:]), time.monotonic() + 30)
            self.next = len(self.layers)
            if self.on_copied is not None:
                self.on_copied()

        _tcp._Outgoing.send = send  # type: ignore[method-assign]
        return {}

    def op_unstall(self) -> dict[str, Any]:
        self.unstall.set()
        return {}


def main() -> None:
    torch.set_num_threads(1)  # the test process computes too: do not oversubscribe
    role, cluster_id, options = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    peer = Peer(role, cluster_id, options)
    peer.emit({"ready": True, "listen": peer.dd.listen_address})
    for line in sys.stdin:
        command = json.loads(line)
        op = command.pop("op")
        if op == "exit":
            break
        try:
            reply = getattr(peer, f"op_{op}")(**command) | {"ok": True}
        except dd.InvalidParamError as exc:
            reply = {"ok": False, "code": exc.status_code.name, "message": str(exc)}
        except Exception as exc:
            code = getattr(getattr(exc, "status_code", None), "name", "PYTHON")
            reply = {"ok": False, "code": code, "message": f"{type(exc).__name__}: {exc}"}
        peer.emit(reply)
    peer.dd.finalize()


if __name__ == "__main__":
    main()
