"""One link's TCP connection: framed control messages and data, both ways.

Theory of operation
-------------------
Every link is one TCP connection whose framing kvfunc owns.  A frame
starts with a fixed header, and the reader checks the header before it
reads a byte of the body::

    "KVF1" | kind (1 control, 2 data) | transfer id | frame index | body length

* A **control** frame is a JSON object of at most ``MAX_MESSAGE_BYTES``,
  nested at most ``MAX_DEPTH`` deep (both checked before parsing, see
  :func:`~kvfunc.datadist._protocol.decode`).  One with a ``reply`` key
  is a reply, kept until the one reader of that key takes it
  (:meth:`take`); any other is a request (it has an ``op``), handed to
  ``on_request``.
* A **data** frame must be the next frame of a transfer this side posted
  a receive for (:meth:`expect`), with exactly the length that receive
  agreed.  Its body goes straight into the receive's buffers (the
  destination rows) with ``recvmsg_into``: no staging, no copy but the
  kernel's.

Anything else (a bad magic or kind, a frame over the limit, data nobody
expects or of another length, a reply to a key that already holds one,
unclaimed replies over ``MAX_UNCLAIMED_BYTES``) is the peer breaking the
protocol.  That, the peer closing, or any error of the reading thread
itself *fails* the connection: it is shut down at once, ``on_failure``
runs, and every waiter (a :meth:`take`, a posted receive) wakes with the
error.

One thread reads; any thread sends, one frame at a time under a lock taken
with the caller's deadline.  Every socket operation has a deadline, set in
the kernel (``SO_SNDTIMEO``, ``SO_RCVTIMEO``) so that one blocking call
moves as much as it can: a send takes the caller's deadline, and the reader
wakes every ``POLL_S`` to notice a close.

A receive given up before its data arrived (a timeout) is unposted; if the
reader is writing into it at that moment, the connection is shut down
first, and :meth:`Receive.abandon` returns only once the reader has left
its buffers.  From then on nothing writes them, so the rows may be reused.
"""

from __future__ import annotations

import contextlib
import logging
import operator
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvfunc.core import LLMError
from kvfunc.datadist._errors import (
    CodedError,
    InvalidParamError,
    LinkFailedError,
    PeerProtocolError,
    TransferTimeoutError,
    error_for,
)
from kvfunc.datadist._protocol import MAX_MESSAGE_BYTES, decode, encode

__all__ = ["HEADER", "MAGIC", "MAX_UNCLAIMED_BYTES", "Connection", "Receive", "data_header",
           "frame_bytes"]

log = logging.getLogger("kvfunc.datadist")
HEADER = struct.Struct("<4sB3xQIQ")  # magic, kind, transfer id, frame index, body length
MAGIC = b"KVF1"
CONTROL, DATA = 1, 2
MAX_UNCLAIMED_BYTES = 64 << 20  # replies received and not taken yet
MAX_KEY_CHARS = 256
POLL_S = 0.25  # how often an idle reader looks whether the connection was closed
LEAVE_S = 10.0  # a shut-down reader leaves a receive's buffers within microseconds
_IOV = 1024  # buffers per sendmsg / recvmsg_into call (Linux's IOV_MAX)

Buffers = list[memoryview]
_NBYTES = operator.attrgetter("nbytes")
_SHAPE = operator.attrgetter("format", "ndim")


def frame_bytes(buffers: Buffers) -> int:
    """The bytes of a frame's buffers together.

    >>> frame_bytes([memoryview(b"ab"), memoryview(bytearray(3))])
    5
    """
    return sum(map(_NBYTES, buffers))


def data_header(tid: int, index: int, nbytes: int) -> bytes:
    """The header of data frame ``index`` of transfer ``tid``.

    >>> HEADER.unpack(data_header(7, 1, 4096))
    (b'KVF1', 2, 7, 1, 4096)
    """
    return HEADER.pack(MAGIC, DATA, tid, index, nbytes)


def _timeval(seconds: float) -> bytes:
    """``seconds`` as the ``struct timeval`` that SO_RCVTIMEO / SO_SNDTIMEO take.

    >>> struct.unpack("@ll", _timeval(1.25))
    (1, 250000)
    """
    whole = int(seconds)
    return struct.pack("@ll", whole, max(int((seconds - whole) * 1e6), 1 if not whole else 0))


def _consume(bufs: Buffers, i: int, nbytes: int) -> int:
    """Mark ``nbytes`` of ``bufs[i:]`` done (a partial one is cut in place); the index of
    the first buffer with bytes left.  The buffers are flat byte views.

    >>> bufs = [memoryview(b"ab"), memoryview(b"cde"), memoryview(b"")]
    >>> _consume(bufs, 0, 3), bytes(bufs[1])
    (1, b'de')
    >>> _consume(bufs, 1, 2)
    3
    >>> _consume([memoryview(b"ab"), memoryview(b"c")], 0, 3)
    2
    """
    end = min(i + _IOV, len(bufs))
    if nbytes == frame_bytes(bufs[i:end]):  # the whole window went: the common case
        i, nbytes = end, 0
    while nbytes:
        size = bufs[i].nbytes
        if nbytes >= size:
            nbytes -= size
            i += 1
        else:
            bufs[i], nbytes = bufs[i][nbytes:], 0
    while i < len(bufs) and bufs[i].nbytes == 0:
        i += 1
    return i


def _again(error: LLMError) -> LLMError:
    """A fresh error of ``error``'s class and message (an exception object is raised in
    one thread only)."""
    text = str(error).removeprefix(f"{error.status_code.name}: ")
    return type(error)(text) if isinstance(error, CodedError) else error_for(error.status_code,
                                                                                text)


class Receive:
    """Buffers posted for the data frames of one transfer; the reader fills them in order."""

    def __init__(self, conn: Connection, tid: int, frames: Sequence[Buffers]) -> None:
        self.conn, self.tid = conn, tid
        self.frames = [list(f) for f in frames]
        self.lengths = [frame_bytes(f) for f in self.frames]
        self.arrived = 0
        self.cancelled = False
        self.lock = threading.Lock()  # held by the reader while it writes the buffers
        self.cond = threading.Condition()

    def fill(self, index: int, length: int) -> None:
        """Read data frame ``index`` (``length`` bytes) into its buffers (reader thread)."""
        with self.lock:
            if self.cancelled:
                raise PeerProtocolError(f"data for transfer {self.tid} after it was given up")
            if index != self.arrived or length != self.lengths[index]:
                raise PeerProtocolError(
                    f"transfer {self.tid} expects frame {self.arrived} of "
                    f"{self.lengths[self.arrived]} bytes, the peer sent frame {index} of "
                    f"{length} bytes")
            self.conn.read_into(self.frames[index])
            if index + 1 == len(self.frames):
                self.conn.unpost(self.tid)  # complete: more data for it breaks the protocol
        with self.cond:
            self.arrived += 1
            self.cond.notify_all()

    def wait(self, upto: int, timeout_s: float) -> None:
        """Return once frames ``0 .. upto`` are in place.

        Raises:
            TransferTimeoutError: not within ``timeout_s``.
            LinkFailedError: the connection failed (the peer closed it or broke
                the protocol).
        """
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while self.arrived <= upto:
                failure = self.conn.failure
                if failure is not None:
                    raise _again(failure)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferTimeoutError(f"frame {upto} of transfer {self.tid} did not "
                                               f"arrive within {timeout_s:.3f} s")
                self.cond.wait(min(left, POLL_S))

    def abandon(self) -> bool:
        """Unpost; True once nothing can write the buffers any more.

        If the reader is writing them now, the connection is shut down first
        (the link is lost anyway: its stream is cut mid-frame).
        """
        self.conn.unpost(self.tid)
        if not self.lock.acquire(blocking=False):
            self.conn.fail(TransferTimeoutError(
                f"transfer {self.tid} was given up while its data was arriving"))
            if not self.lock.acquire(timeout=LEAVE_S):
                log.error("the reader did not leave transfer %d's buffers", self.tid)
                return False
        self.cancelled = True
        self.lock.release()
        return True


class Connection:
    """A framed TCP connection (see the module docstring)."""

    def __init__(self, sock: socket.socket, name: str, timeout_s: float) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # Blocking calls with the kernel's own timeouts: a receive waits at most POLL_S (the
        # reader then looks whether the connection was closed), a send at most what its
        # deadline leaves.  One call moves as much as the kernel can; Python's own timeouts
        # would poll and make a non-blocking call per socket buffer.
        sock.settimeout(None)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(POLL_S))
        self.rsock, self.wsock = sock, sock.dup()
        self.name, self.timeout_s = name, timeout_s
        self.failure: LLMError | None = None
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._mail_cond = threading.Condition(self._lock)
        self._mail: dict[str, tuple[dict[str, Any], int]] = {}
        self._mail_bytes = 0
        self._posted: dict[int, Receive] = {}
        self._on_request: Callable[[dict[str, Any]], None] = lambda message: None
        self._on_failure: Callable[[LLMError], None] = lambda error: None
        self._thread: threading.Thread | None = None
        self._closed = False
        self._read_deadline: float | None = None  # only while reading a handshake

    # -- reading -------------------------------------------------------------------------
    def _recv(self, window: Buffers) -> int:
        while True:
            if self.failure is not None:
                raise _again(self.failure)
            if self._read_deadline is not None and time.monotonic() > self._read_deadline:
                raise TransferTimeoutError(f"{self.name}: the peer sent nothing whole in time")
            try:  # MSG_WAITALL: one wake-up per window, not one per arriving segment
                got = self.rsock.recvmsg_into(window, 0, socket.MSG_WAITALL)[0]
            except (BlockingIOError, TimeoutError, InterruptedError):
                continue
            if got == 0:
                raise LinkFailedError(f"{self.name}: the peer closed the connection")
            return got

    def read_into(self, buffers: Buffers) -> None:
        """Fill ``buffers`` in order from the socket (the reader thread only)."""
        bufs, i = list(buffers), 0
        while i < len(bufs):
            i = _consume(bufs, i, self._recv(bufs[i:i + _IOV]))

    def _read_exact(self, nbytes: int) -> bytes:
        out = bytearray(nbytes)
        self.read_into([memoryview(out)])
        return bytes(out)

    def _read_frame(self, max_control: int) -> tuple[int, int, int, int]:
        magic, kind, tid, index, length = HEADER.unpack(self._read_exact(HEADER.size))
        if magic != MAGIC or kind not in (CONTROL, DATA):
            raise PeerProtocolError(f"{self.name}: not a kvfunc frame ({magic!r}, kind {kind})")
        if kind == CONTROL and length > max_control:
            raise PeerProtocolError(f"{self.name}: a control message of {length} bytes is "
                                    f"over the limit of {max_control}")
        return kind, tid, index, length

    def read_control(self, timeout_s: float, max_bytes: int) -> dict[str, Any]:
        """Read one control message before :meth:`start` (a handshake), within ``timeout_s``.

        Raises:
            TransferTimeoutError: nothing whole arrived in time.
            PeerProtocolError: not a control message of at most ``max_bytes``.
            LinkFailedError: the peer closed the connection.
        """
        self._read_deadline = time.monotonic() + timeout_s
        try:
            kind, _, _, length = self._read_frame(max_bytes)
            if kind != CONTROL:
                raise PeerProtocolError(f"{self.name}: data before the handshake ended")
            return decode(self._read_exact(length))
        except InvalidParamError as exc:
            raise PeerProtocolError(f"{self.name}: {exc}") from None
        finally:
            self._read_deadline = None

    def start(self, on_request: Callable[[dict[str, Any]], None],
              on_failure: Callable[[LLMError], None]) -> None:
        """Start the reading thread: requests go to ``on_request`` (which must not block
        for long), and ``on_failure`` runs once if the connection fails."""
        self._on_request, self._on_failure = on_request, on_failure
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"kvfunc-{self.name}-reader")
        self._thread.start()

    def _run(self) -> None:
        try:
            while True:
                kind, tid, index, length = self._read_frame(MAX_MESSAGE_BYTES)
                if kind == DATA:
                    with self._lock:
                        receive = self._posted.get(tid)
                    if receive is None:
                        raise PeerProtocolError(f"{self.name}: data for transfer {tid}, "
                                                "which expects none")
                    receive.fill(index, length)
                    continue
                raw = self._read_exact(length)
                try:
                    message = decode(raw)
                except InvalidParamError as exc:
                    raise PeerProtocolError(f"{self.name}: {exc}") from None
                self._route(message, len(raw))
        except LLMError as exc:
            self.fail(exc)
        except BaseException as exc:  # a bug here must not leave waiters hanging
            log.exception("%s: the reading thread failed", self.name)
            self.fail(LinkFailedError(f"{self.name}: the reading thread failed: {exc!r:.200}"))
        finally:
            if self._closed:
                self._close_sockets()

    def _route(self, message: dict[str, Any], nbytes: int) -> None:
        if "reply" not in message:
            if not isinstance(message.get("op"), str):
                raise PeerProtocolError(f"{self.name}: a request needs an 'op'")
            self._on_request(message)
            return
        key, body = message["reply"], message.get("body")
        if not isinstance(key, str) or len(key) > MAX_KEY_CHARS or not isinstance(body, dict):
            raise PeerProtocolError(f"{self.name}: a reply needs a short 'reply' key and a "
                                    "'body' object")
        with self._mail_cond:
            if key in self._mail:
                raise PeerProtocolError(f"{self.name}: a second reply at {key!r}")
            if self._mail_bytes + nbytes > MAX_UNCLAIMED_BYTES:
                raise PeerProtocolError(f"{self.name}: over {MAX_UNCLAIMED_BYTES} bytes of "
                                        "replies nobody asked for")
            self._mail[key] = (body, nbytes)
            self._mail_bytes += nbytes
            self._mail_cond.notify_all()

    def take(self, key: str, timeout_s: float) -> dict[str, Any]:
        """Wait up to ``timeout_s`` for the reply at ``key`` and remove it.

        Raises:
            TransferTimeoutError: nothing arrived in time.
            LinkFailedError: the connection failed.
        """
        deadline = time.monotonic() + timeout_s
        with self._mail_cond:
            while key not in self._mail:
                if self.failure is not None:
                    raise _again(self.failure)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferTimeoutError(f"{self.name}: no reply at {key!r} within "
                                               f"{timeout_s:.3f} s")
                self._mail_cond.wait(min(left, POLL_S))
            body, nbytes = self._mail.pop(key)
            self._mail_bytes -= nbytes
            return body

    def expect(self, tid: int, frames: Sequence[Buffers]) -> Receive:
        """Post buffers for the data frames of transfer ``tid`` (before the peer sends)."""
        receive = Receive(self, tid, frames)
        with self._lock:
            if tid in self._posted:
                raise InvalidParamError(f"transfer {tid} already expects data")
            self._posted[tid] = receive
        return receive

    def unpost(self, tid: int) -> None:
        """Forget transfer ``tid``'s receive (later data for it breaks the protocol)."""
        with self._lock:
            self._posted.pop(tid, None)

    # -- sending -------------------------------------------------------------------------
    def send(self, header: bytes, buffers: Sequence[memoryview], timeout_s: float,
             *, before_tail: Callable[[], None] | None = None) -> None:
        """Send one frame within ``timeout_s``; ``before_tail`` runs before its last bytes go.

        ``buffers`` are sent as they lie (views of other shapes or formats
        are viewed as flat bytes first).

        The last bytes are copied first, so ``before_tail`` may release what
        ``buffers`` view, and the peer cannot have the whole frame before it ran.

        Raises:
            TransferTimeoutError: the peer did not take it in time (the
                connection fails: its stream is cut).
            LinkFailedError: the connection is closed or failed.
        """
        deadline = time.monotonic() + timeout_s
        parts = [memoryview(header), *buffers]
        if set(map(_SHAPE, buffers)) - {("B", 1)}:  # not all flat byte views: make them so
            parts[1:] = [memoryview(b).cast("B") for b in buffers]
        tail: list[memoryview] = []
        if before_tail is not None:
            keep = min(64, parts[-1].nbytes)
            tail = [memoryview(bytes(parts[-1][parts[-1].nbytes - keep:]))]
            parts[-1] = parts[-1][:parts[-1].nbytes - keep]
        if not self._send_lock.acquire(timeout=max(timeout_s, 0.0)):
            raise TransferTimeoutError(f"{self.name}: busy sending for {timeout_s:.3f} s")
        try:
            self._send_all(parts, deadline)
            if before_tail is not None:
                before_tail()
                self._send_all(tail, deadline)
        finally:
            self._send_lock.release()

    def _send_all(self, parts: Buffers, deadline: float) -> None:
        i = 0
        while i < len(parts):
            if self.failure is not None:
                raise _again(self.failure)
            left = deadline - time.monotonic()
            try:
                if left <= 0:
                    raise TimeoutError
                self.wsock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(left))
                try:
                    sent = self.wsock.sendmsg(parts[i:i + _IOV])
                except (BlockingIOError, InterruptedError):  # nothing taken in time: look again
                    continue
            except TimeoutError:
                error: LLMError = TransferTimeoutError(f"{self.name}: the peer did not take "
                                                       "a frame in time")
                self.fail(error)
                raise _again(error) from None
            except OSError as exc:
                self.fail(LinkFailedError(f"{self.name}: sending failed: {exc}"))
                raise _again(self.failure or LinkFailedError(str(exc))) from None
            i = _consume(parts, i, sent)

    def send_control(self, message: dict[str, Any], timeout_s: float | None = None) -> None:
        """Send one control message (within the link's timeout unless told)."""
        payload = encode(message)
        self.send(HEADER.pack(MAGIC, CONTROL, 0, 0, len(payload)), [memoryview(payload)],
                  self.timeout_s if timeout_s is None else timeout_s)

    def put(self, key: str, message: dict[str, Any]) -> None:
        """Send a reply for the peer's reader of ``key``."""
        self.send_control({"reply": key, "body": message})

    def post(self, message: dict[str, Any]) -> None:
        """Send a request (it has an ``op``)."""
        self.send_control(message)

    # -- failing and closing -------------------------------------------------------------
    def fail(self, error: LLMError) -> None:
        """Fail the connection (the first error wins): shut it down, wake every waiter."""
        with self._lock:
            if self.failure is not None:
                return
            self.failure = error
            receives = list(self._posted.values())
            self._mail_cond.notify_all()
        with contextlib.suppress(OSError):
            self.rsock.shutdown(socket.SHUT_RDWR)
        for receive in receives:
            with receive.cond:
                receive.cond.notify_all()
        if not self._closed:
            self._on_failure(error)

    def close(self, linger_s: float = 0.0) -> None:
        """Close: let the peer see the end of the stream, wait up to ``linger_s`` for it to
        close its side too, then shut down and release the sockets."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            self.wsock.shutdown(socket.SHUT_WR)
        reader = self._thread
        own = reader is threading.current_thread()
        if reader is not None and not own and linger_s > 0:
            reader.join(linger_s)
        self.fail(LinkFailedError(f"{self.name}: the link is closed"))
        if reader is not None and not own:
            reader.join(LEAVE_S)
        if reader is None or not reader.is_alive():
            self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self.rsock, self.wsock):
            with contextlib.suppress(OSError):
                sock.close()
