"""A hostile peer never crashes, hangs or writes into a cluster (see ``hostile.py``).

Each attack checks the victim's status code, that it leaks no pin and no
pool byte, that it writes nothing outside the rows it offered, and that an
honest transfer works afterwards (after unlink + link where the attack broke
the link).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from hostile import Hostile, assert_clean, snapshot, wait_for
from peering import options
from torch_threads import one_torch_thread  # noqa: F401  (autouse)

import kvfunc.datadist as dd
from kvfunc.core import LLMError, LLMStatusCode
from kvfunc.datadist._link import MAX_REQUESTS, Link
from kvfunc.datadist._wire import HEADER, MAGIC, MAX_UNCLAIMED_BYTES

CODE = LLMStatusCode
BLOCKS = dd.CacheDesc(4, (16, 2, 8), dd.DataType.DT_FLOAT16)
ROW = BLOCKS.row_nbytes  # 32 bytes: a pull of n rows is one frame of 4 * n * ROW bytes
TIMEOUT_S = 1.5
OPTS = options(**{"llm.SyncKvCacheWaitTime": int(TIMEOUT_S * 1000)})
DEEP = b"[" * 100_000 + b"]" * 100_000


def filled(cm: dd.CacheManager, key: dd.BlocksCacheKey | None = None, seed: int = 1
           ) -> dd.Cache:
    """A blocks cache whose every element is distinct (and non-zero)."""
    cache = cm.allocate_blocks_cache(BLOCKS, key)
    for i, t in enumerate(cache.tensors):
        t.copy_(torch.arange(1, t.numel() + 1).view(t.shape) + 1000 * i + seed)
    return cache


def zeros(cm: dd.CacheManager) -> dd.Cache:
    """A zero-filled blocks cache."""
    cache = cm.allocate_blocks_cache(BLOCKS)
    for t in cache.tensors:
        t.zero_()
    return cache


@pytest.fixture
def decoder() -> Iterator[tuple[dd.LLMDataDist, Hostile, dd.Cache]]:
    """A victim DECODER (1) and a hostile PROMPT (0) holding blocks cache ``(0, 0)``."""
    victim = dd.LLMDataDist(dd.LLMRole.DECODER, 1, OPTS)
    hostile = Hostile(victim, dd.LLMRole.PROMPT, 0, OPTS)
    try:
        src = filled(hostile.dd.cache_manager, dd.BlocksCacheKey(0, 0))
        yield victim, hostile, src
    finally:
        hostile.close()
        victim.finalize()


@pytest.fixture
def prompt() -> Iterator[tuple[dd.LLMDataDist, Hostile, dd.Cache]]:
    """A victim PROMPT (0, listening) holding blocks cache ``(0, 0)`` and a hostile
    DECODER (1)."""
    victim = dd.LLMDataDist(dd.LLMRole.PROMPT, 0, OPTS | {"llm.listenIpInfo": "127.0.0.1:0"})
    src = filled(victim.cache_manager, dd.BlocksCacheKey(0, 0))
    hostile = Hostile(victim, dd.LLMRole.DECODER, 1, OPTS)
    try:
        yield victim, hostile, src
    finally:
        hostile.close()
        victim.finalize()


def honest_pull(cm: dd.CacheManager, src: dd.Cache, dst: dd.Cache) -> None:
    """An honest pull of blocks [5, 6, 2] into [9, 10, 11] brings exactly those rows."""
    cm.pull_blocks(dd.BlocksCacheKey(0, 0), dst, [5, 6, 2], [9, 10, 11])
    assert all(torch.equal(s[[5, 6, 2]], d[[9, 10, 11]])
               for s, d in zip(src.tensors, dst.tensors, strict=True))


def accept_then(send: Callable[[Hostile, int], None], hostile: Hostile
                ) -> Callable[[Link, dict[str, Any]], None]:
    """A script that accepts a pull (no ack) and then runs ``send(hostile, tid)``."""
    def script(link: Link, message: dict[str, Any]) -> None:
        tid = message["tid"]
        hostile.put(f"x/{tid}/accept", {"ok": True, "sender": {}, "ack": False})
        send(hostile, tid)
    return script


def accepted_push(hostile: Hostile, dst: dd.Cache) -> int:
    """Ask the victim to take a push of one layer into blocks [3, 4] of ``dst``; its id,
    once the victim accepted."""
    tid = hostile.link.new_tid(4)
    hostile.post({"op": "push", "tid": tid, "cache_id": dst.cache_id, "rows": [3, 4],
                  "tensors": [0, 1, 2, 3], "blocks": True, "desc": BLOCKS.to_json(),
                  "layers": [[0, 1, 2, 3]], "sender": {}})
    assert {"ok": True} == hostile.link.channel.take(f"x/{tid}/accept", TIMEOUT_S)
    return tid


def pull_error(cm: dd.CacheManager, dst: dd.Cache) -> tuple[LLMError, float]:
    """Pull blocks [0, 1] into [3, 4]; the error it raises and how long it took."""
    start = time.monotonic()
    with pytest.raises(LLMError) as info:
        cm.pull_blocks(dd.BlocksCacheKey(0, 0), dst, [0, 1], [3, 4])
    return info.value, time.monotonic() - start


@pytest.mark.parametrize(("payload_rows", "claimed_rows", "code", "offered"), [
    (5, 5, CODE.LLM_LINK_FAILED, []),  # 5 rows where 2 were agreed: refused unread
    (1, 1, CODE.LLM_LINK_FAILED, []),  # 1 row where 2 were agreed: refused unread
    (1, 2, CODE.LLM_WAIT_PROCESS_TIMEOUT, [3, 4]),  # claims 2, sends 1, stops
])
def test_a_pull_with_the_wrong_amount_of_data_fails_typed_and_writes_nothing_else(
        decoder: tuple[dd.LLMDataDist, Hostile, dd.Cache], payload_rows: int,
        claimed_rows: int, code: LLMStatusCode, offered: list[int]) -> None:
    """Oversize and undersize data on a pull: a typed error within the timeout (a length
    that differs from the agreed one is refused before a byte is read), nothing written
    outside the offered rows, nothing pinned; the next honest pull works."""
    victim, hostile, src = decoder
    cm = victim.cache_manager
    dst = zeros(cm)
    before = snapshot(cm, dst)
    frame = 4 * ROW  # one row of each of the 4 tensors
    hostile.answer(accept_then(lambda h, tid: h.data(tid, 0, b"\x7f" * frame * payload_rows,
                                                     frame * claimed_rows), hostile))
    error, seconds = pull_error(cm, dst)
    assert code == error.status_code, error
    assert seconds < TIMEOUT_S + 1.0
    assert_clean(cm, dst, before, offered)
    with pytest.raises(dd.LinkFailedError):  # broken until relinked
        honest_pull(cm, src, dst)
    hostile.answer(None)
    hostile.relink_victim()
    honest_pull(cm, src, dst)


@pytest.mark.parametrize("payload_rows", [5, 1])
def test_a_push_with_the_wrong_amount_of_data_breaks_the_link_and_writes_nothing(
        decoder: tuple[dd.LLMDataDist, Hostile, dd.Cache], payload_rows: int) -> None:
    """A push whose frame is 5 or 1 rows where 2 were agreed: the decoder refuses the
    frame unread, breaks the link, holds no pin; after a relink pushes work."""
    victim, hostile, src = decoder
    cm = victim.cache_manager
    dst = zeros(cm)
    before = snapshot(cm, dst)
    tid = accepted_push(hostile, dst)
    hostile.data(tid, 0, b"\x7f" * 4 * ROW * payload_rows)
    assert wait_for(lambda: victim._links[0].broken is not None)
    assert "expects frame 0 of 256 bytes" in str(victim._links[0].broken)
    assert_clean(cm, dst, before)
    hostile.relink_victim()
    hostile.dd.cache_manager.push_blocks(dd.CacheKeyByIdAndIndex(1, dst.cache_id), src,
                                         [7, 8], [3, 4])
    assert all(torch.equal(s[[7, 8]], d[[3, 4]])
               for s, d in zip(src.tensors, dst.tensors, strict=True))


def test_a_push_that_stops_mid_frame_times_out_and_writes_only_offered_rows(
        decoder: tuple[dd.LLMDataDist, Hostile, dd.Cache]) -> None:
    """A push frame that claims 2 rows and sends 1: the decoder gives up by its timeout,
    breaks the link, holds no pin, and wrote only inside the offered rows."""
    victim, hostile, _ = decoder
    cm = victim.cache_manager
    dst = zeros(cm)
    before = snapshot(cm, dst)
    tid = accepted_push(hostile, dst)
    start = time.monotonic()
    hostile.data(tid, 0, b"\x7f" * 4 * ROW, claimed=8 * ROW)
    with pytest.raises(dd.LinkFailedError):  # the decoder hangs up instead of replying
        hostile.link.channel.take(f"x/{tid}/done", TIMEOUT_S + 2)
    assert time.monotonic() - start < TIMEOUT_S + 1
    assert "LLM_WAIT_PROCESS_TIMEOUT" in str(victim._links[0].broken)
    assert_clean(cm, dst, before, offered=[3, 4])


@pytest.mark.parametrize(("op", "side"), [("push", "prompt"), ("pull", "decoder")])
def test_a_request_in_the_wrong_direction_is_refused(request: pytest.FixtureRequest, op: str,
                                                     side: str) -> None:
    """A DECODER may not push into a PROMPT, and a PROMPT may not pull from a DECODER:
    LLM_PARAM_INVALID, nothing written or pinned, the link stays usable."""
    victim, hostile, src = request.getfixturevalue(side)
    cm = victim.cache_manager
    target = src if op == "push" else zeros(cm)
    before = snapshot(cm, target)
    tid = hostile.link.new_tid(4)
    request = {"op": op, "tid": tid, "desc": BLOCKS.to_json(), "layers": [[0, 1, 2, 3]],
               "sender": {}, "cache_id": target.cache_id, "rows": [3, 4], "blocks": True,
               "tensors": [0, 1, 2, 3],
               "key": {"kind": "blocks", "prompt_cluster_id": 1, "model_id": 0},
               "src_rows": [3, 4], "n_rows": 2, "posted": None}
    hostile.post(request)
    reply = hostile.link.channel.take(f"x/{tid}/accept", TIMEOUT_S)
    assert (False, "LLM_PARAM_INVALID") == (reply["ok"], reply["code"])
    assert f"serving a {op} is a" in reply["message"], reply  # refused for its direction
    assert_clean(cm, target, before)
    assert victim._links[hostile.dd.cluster_id].broken is None
    if op == "push":  # the honest direction still works on the same link
        honest_pull(hostile.dd.cache_manager, src, zeros(hostile.dd.cache_manager))


def test_a_100000_deep_message_breaks_the_link_and_wakes_its_waiters_at_once(
        decoder: tuple[dd.LLMDataDist, Hostile, dd.Cache]) -> None:
    """A pull waits for its accept; the peer sends a 100,000-deep JSON message instead:
    the pull fails with LLM_LINK_FAILED at once (not at its timeout), no pin is left,
    and after a relink pulls work."""
    victim, hostile, src = decoder
    cm = victim.cache_manager
    dst = zeros(cm)
    before = snapshot(cm, dst)
    hostile.answer(lambda link, message: hostile.control_bytes(DEEP))
    error, seconds = pull_error(cm, dst)
    assert CODE.LLM_LINK_FAILED == error.status_code, error
    assert "nests deeper than" in str(error)
    assert seconds < TIMEOUT_S / 2
    assert_clean(cm, dst, before)
    hostile.answer(None)
    hostile.relink_victim()
    honest_pull(cm, src, dst)


def _many_pushes(h: Hostile, cache_id: int) -> None:
    for _ in range(MAX_REQUESTS + 1):  # each waits for its first layer: all stay in flight
        h.post({"op": "push", "tid": h.link.new_tid(4), "cache_id": cache_id, "rows": [0],
                "tensors": [0, 1, 2, 3], "blocks": True, "desc": BLOCKS.to_json(),
                "layers": [[0, 1, 2, 3]], "sender": {}})


VIOLATIONS: dict[str, Callable[[Hostile, int], None]] = {
    "not JSON": lambda h, _: h.control_bytes(b"{not json"),
    "not an object": lambda h, _: h.control_bytes(b"[1, 2]"),
    "no op": lambda h, _: h.control_bytes(b'{"tid": 3}'),
    "a reply without a body": lambda h, _: h.control_bytes(b'{"reply": "x/1/accept"}'),
    "a reply twice": lambda h, _: [h.put("x/9/accept", {"ok": True}) for _ in range(2)],
    "replies nobody asked for": lambda h, _: [h.put(f"x/{i}/junk", {"pad": "x" * (1 << 20)})
                                              for i in range(MAX_UNCLAIMED_BYTES >> 20)],
    "a huge control length": lambda h, _: h.raw(HEADER.pack(MAGIC, 1, 0, 0, 1 << 40)),
    "a bad magic": lambda h, _: h.raw(b"GET / HTTP/1.1\r\n\r\n" + b"\0" * 16),
    "an unknown kind": lambda h, _: h.raw(HEADER.pack(MAGIC, 9, 0, 0, 0)),
    "data nobody expects": lambda h, _: h.data(1234, 0, b"\0" * 64),
    "too many requests": _many_pushes,
}


@pytest.mark.parametrize("attack", sorted(VIOLATIONS))
def test_each_protocol_violation_breaks_only_that_link_in_bounded_time(
        decoder: tuple[dd.LLMDataDist, Hostile, dd.Cache], attack: str) -> None:
    """Each malformed, oversize or unexpected message breaks the link (LLM_LINK_FAILED on
    its next use) within the timeout: no thread dies silently, nothing stays pinned or
    written, and after a relink pulls work."""
    victim, hostile, src = decoder
    cm = victim.cache_manager
    dst = zeros(cm)
    before = snapshot(cm, dst)
    with contextlib.suppress(LLMError):  # the victim may hang up before the attack ends
        VIOLATIONS[attack](hostile, dst.cache_id)
    assert wait_for(lambda: victim._links[0].broken is not None, TIMEOUT_S + 1), attack
    with pytest.raises(dd.LinkFailedError):
        honest_pull(cm, src, dst)
    assert wait_for(lambda: 0 == sum(r.pins for r in cm.state.caches.values()),
                    TIMEOUT_S + 1)
    assert_clean(cm, dst, before)
    hostile.relink_victim()
    honest_pull(cm, src, dst)


@pytest.mark.parametrize("hello", [
    HEADER.pack(MAGIC, 1, 0, 0, len(DEEP)) + DEEP,
    HEADER.pack(MAGIC, 1, 0, 0, 1 << 40),
    HEADER.pack(MAGIC, 2, 0, 0, 64) + b"\0" * 64,
    b"\x16\x03\x01" + b"\0" * 64,
    b"",  # connects and says nothing: the handshake gives up by the timeout
])
def test_a_bad_hello_is_refused_and_the_listener_keeps_linking(
        prompt: tuple[dd.LLMDataDist, Hostile, dd.Cache], hello: bytes) -> None:
    """Anything but a hello on a new connection closes that connection (within the
    timeout); the listener links the next honest cluster as before."""
    victim, hostile, src = prompt
    assert victim.listen_address is not None
    start = time.monotonic()
    with socket.create_connection(victim.listen_address, timeout=TIMEOUT_S + 2) as sock:
        sock.sendall(hello)
        while sock.recv(1 << 20):  # at most an error reply, then the listener hangs up
            pass
    assert time.monotonic() - start < TIMEOUT_S + 1
    hostile.relink_victim()
    honest_pull(hostile.dd.cache_manager, src, zeros(hostile.dd.cache_manager))


def test_requests_whose_transfer_id_is_outside_the_peers_half_are_not_served(
        prompt: tuple[dd.LLMDataDist, Hostile, dd.Cache]) -> None:
    """A pull whose id lies in the victim's own half of the tag space (it could name the
    victim's own replies) gets no reply and pins nothing; one that lists posted
    messages on a transport that drains none is LLM_PARAM_INVALID."""
    victim, hostile, src = prompt
    cm = victim.cache_manager
    before = snapshot(cm, src)
    request = {"op": "pull", "key": {"kind": "blocks", "prompt_cluster_id": 0, "model_id": 0},
               "src_rows": [1], "n_rows": 1, "desc": BLOCKS.to_json(), "posted": None}
    own = victim._links[1].new_tid(4)  # an id of the victim's half
    hostile.post(request | {"tid": own})
    with pytest.raises(dd.TransferTimeoutError):
        hostile.link.channel.take(f"x/{own}/accept", 0.5)
    tid = hostile.link.new_tid(4)
    hostile.post(request | {"tid": tid, "posted": [0]})
    reply = hostile.link.channel.take(f"x/{tid}/accept", TIMEOUT_S)
    assert (False, "LLM_PARAM_INVALID") == (reply["ok"], reply["code"])
    assert "drains refused pulls" in reply["message"]
    assert_clean(cm, src, before)
    assert victim._links[1].broken is None


def test_a_gloo_pull_whose_posted_messages_leave_the_peers_half_is_refused() -> None:
    """On gloo, a pull whose id fits the peer's half but whose posted messages run past
    its end is LLM_PARAM_INVALID; nothing is pinned or left pending."""
    opts = OPTS | {"llm.TransferBackend": "gloo"}
    victim = dd.LLMDataDist(dd.LLMRole.PROMPT, 0, opts | {"llm.listenIpInfo": "127.0.0.1:0"})
    src = filled(victim.cache_manager, dd.BlocksCacheKey(0, 0))
    hostile = Hostile(victim, dd.LLMRole.DECODER, 1, opts)
    try:
        before = snapshot(victim.cache_manager, src)
        last = hostile.link.new_tid(1)
        tid = last - last % (1 << 29) + (1 << 29) - 100  # 4 tensors fit, 201 messages do not
        hostile.post({"op": "pull", "tid": tid, "posted": [0, 1, 2, 200], "n_rows": 1,
                      "key": {"kind": "blocks", "prompt_cluster_id": 0, "model_id": 0},
                      "src_rows": [1], "desc": BLOCKS.to_json()})
        reply = hostile.link.channel.take(f"x/{tid}/accept", TIMEOUT_S)
        assert (False, "LLM_PARAM_INVALID") == (reply["ok"], reply["code"])
        assert "with 201 tags is outside side 1's ids" in reply["message"]
        assert_clean(victim.cache_manager, src, before)
        assert [] == victim._links[1].transport.abandoned  # type: ignore[attr-defined]
    finally:
        hostile.close()
        victim.finalize()


def test_wait_sent_on_a_closing_gloo_link_is_a_link_error() -> None:
    """A gloo send still queued when the link closes: wait_sent raises LLM_LINK_FAILED,
    not a timeout."""
    opts = OPTS | {"llm.TransferBackend": "gloo"}
    victim = dd.LLMDataDist(dd.LLMRole.PROMPT, 0, opts | {"llm.listenIpInfo": "127.0.0.1:0"})
    hostile = Hostile(victim, dd.LLMRole.DECODER, 1, opts)
    try:
        endpoint: Any = victim._links[1].transport
        release = threading.Event()
        endpoint.sender.submit(release.wait, 10)  # occupies the sending thread
        handle = endpoint.send(torch.zeros(4), 77)  # queued behind it
        endpoint.sender.shutdown(wait=False, cancel_futures=True)  # what closing does
        release.set()
        with pytest.raises(dd.LinkFailedError) as info:
            endpoint.wait_sent(handle, TIMEOUT_S)
        assert CODE.LLM_LINK_FAILED == info.value.status_code
    finally:
        hostile.close()
        victim.finalize()
