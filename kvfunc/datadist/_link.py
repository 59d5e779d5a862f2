"""Links between clusters: the handshake, the per-link service thread, teardown.

Theory of operation
-------------------
A cluster that listens (``llm.listenIpInfo``) runs a ``TCPStore`` server and
an :class:`Acceptor` thread.  ``link_clusters`` on the other side connects
to that store and shakes hands over the queue ``kvfunc/hello``::

    linker                                   listener
    hello/<n> = {cluster, role, transport} ->
                                          <- welcome/<n> = {ok, cluster, role}
    both build the transport for link <n> (a process group: rank 0 listens)
                                          <- linked/<n> = {ok}  (registered)

Each side of link ``n`` then owns a :class:`Link`: a channel under
``kvfunc/link/<n>``, an inbox queue (``q<rank>``) read by a service thread
that hands each request (a pull to serve, a push to receive) to a small
thread pool, and the transport :class:`Endpoint`.  A request's later
messages use keys of its own (``x/<tid>/...``), so transfers on one link
run side by side; each side numbers its transfers in its own half of the
tag space (:class:`TransferIds`).  A transfer that times out marks the link
broken: the caller unlinks, links again and retries.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import attrs
import torch

from kvfunc.core import LLMError
from kvfunc.datadist._backends import TAG_SPACE, Endpoint
from kvfunc.datadist._channel import QueueReader, StoreChannel, start_store_server
from kvfunc.datadist._errors import (
    InvalidParamError,
    LinkFailedError,
    TransferTimeoutError,
)
from kvfunc.datadist._protocol import (
    PROTOCOL_VERSION,
    error_reply,
    get_int,
    get_str,
    raise_if_error,
)
from kvfunc.datadist._types import ClusterInfo, LLMRole

__all__ = ["Acceptor", "Link", "LinkContext", "TransferIds", "connect"]

log = logging.getLogger("kvfunc.datadist")
ROOT = "kvfunc"


@attrs.frozen
class LinkContext:
    """What a link needs from the cluster that owns it."""

    cluster_id: int
    role: LLMRole
    transport: str
    device: torch.device
    timeout_s: float
    session: str | None
    make_endpoint: Callable[[Link, str | None], Endpoint]
    dispatch: Callable[[Link, dict[str, Any]], None]
    on_up: Callable[[Link], None]
    on_down: Callable[[Link], None]
    executor: ThreadPoolExecutor  # serves requests of every link of the cluster


class TransferIds:
    """Transfer ids of one side of a link, drawn locally (no round trip).

    Side ``rank`` numbers its transfers in its own half of the tag space,
    so the two sides never draw the same id; a transfer's tags
    ``tid .. tid + num_tags - 1`` never leave that half (the count starts
    over instead).

    >>> a, b = TransferIds(0), TransferIds(1)
    >>> a.take(4), a.take(1), b.take(4)
    (1, 5, 536870913)
    >>> a.next = TAG_SPACE // 2 - 2; a.take(4)
    1
    """

    def __init__(self, rank: int) -> None:
        self.base, self.next = rank * (TAG_SPACE // 2), 1
        self.lock = threading.Lock()

    @staticmethod
    def check(rank: int, tid: int, num_tags: int) -> None:
        """Raise :class:`InvalidParamError` unless side ``rank`` could have drawn ``tid``
        for ``num_tags`` tags.

        >>> TransferIds.check(1, TransferIds(1).take(16), 16)
        >>> TransferIds.check(0, TransferIds(1).take(16), 16)
        Traceback (most recent call last):
        ...
        kvfunc.datadist._errors.InvalidParamError: LLM_PARAM_INVALID: transfer id 536870913 ...
        """
        half = TAG_SPACE // 2
        base = rank * half
        if not base < tid <= base + half - max(1, num_tags):
            raise InvalidParamError(f"transfer id {tid} with {num_tags} tags is outside "
                                    f"side {rank}'s ids ({base}, {base + half}]")

    def take(self, num_tags: int) -> int:
        """The first of ``num_tags`` (at least one) consecutive fresh ids."""
        n = max(1, num_tags)
        with self.lock:
            if self.next + n > TAG_SPACE // 2:
                self.next = 1
            tid, self.next = self.next, self.next + n
        return self.base + tid


class Link:
    """One end of a link to ``peer_cluster_id`` (see the module docstring)."""

    def __init__(self, ctx: LinkContext, peer_cluster_id: int, rank: int, link_id: int,
                 host: str, port: int) -> None:
        self.ctx, self.peer_cluster_id, self.rank, self.link_id = ctx, peer_cluster_id, rank, \
            link_id
        self.host, self.port = host, port
        self.channel = StoreChannel(host, port, f"{ROOT}/link/{link_id}", ctx.timeout_s)
        self.endpoint: Endpoint | None = None
        self.broken: str | None = None
        self.closed = False
        self._serving: set[Future[None]] = set()
        self._serving_lock = threading.Lock()
        self._tids = TransferIds(rank)
        self._thread = threading.Thread(target=self._serve, daemon=True,
                                        name=f"kvfunc-link{link_id}-inbox")

    @property
    def transport(self) -> Endpoint:
        """The link's transport (set once the handshake built it)."""
        assert self.endpoint is not None, "the link's transport is not built yet"
        return self.endpoint

    def post(self, message: dict[str, Any]) -> None:
        """Send a request to the peer's inbox."""
        self.channel.post(f"q{1 - self.rank}", message)

    def new_tid(self, num_tags: int) -> int:
        """A transfer id unique on this link, followed by ``num_tags - 1`` free tags."""
        return self._tids.take(num_tags)

    def check_peer_tid(self, tid: int, num_tags: int) -> None:
        """Raise :class:`InvalidParamError` unless the peer could have drawn ``tid`` for
        ``num_tags`` tags (see :meth:`TransferIds.check`)."""
        TransferIds.check(1 - self.rank, tid, num_tags)

    def check_usable(self) -> None:
        """Raise :class:`LinkFailedError` if an earlier failure broke the link."""
        if self.broken is not None:
            raise LinkFailedError(f"the link to cluster {self.peer_cluster_id} is broken "
                                  f"({self.broken}); unlink it, link again and retry")
        if self.closed:
            raise LinkFailedError(f"the link to cluster {self.peer_cluster_id} is closed")

    def mark_broken(self, reason: str) -> None:
        """Remember that the link failed; later transfers on it raise until relinked."""
        if self.broken is None:
            log.warning("link to cluster %d broken: %s", self.peer_cluster_id, reason)
            self.broken = reason

    def start(self) -> None:
        """Start reading the inbox."""
        self._thread.start()

    def _serve(self) -> None:
        reader = QueueReader(self.channel, f"q{self.rank}")
        while True:
            try:
                message = reader.next()
            except TransferTimeoutError:
                continue
            except InvalidParamError as exc:
                log.warning("ignored a malformed message from cluster %d: %s",
                            self.peer_cluster_id, exc)
                continue
            except LinkFailedError as exc:
                if not self.closed:
                    self.mark_broken(str(exc))
                return
            op = message.get("op")
            if op == "close":
                return
            if op == "unlink":
                self.close(notify_peer=False)
                self.ctx.on_down(self)
                return
            try:
                future = self.ctx.executor.submit(self._handle, message)
            except RuntimeError:  # the executor was shut down: the cluster is closing
                return
            with self._serving_lock:
                self._serving.add(future)
            future.add_done_callback(self._served)

    def _served(self, future: Future[None]) -> None:
        with self._serving_lock:
            self._serving.discard(future)

    def _handle(self, message: dict[str, Any]) -> None:
        try:
            self.ctx.dispatch(self, message)
        except Exception:  # a handler's failure must not kill the link's pool
            log.exception("request %r from cluster %d failed", message.get("op"),
                          self.peer_cluster_id)

    def close(self, *, notify_peer: bool, wait: bool = False) -> None:
        """Stop serving, tell the peer (if asked) and tear down the transport.

        With ``wait``, also wait for the inbox thread and for requests being
        served (each ends by its own deadline) before the transport goes.
        """
        if self.closed:
            return
        self.closed = True
        for queue, message in (((f"q{1 - self.rank}", {"op": "unlink"}),) if notify_peer
                               else ()) + ((f"q{self.rank}", {"op": "close"}),):
            with contextlib.suppress(LLMError):  # the peer (or its store) is gone: nothing to tell
                self.channel.post(queue, message)
        with self._serving_lock:
            for future in self._serving:
                future.cancel()
        if wait:
            self.join()
        if self.endpoint is not None:
            self.endpoint.close()

    def join(self) -> None:
        """Wait for the inbox thread and the requests being served (after :meth:`close`)."""
        if self._thread is threading.current_thread():
            return
        with self._serving_lock:
            serving = list(self._serving)
        futures.wait(serving, timeout=self.ctx.timeout_s)
        if self._thread.is_alive():
            self._thread.join(self.ctx.timeout_s)


def _hello(ctx: LinkContext, peer: int) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "cluster_id": ctx.cluster_id, "role": ctx.role.name,
            "transport": ctx.transport, "session": ctx.session, "peer": peer}


def _read_peer(ctx: LinkContext, message: dict[str, Any]) -> tuple[int, str | None]:
    """Check a hello or welcome; the peer's cluster id and transport session."""
    if get_int(message, "v") != PROTOCOL_VERSION:
        raise LinkFailedError(f"protocol version {message['v']} != {PROTOCOL_VERSION}")
    role = get_str(message, "role")
    if role == ctx.role.name or role not in LLMRole.__members__:
        raise LinkFailedError(f"a {ctx.role.name} cluster links only to the other role, "
                              f"not to {role!r}")
    transport = get_str(message, "transport")
    if transport != ctx.transport:
        raise LinkFailedError(f"transports differ: {transport!r} here {ctx.transport!r}")
    session = message.get("session")
    if session is not None and not isinstance(session, str):
        raise InvalidParamError(f"bad transport session {session!r:.80}")
    return get_int(message, "cluster_id"), session


def connect(ctx: LinkContext, cluster: ClusterInfo, timeout_s: float) -> Link:
    """Link to a listening cluster (this side is rank 1).

    Raises:
        LinkFailedError: unreachable, wrong cluster or role, refused, or the
            transport could not be built in ``timeout_s``.
    """
    host, port = cluster.remote_ip, cluster.remote_port
    root = StoreChannel(host, port, ROOT, timeout_s)
    try:
        link_id = root.add("hello/n", 1)
        root.put(f"hello/{link_id}", _hello(ctx, cluster.remote_cluster_id))
        welcome = raise_if_error(root.take(f"welcome/{link_id}", timeout_s))
        peer, session = _read_peer(ctx, welcome)
    except TransferTimeoutError as exc:
        raise LinkFailedError(f"cluster {cluster.remote_cluster_id} at {host}:{port} did "
                              f"not answer: {exc}") from None
    if peer != cluster.remote_cluster_id:
        raise LinkFailedError(f"{host}:{port} is cluster {peer}, not "
                              f"{cluster.remote_cluster_id}")
    link = Link(ctx, peer, 1, link_id, host, port)
    try:
        link.endpoint = ctx.make_endpoint(link, session)
        raise_if_error(root.take(f"linked/{link_id}", timeout_s))
    except (LLMError, RuntimeError) as exc:
        link.close(notify_peer=True)
        if isinstance(exc, LinkFailedError):
            raise
        raise LinkFailedError(f"building the link to cluster {peer} failed: {exc}") from None
    link.start()
    return link


class Acceptor:
    """The listening side: a store server and a thread that accepts links."""

    def __init__(self, ctx: LinkContext, host: str, port: int) -> None:
        self.ctx = ctx
        self.server = start_store_server(host, port, ctx.timeout_s)
        self.host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        self.port = int(self.server.port)
        self.root = StoreChannel(self.host, self.port, ROOT, ctx.timeout_s)
        self._thread = threading.Thread(target=self._run, daemon=True, name="kvfunc-accept")
        self._thread.start()

    def _run(self) -> None:
        reader = QueueReader(self.root, "hello")
        while True:
            try:
                message = reader.next()
            except (TransferTimeoutError, InvalidParamError):
                continue
            except LinkFailedError:
                return
            if message.get("op") == "close":
                return
            link_id = reader.position
            try:
                peer, session = _read_peer(self.ctx, message)
                if get_int(message, "peer") != self.ctx.cluster_id:
                    raise LinkFailedError(f"this is cluster {self.ctx.cluster_id}, not "
                                          f"{message['peer']}")
                self.root.put(f"welcome/{link_id}", _hello(self.ctx, peer) | {"ok": True})
            except LLMError as exc:
                with contextlib.suppress(LLMError):
                    self.root.put(f"welcome/{link_id}", error_reply(exc))
                continue
            threading.Thread(target=self._establish, args=(peer, session, link_id),
                             daemon=True, name=f"kvfunc-accept{link_id}").start()

    def _establish(self, peer: int, session: str | None, link_id: int) -> None:
        link = Link(self.ctx, peer, 0, link_id, self.host, self.port)
        try:
            link.endpoint = self.ctx.make_endpoint(link, session)
        except (LLMError, RuntimeError) as exc:
            log.warning("link %d from cluster %d failed: %s", link_id, peer, exc)
            link.close(notify_peer=False)
            return
        self.ctx.on_up(link)
        link.start()
        with contextlib.suppress(LLMError):
            self.root.put(f"linked/{link_id}", {"ok": True})

    def close(self) -> None:
        """Stop accepting and shut the store server down."""
        with contextlib.suppress(LLMError):
            self.root.post("hello", {"op": "close"})
        self._thread.join(timeout=self.ctx.timeout_s)
        del self.server
