"""A hostile peer for tests: a real ``LLMDataDist`` that sends hand-made messages.

:class:`Hostile` links a cluster of its own to a victim cluster (both in
this process) and takes over its side of the link: requests from the
victim go to a script the test chooses (:meth:`Hostile.answer`) instead of
the honest handlers, and the test sends whatever control messages, data
frames or raw bytes it likes.  :func:`snapshot` and :func:`assert_clean`
check what a victim must keep after any attack: no pin, no pool byte
leaked, nothing written outside the rows it offered.  :class:`Flood` is a
greedy decoder: many legal pulls, each acknowledged as late as it dares.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import torch

import kvfunc.datadist as dd
from kvfunc.datadist._backends import Incoming
from kvfunc.datadist._link import Link
from kvfunc.datadist._protocol import key_to_json
from kvfunc.datadist._wire import HEADER, MAGIC, data_header

Script = Callable[[Link, dict[str, Any]], None]


def wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    """Poll a real condition (every 10 ms) until it holds or ``timeout`` seconds pass."""
    done = threading.Event()
    for _ in range(int(timeout / 0.01)):
        if condition():
            return True
        done.wait(0.01)
    return condition()


class Hostile:
    """A cluster of ``role`` linked to ``victim``, which the test drives by hand."""

    def __init__(self, victim: dd.LLMDataDist, role: dd.LLMRole, cluster_id: int,
                 options: dict[str, Any]) -> None:
        self.victim = victim
        listen = victim.listen_address is None
        self.dd = dd.LLMDataDist(role, cluster_id,
                                 options | ({"llm.listenIpInfo": "127.0.0.1:0"} if listen
                                            else {}))
        self.requests: list[dict[str, Any]] = []
        self._script: Script | None = None
        self.link_up()

    def link_up(self) -> None:
        """(Re)link the two clusters: whichever listens is linked to."""
        if self.victim.listen_address is not None:
            codes = self.dd.link_clusters([dd.ClusterInfo(self.victim.cluster_id,
                                                          *self.victim.listen_address)])
        else:
            assert self.dd.listen_address is not None
            codes = self.victim.link_clusters([dd.ClusterInfo(self.dd.cluster_id,
                                                              *self.dd.listen_address)])
        assert dd.LLMStatusCode.LLM_SUCCESS == codes[0], codes
        assert wait_for(lambda: self.victim.cluster_id in self.dd.linked_clusters())
        assert wait_for(lambda: self.dd.cluster_id in self.victim.linked_clusters())
        if self._script is not None:
            self.answer(self._script)

    def relink_victim(self) -> None:
        """What a victim does after a broken link: unlink, then link again."""
        if self.victim.listen_address is None:
            self.victim.unlink_clusters([dd.ClusterInfo(self.dd.cluster_id, "127.0.0.1", 1)])
        else:
            self.dd.unlink_clusters([dd.ClusterInfo(self.victim.cluster_id, "127.0.0.1", 1)])
        self.link_up()

    @property
    def link(self) -> Link:
        """This side's link to the victim."""
        return self.dd._links[self.victim.cluster_id]

    def answer(self, script: Script | None) -> None:
        """Serve the victim's requests with ``script`` (None: honestly again)."""
        self._script = script
        ctx = self.dd._ctx
        self.link.ctx = ctx if script is None else attrs.evolve(ctx, dispatch=self._record)

    def _record(self, link: Link, message: dict[str, Any]) -> None:
        self.requests.append(message)
        assert self._script is not None
        self._script(link, message)

    def post(self, message: dict[str, Any]) -> None:
        """Send a request."""
        self.link.channel.post(message)

    def put(self, key: str, body: dict[str, Any]) -> None:
        """Send a reply at ``key``."""
        self.link.channel.put(key, body)

    def data(self, tid: int, index: int, payload: bytes, claimed: int | None = None) -> None:
        """Send data frame ``index`` of ``tid`` whose header claims ``claimed`` bytes
        (default: the payload's length) and whose body is ``payload``."""
        header = data_header(tid, index, len(payload) if claimed is None else claimed)
        self.raw(header + payload)

    def control_bytes(self, body: bytes) -> None:
        """Send ``body`` as a control frame, whatever it holds."""
        self.raw(HEADER.pack(MAGIC, 1, 0, 0, len(body)) + body)

    def raw(self, payload: bytes) -> None:
        """Send raw bytes on the link's connection."""
        conn = self.link.channel
        with conn._send_lock:
            conn._send_all([memoryview(payload)], time.monotonic() + 30)

    def close(self) -> None:
        """Finalize the hostile cluster."""
        self.dd.finalize()


class Flood:
    """``count`` pulls of ``key`` into row 0 of ``dst``, posted at once by ``hostile`` (a
    DECODER): each is received whole, then answered with ``{"ok": false}`` once
    :attr:`release` is set or ``hold_s`` after its accept, whichever comes first (a
    thread each).  All legal, and
    never a timeout if ``hold_s`` is under the victim's.  :attr:`answered` counts the
    answers, :attr:`errors` what went wrong on this side."""

    def __init__(self, hostile: Hostile, key: dd.CacheKey, dst: dd.Cache, count: int,
                 hold_s: float) -> None:
        self.link, self.hold_s = hostile.link, hold_s
        self.release = threading.Event()
        self.answered = 0
        self.errors: list[BaseException] = []
        desc, tensors = dst.cache_desc, [list(range(dst.cache_desc.num_tensors))]
        self.pulls: list[tuple[int, Incoming]] = []
        for _ in range(count):
            tid = self.link.new_tid(desc.num_tensors)
            incoming = self.link.transport.incoming(dst.tensors, [0], tid, tensors, None)
            self.link.post({"op": "pull", "tid": tid, "key": key_to_json(key),
                            "src_rows": None, "n_rows": 1, "desc": desc.to_json(),
                            "posted": None})
            self.pulls.append((tid, incoming))
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._answer, args=pull, daemon=True,
                                         name="flood") for pull in self.pulls]
        for thread in self.threads:
            thread.start()

    def _answer(self, tid: int, incoming: Incoming) -> None:
        wait = self.hold_s + 30  # a queued pull is accepted once an earlier one ends
        try:
            assert self.link.channel.take(f"x/{tid}/accept", wait)["ok"]
            incoming.receive_all(wait)
            self.release.wait(self.hold_s)
            self.link.channel.put(f"x/{tid}/ack", {"ok": False})
            with self.lock:
                self.answered += 1
        except BaseException as exc:  # the test reads it
            with self.lock:
                self.errors.append(exc)

    def stop(self) -> None:
        """Answer every pull now and wait until all are answered (or failed)."""
        self.release.set()
        for thread in self.threads:
            thread.join(self.hold_s + 60)


@attrs.frozen
class Snapshot:
    """What a victim cache held, and its pool use, before an attack."""

    tensors: tuple[torch.Tensor, ...]
    used_bytes: int


def snapshot(cm: dd.CacheManager, cache: dd.Cache) -> Snapshot:
    """Copy ``cache``'s tensors and the pool's use."""
    return Snapshot(tuple(t.clone() for t in cache.tensors), cm.state.used_bytes())


def changed_rows(before: Snapshot, cache: dd.Cache) -> set[int]:
    """The rows of ``cache`` whose bytes differ from the snapshot, over every tensor."""
    out: set[int] = set()
    for old, new in zip(before.tensors, cache.tensors, strict=True):
        diff = (old != new).reshape(old.shape[0], -1).any(dim=1)
        out.update(int(r) for r in diff.nonzero().flatten())
    return out


def assert_clean(cm: dd.CacheManager, cache: dd.Cache, before: Snapshot,
                 offered: Iterator[int] | list[int] = ()) -> None:
    """No pin left (a serving thread lets go within seconds), no pool byte leaked, no row
    written but ``offered`` ones."""
    assert wait_for(lambda: 0 == sum(r.pins for r in cm.state.caches.values()))
    dd.check_registry(cm.state)
    assert before.used_bytes == cm.state.used_bytes()
    assert changed_rows(before, cache) <= set(offered)
