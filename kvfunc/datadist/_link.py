"""Links between clusters: the handshake, the per-link serving, teardown.

Theory of operation
-------------------
A cluster that listens (``llm.listenIpInfo``) runs an :class:`Acceptor`: a
listening TCP socket and a thread that hands each new connection to a
handshake thread (at most ``MAX_HANDSHAKES`` at once; more are closed).
``link_clusters`` on the other side connects and shakes hands, every step
within the link timeout::

    linker                                    listener
    {op: hello, v, cluster_id, role,      ->
     transport, session, peer}
                                          <-  {op: welcome, ok, cluster_id, role, link_id,
                                               store_port}   (or an error reply)
    both build the transport for link <link_id> (a process group: rank 0 listens)
                                          <-  {op: linked, ok}  (registered)

The connection (:class:`~kvfunc.datadist._wire.Connection`) then carries
the link's control messages and, on the ``tcp`` transport, its data.  Each
side owns a :class:`Link`: its requests (a pull to serve, a push to
receive) go to the cluster's :class:`~kvfunc.datadist._serving.Server`,
which shares its threads fairly between links (a slot of its own per
link, the rest round robin); at most ``MAX_REQUESTS`` of a link are
queued or served at a time, more break that link.  A request's later
messages are replies at keys of its own (``x/<tid>/...``), so transfers on
one link run side by side; each side numbers its transfers in its own half
of the tag space (:class:`TransferIds`).

A link breaks when a transfer on it times out, when the peer breaks the
protocol or closes the connection, or when serving one of its requests
fails unexpectedly: its connection is shut down at once (every waiter
wakes), and calls on it raise ``LLM_LINK_FAILED`` until the caller unlinks
and links again.  An unlink tells the peer, whose side of the link goes.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import socket
import threading
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future
from typing import Any

import attrs
import torch

from kvfunc.core import LLMError
from kvfunc.datadist._backends import TAG_SPACE, Endpoint, start_store_server
from kvfunc.datadist._errors import (
    InvalidParamError,
    LinkFailedError,
    PeerProtocolError,
)
from kvfunc.datadist._protocol import (
    PROTOCOL_VERSION,
    error_reply,
    get_int,
    get_str,
    raise_if_error,
)
from kvfunc.datadist._serving import Server
from kvfunc.datadist._types import ClusterInfo, LLMRole
from kvfunc.datadist._wire import POLL_S, Connection

__all__ = ["MAX_HANDSHAKES", "MAX_REQUESTS", "Acceptor", "Link", "LinkContext", "TransferIds",
           "connect"]

log = logging.getLogger("kvfunc.datadist")
ROOT = "kvfunc"
MAX_HANDSHAKES = 16  # links being made at once by one listener
MAX_REQUESTS = 64  # requests of one link queued or being served at once
HELLO_BYTES = 1 << 16
_TORCH = ("gloo", "nccl", "hccl")


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
    server: Server  # serves the requests of every link of the cluster, fairly


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
    """One end of a link to ``peer_cluster_id`` (see the module docstring).

    ``host`` and ``store_port`` locate the listener's rendezvous store, which
    only the ``torch.distributed`` transports use.
    """

    def __init__(self, ctx: LinkContext, peer_cluster_id: int, rank: int, link_id: int,
                 conn: Connection, host: str, store_port: int) -> None:
        self.ctx, self.peer_cluster_id, self.rank, self.link_id = ctx, peer_cluster_id, rank, \
            link_id
        self.host, self.store_port = host, store_port
        self.channel = conn
        self.endpoint: Endpoint | None = None
        self.broken: str | None = None
        self.closed = False
        self._serving: set[Future[None]] = set()
        self._serving_lock = threading.Lock()
        self._tids = TransferIds(rank)

    @property
    def transport(self) -> Endpoint:
        """The link's transport (set once the handshake built it)."""
        assert self.endpoint is not None, "the link's transport is not built yet"
        return self.endpoint

    def post(self, message: dict[str, Any]) -> None:
        """Send a request to the peer."""
        self.channel.post(message)

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
        """Break the link: shut its connection down (every waiter wakes, no late data
        lands) and make later transfers on it raise until relinked."""
        if self.broken is not None or self.closed:
            return
        log.warning("link to cluster %d broken: %s", self.peer_cluster_id, reason)
        self.broken = reason
        self.channel.fail(LinkFailedError(f"the link to cluster {self.peer_cluster_id} "
                                          f"broke: {reason}"))

    def start(self) -> None:
        """Start reading the connection."""
        self.channel.start(self._on_request, lambda error: self.mark_broken(str(error)))

    def _on_request(self, message: dict[str, Any]) -> None:
        """A request from the peer (the reading thread): serve it on the pool."""
        if message["op"] == "unlink":
            self.close(notify_peer=False)
            self.ctx.on_down(self)
            return
        with self._serving_lock:
            if len(self._serving) >= MAX_REQUESTS:
                raise PeerProtocolError(f"cluster {self.peer_cluster_id} has over "
                                        f"{MAX_REQUESTS} requests in flight")
            try:
                future = self.ctx.server.submit(self, lambda: self._handle(message))
            except RuntimeError:  # the server was shut down: the cluster is closing
                return
            self._serving.add(future)
        future.add_done_callback(self._served)

    def _served(self, future: Future[None]) -> None:
        with self._serving_lock:
            self._serving.discard(future)

    def _handle(self, message: dict[str, Any]) -> None:
        try:
            self.ctx.dispatch(self, message)
        except Exception as exc:  # a handler's failure breaks the link, never the pool
            log.exception("request %r from cluster %d failed", message.get("op"),
                          self.peer_cluster_id)
            self.mark_broken(f"serving a {message.get('op')!r} request failed: {exc!r:.200}")

    def close(self, *, notify_peer: bool, wait: bool = False) -> None:
        """Stop serving, tell the peer (if asked) and tear the connection and transport down.

        With ``wait``, also wait for the requests being served (each ends by
        its own deadline) before the transport goes.
        """
        if self.closed:
            return
        self.closed = True
        if notify_peer:
            with contextlib.suppress(LLMError):  # the peer is gone: nothing to tell
                self.channel.send_control({"op": "unlink"}, min(self.ctx.timeout_s, 1.0))
        with self._serving_lock:
            serving = list(self._serving)
        for future in serving:
            future.cancel()
        if wait:
            futures.wait(serving, timeout=self.ctx.timeout_s)
        self.channel.close(linger_s=min(self.ctx.timeout_s, 1.0) if notify_peer else 0.0)
        if self.endpoint is not None:
            self.endpoint.close()

    def join(self) -> None:
        """Wait for the requests being served (after :meth:`close`)."""
        with self._serving_lock:
            serving = list(self._serving)
        futures.wait(serving, timeout=self.ctx.timeout_s)


def _hello(ctx: LinkContext, op: str, peer: int) -> dict[str, Any]:
    return {"op": op, "v": PROTOCOL_VERSION, "cluster_id": ctx.cluster_id,
            "role": ctx.role.name, "transport": ctx.transport, "session": ctx.session,
            "peer": peer}


def _read_peer(ctx: LinkContext, message: dict[str, Any], op: str) -> tuple[int, str | None]:
    """Check a hello or welcome; the peer's cluster id and transport session."""
    if message.get("op") != op:
        raise PeerProtocolError(f"expected a {op!r}, got {message.get('op')!r:.80}")
    if get_int(message, "v") != PROTOCOL_VERSION:
        raise LinkFailedError(f"protocol version {message['v']} != {PROTOCOL_VERSION}")
    role = get_str(message, "role")
    if role == ctx.role.name or role not in LLMRole.__members__:
        raise LinkFailedError(f"a {ctx.role.name} cluster links only to the other role, "
                              f"not to {role!r:.80}")
    transport = get_str(message, "transport")
    if transport != ctx.transport:
        raise LinkFailedError(f"transports differ: {transport!r:.80} here {ctx.transport!r}")
    session = message.get("session")
    if session is not None and (not isinstance(session, str) or len(session) > 256):
        raise InvalidParamError(f"bad transport session {session!r:.80}")
    return get_int(message, "cluster_id"), session


def connect(ctx: LinkContext, cluster: ClusterInfo, timeout_s: float) -> Link:
    """Link to a listening cluster (this side is rank 1), every step within ``timeout_s``.

    Raises:
        LinkFailedError: unreachable, wrong cluster or role, refused, or the
            transport could not be built in time.
    """
    host, port = cluster.remote_ip, cluster.remote_port
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except OSError as exc:
        raise LinkFailedError(f"cannot reach cluster {cluster.remote_cluster_id} at "
                              f"{host}:{port}: {exc}") from None
    conn = Connection(sock, f"link to cluster {cluster.remote_cluster_id}", ctx.timeout_s)
    link = None
    try:
        conn.send_control(_hello(ctx, "hello", cluster.remote_cluster_id), timeout_s)
        welcome = raise_if_error(conn.read_control(timeout_s, HELLO_BYTES))
        peer, session = _read_peer(ctx, welcome, "welcome")
        if peer != cluster.remote_cluster_id:
            raise LinkFailedError(f"{host}:{port} is cluster {peer}, not "
                                  f"{cluster.remote_cluster_id}")
        link = Link(ctx, peer, 1, get_int(welcome, "link_id"), conn, host,
                    get_int(welcome, "store_port", 0, 65535))
        link.endpoint = ctx.make_endpoint(link, session)
        raise_if_error(conn.read_control(timeout_s, HELLO_BYTES))
    except (LLMError, RuntimeError) as exc:
        if link is not None:
            link.close(notify_peer=False)
        conn.close()
        if isinstance(exc, LinkFailedError):
            raise
        raise LinkFailedError(f"linking to cluster {cluster.remote_cluster_id} failed: "
                              f"{exc}") from None
    link.start()
    return link


class Acceptor:
    """The listening side: a TCP server socket and a thread that accepts links."""

    def __init__(self, ctx: LinkContext, host: str, port: int) -> None:
        self.ctx = ctx
        try:
            self.server = socket.create_server((host, port), backlog=MAX_HANDSHAKES)
        except OSError as exc:
            raise LinkFailedError(f"cannot listen on {host}:{port}: {exc}") from None
        self.server.settimeout(POLL_S)
        self.host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        self.port = int(self.server.getsockname()[1])
        self._store: Any = None  # the rendezvous store of torch transports, made once
        self._ids = itertools.count(1)
        self._slots = threading.BoundedSemaphore(MAX_HANDSHAKES)
        self._closed = False
        self._thread = threading.Thread(target=self._run, daemon=True, name="kvfunc-accept")
        self._thread.start()

    def _store_port(self) -> int:
        if self.ctx.transport not in _TORCH:
            return 0
        if self._store is None:
            self._store = start_store_server(self.host, 0, self.ctx.timeout_s)
        return int(self._store.port)

    def _run(self) -> None:
        while not self._closed:
            try:
                sock, _ = self.server.accept()
            except TimeoutError:
                continue
            except OSError:  # closed, or a connection that went away while queued
                continue
            if not self._slots.acquire(blocking=False):
                log.warning("refused a connection: %d links are being made", MAX_HANDSHAKES)
                sock.close()
                continue
            threading.Thread(target=self._handshake, args=(sock, next(self._ids)),
                             daemon=True, name="kvfunc-handshake").start()

    def _handshake(self, sock: socket.socket, link_id: int) -> None:
        conn = Connection(sock, f"link {link_id}", self.ctx.timeout_s)
        link = None
        try:
            hello = conn.read_control(self.ctx.timeout_s, HELLO_BYTES)
            peer, session = _read_peer(self.ctx, hello, "hello")
            if get_int(hello, "peer") != self.ctx.cluster_id:
                raise LinkFailedError(f"this is cluster {self.ctx.cluster_id}, not "
                                      f"{hello['peer']}")
            conn.name = f"link {link_id} from cluster {peer}"
            link = Link(self.ctx, peer, 0, link_id, conn, self.host, self._store_port())
            conn.send_control(_hello(self.ctx, "welcome", peer) | {
                "ok": True, "link_id": link_id, "store_port": link.store_port})
            link.endpoint = self.ctx.make_endpoint(link, session)
        except (LLMError, RuntimeError) as exc:
            log.warning("link %d refused or failed: %s", link_id, exc)
            if isinstance(exc, LLMError) and link is None:
                with contextlib.suppress(LLMError):
                    conn.send_control(error_reply(exc))
            if link is not None:
                link.close(notify_peer=False)
            conn.close()
            return
        finally:
            self._slots.release()
        self.ctx.on_up(link)
        link.start()
        with contextlib.suppress(LLMError):  # a failed send breaks the link: it is seen there
            conn.send_control({"op": "linked", "ok": True})

    def close(self) -> None:
        """Stop accepting (links already made stay) and drop the rendezvous store."""
        self._closed = True
        self.server.close()
        self._thread.join(timeout=POLL_S * 4)
        self._store = None
