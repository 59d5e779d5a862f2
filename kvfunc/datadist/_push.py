"""Pushes over a link (layer by layer), and the dispatch of a peer's requests.

A push target names the decoder's cache either by its ``cache_id`` or,
as LLM-DataDist's ``TransferConfig`` does, by the addresses of its tensors.
The decoder resolves addresses against its own live caches
(:meth:`CacheManager._pin_addrs`): every address must be the start of a
tensor of one cache (or, for an ordinary cache, the start of one of its
batch entries), so a peer can name only what this side registered, and
nothing received is ever dereferenced.  A target sends any run of whole
layers of the source (``src_layer_range``); its tensors pair by position
with the tensors its addresses name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from kvfunc.core import LLMError
from kvfunc.datadist._backends import Incoming, Outgoing
from kvfunc.datadist._errors import InvalidParamError, LinkFailedError, TransferTimeoutError
from kvfunc.datadist._link import Link, log
from kvfunc.datadist._pool import Cache
from kvfunc.datadist._protocol import error_reply, get_bool, get_int, get_ints, raise_if_error
from kvfunc.datadist._transfer import (
    Deadline,
    broken,
    check_compatible,
    layers_of,
    put_quietly,
    release_when_settled,
    serve_pull,
)
from kvfunc.datadist._types import CacheDesc, LLMRole

if TYPE_CHECKING:
    from kvfunc.datadist._cache_manager import CacheManager

__all__ = ["PushTarget", "dispatch", "push"]

LayerWait = Callable[[int], None]
_ADDRESS_LIMIT = 1 << 64


@attrs.frozen
class PushTarget:
    """One destination of a push: a cache of a linked cluster, and what goes there.

    ``cache_id`` or ``addrs`` names the cache; ``rows`` are its destination
    rows (None: the batch entry the addresses name); ``tensors`` are the
    source tensors sent, in order, whose layers start at ``first_layer``;
    ``src_rows`` are the source rows.
    """

    link: Link
    cache_id: int | None
    addrs: tuple[int, ...] | None
    rows: tuple[int, ...] | None
    blocks: bool
    tensors: tuple[int, ...]
    src_rows: tuple[int, ...]
    first_layer: int = 0

    def request(self, tid: int, desc: CacheDesc, layers: list[list[int]],
                outgoing: Outgoing) -> dict[str, Any]:
        """The push request that names this target."""
        shown = attrs.evolve(desc, num_tensors=len(self.tensors))
        return {"op": "push", "tid": tid, "cache_id": self.cache_id,
                "addrs": None if self.addrs is None else list(self.addrs),
                "tensors": list(self.tensors), "rows": None if self.rows is None
                else list(self.rows), "blocks": self.blocks, "desc": shown.to_json(),
                "layers": layers, "sender": outgoing.descriptor}


def push(manager: CacheManager, targets: Sequence[PushTarget], src: Cache,
         tensors_per_layer: int, wait_layer: LayerWait | None, timeout_s: float) -> None:
    """Send each target's tensors of ``src`` layer by layer.

    ``wait_layer(i)`` returns when source layer ``i`` may be sent (its
    compute is done) and raises to abort; the targets are asked first, so
    their checks overlap the compute of the first layer.
    """
    manager._pin(src.cache_id)
    opened: list[tuple[PushTarget, int, Outgoing, list[list[int]]]] = []
    try:
        for target in targets:
            target.link.check_usable()
            layers = layers_of(len(target.tensors), tensors_per_layer)
            try:
                tid = target.link.new_tid(len(target.tensors))
                outgoing = target.link.transport.outgoing(
                    [src.tensors[i] for i in target.tensors], target.src_rows, tid, layers)
                target.link.post(target.request(tid, src.cache_desc, layers, outgoing))
            except (TransferTimeoutError, LinkFailedError) as exc:
                raise broken(target.link, exc, "push") from None
            opened.append((target, tid, outgoing, layers))
        deadline = Deadline(timeout_s)
        for target, tid, _, _ in opened:
            try:
                accept = target.link.channel.take(f"x/{tid}/accept", deadline.left())
            except (TransferTimeoutError, LinkFailedError) as exc:
                raise broken(target.link, exc, "push") from None
            raise_if_error(accept)
        _send_layers(opened, wait_layer)
        deadline = Deadline(timeout_s)
        for target, tid, outgoing, _ in opened:
            try:
                outgoing.wait(deadline.left())
                done = target.link.channel.take(f"x/{tid}/done", deadline.left())
            except (TransferTimeoutError, LinkFailedError) as exc:
                raise broken(target.link, exc, "push") from None
            raise_if_error(done)
    finally:
        for _, _, outgoing, _ in opened:
            outgoing.close()
        manager._unpin(src.cache_id)


def _send_layers(opened: list[tuple[PushTarget, int, Outgoing, list[list[int]]]],
                 wait_layer: LayerWait | None) -> None:
    first = min(t.first_layer for t, _, _, _ in opened)
    end = max(t.first_layer + len(layers) for t, _, _, layers in opened)
    for i in range(first, end):
        if wait_layer is not None:
            try:
                wait_layer(i)
            except LLMError as exc:  # tell each target at the layer it waits for
                for target, tid, _, layers in opened:
                    j = max(i - target.first_layer, 0)
                    if j < len(layers):
                        put_quietly(target.link, f"x/{tid}/ready/{j}", error_reply(exc))
                raise
        for target, tid, outgoing, layers in opened:
            j = i - target.first_layer
            if not 0 <= j < len(layers):
                continue
            try:
                outgoing.send(layers[j])
            except LinkFailedError as exc:  # the link closed under the push
                target.link.mark_broken(f"push: {exc}")
                raise
            try:
                target.link.channel.put(f"x/{tid}/ready/{j}", {"ok": True})
            except (TransferTimeoutError, LinkFailedError) as exc:
                raise broken(target.link, exc, "push") from None


def _layers(message: dict[str, Any], num_tensors: int) -> list[list[int]]:
    layers = message.get("layers")
    if not isinstance(layers, list) or not layers or len(layers) > num_tensors:
        raise InvalidParamError(f"field 'layers' must be a non-empty list of at most "
                                f"{num_tensors} layers")
    out = [get_ints({"layer": layer}, "layer", num_tensors, num_tensors) for layer in layers]
    if sorted(i for layer in out for i in layer) != list(range(num_tensors)):
        raise InvalidParamError(f"layers {out!r:.200} must name each of {num_tensors} tensors "
                                "once")
    return out


def _destination(manager: CacheManager, message: dict[str, Any]
                 ) -> tuple[Cache, list[int], list[int]]:
    """The cache a push names (pinned), its tensors and its rows, all checked."""
    if message.get("addrs") is not None:
        addrs = get_ints(message, "addrs", _ADDRESS_LIMIT, 65536)
        pinned, tensors, entry = manager._pin_addrs(addrs)
    else:
        pinned, entry = manager._pin_id(get_int(message, "cache_id")), None
    try:
        local = pinned.cache_desc
        if entry is None:
            tensors = get_ints(message, "tensors", local.num_tensors, local.num_tensors)
        if not tensors or len(set(tensors)) != len(tensors):
            raise InvalidParamError(f"destination tensors {tensors!r:.80} must be non-empty "
                                    "and distinct")
        if get_bool(message, "blocks") != pinned.is_blocks_cache:
            raise InvalidParamError(f"cache {pinned.cache_id} is "
                                    f"{'' if pinned.is_blocks_cache else 'not '}a blocks cache")
        if entry is not None and not pinned.is_blocks_cache:
            if message.get("rows") is not None:
                raise InvalidParamError("addresses name the batch entry; rows must be null")
            rows = [entry]
        else:
            rows = get_ints(message, "rows", local.num_rows, local.num_rows)
        if not rows or len(set(rows)) != len(rows) or (not pinned.is_blocks_cache and
                                                       len(rows) != 1):
            raise InvalidParamError(f"destination rows {rows!r:.80} must be distinct: "
                                    "blocks, or one batch entry")
    except LLMError:
        manager._unpin(pinned.cache_id)
        raise
    return pinned, tensors, rows


def _serve_push(manager: CacheManager, link: Link, tid: int, message: dict[str, Any]
                ) -> None:
    """Take the push ``message`` (transfer ``tid``, already checked by the dispatch)."""
    timeout_s = manager._timeout_s
    pinned: Cache | None = None
    try:
        manager._require(LLMRole.DECODER, "serving a push")
        peer_desc = CacheDesc.from_json(message.get("desc") or {})
        pinned, tensors, rows = _destination(manager, message)
        local = pinned.cache_desc
        link.check_peer_tid(tid, len(tensors))
        check_compatible(attrs.evolve(local, num_tensors=len(tensors)), peer_desc,
                         f"push into cache {pinned.cache_id}")
        layers = _layers(message, len(tensors))
        descriptor = message.get("sender")
        if not isinstance(descriptor, dict):
            raise InvalidParamError("the push request has no sender descriptor")
        incoming = link.transport.incoming([pinned.tensors[i] for i in tensors], rows, tid,
                                           layers, descriptor)
    except LLMError as exc:
        if pinned is not None:
            manager._unpin(pinned.cache_id)
        put_quietly(link, f"x/{tid}/accept", error_reply(exc))
        return
    done: dict[str, Any] | None = {"ok": True}
    pending: Incoming | None = incoming
    try:
        link.channel.put(f"x/{tid}/accept", {"ok": True})
        for i, layer in enumerate(layers):
            raise_if_error(link.channel.take(f"x/{tid}/ready/{i}", timeout_s))
            incoming.receive(layer, timeout_s)
        pending = None
    except (TransferTimeoutError, LinkFailedError) as exc:
        link.mark_broken(f"receiving a push: {exc}")
        done = error_reply(exc)
    except LLMError as exc:  # the sender aborted: its layer wait failed
        log.info("push %d from cluster %d aborted: %s", tid, link.peer_cluster_id, exc)
        done = None
    finally:  # before the sender hears the outcome: a finished push holds no pin here
        release_when_settled(manager, pending, pinned.cache_id)
    if done is not None:
        try:
            link.channel.put(f"x/{tid}/done", done)
        except LinkFailedError as exc:
            link.mark_broken(f"replying to a push: {exc}")


def dispatch(manager: CacheManager, link: Link, message: dict[str, Any]) -> None:
    """Serve one request that arrived on ``link``."""
    op = message.get("op")
    try:  # an id the peer cannot have drawn gets no reply: it could name this side's keys
        tid = get_int(message, "tid")
        link.check_peer_tid(tid, 1)
    except InvalidParamError as exc:
        log.warning("ignored request %r from cluster %d: %s", op, link.peer_cluster_id, exc)
        return
    if op == "pull":
        serve_pull(manager, link, tid, message)
    elif op == "push":
        _serve_push(manager, link, tid, message)
    else:
        log.warning("unknown request %r from cluster %d", op, link.peer_cluster_id)
