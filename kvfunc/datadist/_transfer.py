"""Pulls over a link, and what pulls and pushes share: the checks, the data, the release.

Theory of operation
-------------------
The side that receives data always checks what it will write before any
byte moves: a decoder checks its own destination blocks before it asks, a
prompt cluster checks the key and the source blocks a decoder names, a
decoder checks the cache and blocks a pushing prompt cluster names (see
:mod:`._push`).  Each request is served only by the role that serves it:
a PROMPT serves pulls, a DECODER takes pushes.  A transfer id ``tid``
(with one transport tag per tensor) keys the later messages of a request::

    pull (decoder D asks prompt P)          push (P sends to D, layer by layer)
    D posts its receives (tcp, gloo)
    D -> P  {op: pull, tid, key, rows,       P -> D  {op: push, tid, cache, rows}
             posted}
    P -> D  x/tid/accept {ok, sender, ack}   D -> P  x/tid/accept {ok}
    P sends every tensor; D receives         for each layer i: P waits for its compute,
    if ack:                                    sends it, then x/tid/ready/i {ok}
      D -> P  x/tid/ack {ok}                 D -> P  x/tid/done {ok}
      P releases the key on ok, unpins,
      P -> D  x/tid/fin {ok}

On a transport that receives without the sender's descriptor (tcp, gloo),
the decoder posts its receives before it asks, so the data flows as soon
as P has it.  On gloo it lists them (``posted``) and a P that refuses the
pull completes each with an empty message before it replies; on tcp a
refusal sends no data and D just unposts.

A pull of a ``BlocksCacheKey`` has no key to release, so when the transport
copies the source rows out before the transfer's last bytes leave
(``Outgoing.copies_source``) P unpins right then and asks for no ack
(``ack: false``): the data's arrival is D's proof of success, and the pull
saves a round trip of two wake-ups.  A ``CacheKey`` pull keeps the ack, so
the key is released before ``pull_cache`` returns.

Both caches are pinned for the transfer (see :mod:`._registry`), so a
concurrent ``deallocate_cache`` defers the release to the end; a receiver
unpins only once nothing of the transfer can write its rows any more
(:func:`release_when_settled`).  A timeout or a vanished peer in the data
phase raises ``LLM_WAIT_PROCESS_TIMEOUT``, a peer that breaks the protocol
``LLM_LINK_FAILED``, and either breaks the link; a check that fails on the
peer comes back with the peer's status code and leaves the link usable.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvfunc.core import LLMError
from kvfunc.datadist._backends import Incoming, Outgoing
from kvfunc.datadist._errors import (
    InvalidParamError,
    LinkFailedError,
    PeerProtocolError,
    TransferTimeoutError,
)
from kvfunc.datadist._link import Link, log
from kvfunc.datadist._pool import Cache
from kvfunc.datadist._protocol import (
    error_reply,
    get_bool,
    get_int,
    get_ints,
    key_from_json,
    key_to_json,
    raise_if_error,
)
from kvfunc.datadist._types import BlocksCacheKey, CacheDesc, CacheKey, LLMRole

if TYPE_CHECKING:
    from kvfunc.datadist._cache_manager import CacheManager

__all__ = ["Deadline", "broken", "check_compatible", "layers_of", "pull", "put_quietly",
           "release_when_settled", "serve_pull"]

_MAX_MESSAGES = 1 << 16  # of one transfer (at most one per tensor)


def layers_of(num_tensors: int, tensor_num_per_layer: int) -> list[list[int]]:
    """Tensor indices of each layer: ``tensor_num_per_layer`` consecutive tensors each.

    >>> layers_of(6, 2)
    [[0, 1], [2, 3], [4, 5]]
    """
    if type(tensor_num_per_layer) is not int or tensor_num_per_layer <= 0 or \
            num_tensors % tensor_num_per_layer:
        raise InvalidParamError(f"tensor_num_per_layer={tensor_num_per_layer!r} must be a "
                                f"positive divisor of num_tensors={num_tensors}")
    t = tensor_num_per_layer
    return [list(range(i, i + t)) for i in range(0, num_tensors, t)]


def check_compatible(local: CacheDesc, peer: CacheDesc, what: str) -> None:
    """Both sides' rows must have the same tensors, row shape and dtype."""
    if (local.num_tensors, local.row_shape, local.data_type) != \
            (peer.num_tensors, peer.row_shape, peer.data_type):
        raise InvalidParamError(
            f"{what}: {peer.num_tensors} x {list(peer.row_shape)} {peer.data_type.name} rows "
            f"do not match {local.num_tensors} x {list(local.row_shape)} "
            f"{local.data_type.name}")


class Deadline:
    """A point in time ``seconds`` from now; :meth:`left` is what remains of it."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        """Seconds until the deadline (0 once passed)."""
        return max(self.end - time.monotonic(), 0.0)


class _Once:
    """Calls ``action`` on the first call only (a pin released early is not released again)."""

    def __init__(self, action: Callable[[], None]) -> None:
        self.action: Callable[[], None] | None = action

    def __call__(self) -> None:
        action, self.action = self.action, None
        if action is not None:
            action()


def broken(link: Link, exc: LLMError, what: str) -> LLMError:
    """Break the link; the caller's error: a link closed (unlinked) under the transfer or
    the peer's protocol violation as ``LLM_LINK_FAILED``, any other failure as a timeout
    (``LLM_WAIT_PROCESS_TIMEOUT``)."""
    link.mark_broken(f"{what}: {exc}")
    if link.closed:
        return LinkFailedError(f"{what}: the link to cluster {link.peer_cluster_id} was "
                               f"closed: {exc}")
    if isinstance(exc, PeerProtocolError):
        return PeerProtocolError(f"{what} with cluster {link.peer_cluster_id} failed: {exc}")
    return TransferTimeoutError(f"{what} with cluster {link.peer_cluster_id} did not finish "
                                f"in time: {exc}")


def release_when_settled(manager: CacheManager, incoming: Incoming | None, cache_id: int
                         ) -> None:
    """Unpin a destination cache once nothing of an abandoned transfer can write it (at
    once when ``incoming`` is None: the transfer completed)."""
    if incoming is None:
        manager._unpin(cache_id)
    else:  # until then its memory must not go to another cache
        incoming.abandon(lambda: manager._unpin(cache_id))


def put_quietly(link: Link, key: str, message: dict[str, Any]) -> None:
    with contextlib.suppress(LLMError):  # the peer is gone; its side ends by its timeout
        link.channel.put(key, message)


# -- pull -------------------------------------------------------------------------------
def pull(manager: CacheManager, link: Link, key: CacheKey | BlocksCacheKey, dst: Cache,
         dst_rows: list[int], src_rows: list[int] | None, timeout_s: float) -> None:
    """Fetch the rows ``key`` names (and ``src_rows`` of a blocks cache) into ``dst_rows``."""
    link.check_usable()
    deadline = Deadline(timeout_s)
    desc = dst.cache_desc
    one_layer = [list(range(desc.num_tensors))]
    transport = link.transport
    incoming: Incoming | None = None
    manager._pin(dst.cache_id)
    try:
        try:
            tid = link.new_tid(desc.num_tensors)
            if transport.posts_early:  # the data flows as soon as the sender has it
                incoming = transport.incoming(dst.tensors, dst_rows, tid, one_layer, None)
            link.post({"op": "pull", "tid": tid, "key": key_to_json(key), "src_rows": src_rows,
                       "n_rows": len(dst_rows), "desc": desc.to_json(),
                       "posted": list(incoming.starts) if incoming is not None and
                       transport.drains else None})
            accept = link.channel.take(f"x/{tid}/accept", deadline.left())
        except (TransferTimeoutError, LinkFailedError) as exc:
            raise broken(link, exc, "pull") from None
        try:
            descriptor = raise_if_error(accept).get("sender")
            if not isinstance(descriptor, dict):
                raise InvalidParamError("the peer's accept has no sender descriptor")
            ack = get_bool(accept, "ack")
        except LLMError:
            if incoming is not None:  # give the posted receives back (a refusing peer
                # drained them; an accept this side rejects still sends: it is discarded)
                _cancel(link, incoming, deadline)
                incoming = None
            raise
        if incoming is None:
            incoming = transport.incoming(dst.tensors, dst_rows, tid, one_layer, descriptor)
        try:
            incoming.receive_all(deadline.left())
        except (TransferTimeoutError, LinkFailedError) as exc:
            if ack:
                put_quietly(link, f"x/{tid}/ack", {"ok": False})
            raise broken(link, exc, "pull") from None
        incoming = None  # all in place: nothing of it writes the rows any more
        if not ack:  # the prompt side unpinned before its last message left
            return
        try:  # returns once the prompt side released the key and its pin
            link.channel.put(f"x/{tid}/ack", {"ok": True})
            raise_if_error(link.channel.take(f"x/{tid}/fin", deadline.left()))
        except (TransferTimeoutError, LinkFailedError) as exc:
            raise broken(link, exc, "pull") from None
    finally:
        release_when_settled(manager, incoming, dst.cache_id)


def _cancel(link: Link, incoming: Incoming, deadline: Deadline) -> None:
    """Take back the receives posted for a transfer the peer refused (and drained)."""
    try:
        incoming.cancel(deadline.left())
    except (TransferTimeoutError, LinkFailedError) as exc:
        broken(link, exc, "pull")  # the refusal's own error is what the caller sees


def _posted(link: Link, tid: int, message: dict[str, Any]) -> list[int] | None:
    """The messages whose receives the peer posted before it asked (checked), or ``None``."""
    if message.get("posted") is None:
        return None
    starts = get_ints(message, "posted", _MAX_MESSAGES, _MAX_MESSAGES)
    if not link.transport.drains or starts[:1] != [0] or \
            any(b <= a for a, b in itertools.pairwise(starts)):
        raise InvalidParamError(f"posted messages {starts!r:.80} must start at 0 and "
                                "increase, on a transport that drains refused pulls")
    link.check_peer_tid(tid, starts[-1] + 1)
    return starts


def _drain(link: Link, tid: int, message: dict[str, Any], timeout_s: float) -> None:
    """Complete the receives the peer posted for a pull this side refuses."""
    try:
        starts = _posted(link, tid, message)
        if starts:
            link.transport.drain(tid, starts, timeout_s)
    except LLMError as exc:  # the peer's receives time out on their side
        log.warning("could not drain pull %d from cluster %d: %s", tid,
                    link.peer_cluster_id, exc)


def serve_pull(manager: CacheManager, link: Link, tid: int, message: dict[str, Any]) -> None:
    """Serve the pull ``message`` (transfer ``tid``, already checked by the dispatch)."""
    timeout_s = manager._timeout_s
    pinned: Cache | None = None
    outgoing: Outgoing | None = None
    try:
        manager._require(LLMRole.PROMPT, "serving a pull")
        key = key_from_json(message.get("key"))
        peer_desc = CacheDesc.from_json(message.get("desc") or {})
        n_rows = get_int(message, "n_rows", 1, peer_desc.num_rows)
        pinned, batch_index = manager._pin_key(key)
        local = pinned.cache_desc
        check_compatible(local, peer_desc, f"pull of {key!r}")
        link.check_peer_tid(tid, local.num_tensors)
        if isinstance(key, BlocksCacheKey):
            src_rows = get_ints(message, "src_rows", local.num_rows)
        elif message.get("src_rows") is not None:
            raise InvalidParamError(f"{key!r} names one batch entry; src_rows must be null")
        else:
            src_rows = [batch_index]
        if len(src_rows) != n_rows:
            raise InvalidParamError(f"{len(src_rows)} source rows for {n_rows} destination rows")
        outgoing = link.transport.outgoing(pinned.tensors, src_rows, tid,
                                           [list(range(local.num_tensors))])
        posted = _posted(link, tid, message)
        if posted is not None and posted != list(outgoing.starts):
            raise InvalidParamError(f"the receiver waits for messages {posted!r:.80}, this "
                                    f"side sends {list(outgoing.starts)!r:.80}")
    except LLMError as exc:
        if outgoing is not None:
            outgoing.close()
        if pinned is not None:
            manager._unpin(pinned.cache_id)
        _drain(link, tid, message, timeout_s)  # before the reply: the receiver finds them done
        put_quietly(link, f"x/{tid}/accept", error_reply(exc))
        return
    acked = False
    ack = isinstance(key, CacheKey) or not outgoing.copies_source
    unpin = _Once(lambda: manager._unpin(pinned.cache_id))
    if not ack:
        outgoing.on_copied = unpin
    try:
        link.channel.put(f"x/{tid}/accept", {"ok": True, "sender": outgoing.descriptor,
                                             "ack": ack})
        deadline = Deadline(timeout_s)
        outgoing.send(range(local.num_tensors))
        outgoing.wait(deadline.left())
        if ack:
            acked = get_bool(link.channel.take(f"x/{tid}/ack", deadline.left()), "ok")
    except (TransferTimeoutError, LinkFailedError) as exc:
        link.mark_broken(f"serving a pull: {exc}")
    except LLMError as exc:
        log.warning("pull %d from cluster %d failed: %s", tid, link.peer_cluster_id, exc)
    finally:
        if acked and isinstance(key, CacheKey):
            manager._release_key(key)
        unpin()
        outgoing.close()  # the receiver read it all, or gave up, or the link is broken
    if acked:
        put_quietly(link, f"x/{tid}/fin", {"ok": True})
