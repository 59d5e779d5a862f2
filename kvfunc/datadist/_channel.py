"""The control channel: JSON messages over a torch ``TCPStore``.

The listening cluster runs the store's server; both ends of a link are its
clients.  Two shapes of exchange are built from the store's ``set``, ``add``,
``wait``, ``get`` and ``delete_key``:

* a **queue** ``name``: a sender takes the next number with ``add`` and
  writes ``name/<n>``; the one reader waits for ``name/1``, ``name/2``, ...
  in order and deletes each after reading;
* a **reply key**: the one writer ``set``\\ s it, the one reader waits for
  it with a deadline, reads and deletes it.

Messages are JSON (:mod:`kvfunc.datadist._protocol`); nothing is pickled.
A store connection serves one operation at a time, so connections are
pooled per store and lent out per operation (a new one only when all are
busy, one connect at a time; a failed one is dropped).
"""

from __future__ import annotations

import contextlib
import datetime
import threading
from collections.abc import Iterator
from typing import Any, ClassVar

from torch._C._distributed_c10d import TCPStore
from torch.distributed import DistError, DistStoreError

from kvfunc.datadist._errors import InvalidParamError, LinkFailedError, TransferTimeoutError
from kvfunc.datadist._protocol import decode, encode

__all__ = ["FOREVER_S", "QueueReader", "StoreChannel", "start_store_server"]

FOREVER_S = 3600.0  # how long a reader with nothing to do waits before it looks again
_CONNECT = threading.Lock()  # one connect at a time: a burst overflows the server's backlog


class _Clients:
    """Idle connections to one store, reused by whichever thread needs one next."""

    _all: ClassVar[dict[tuple[str, int, float], _Clients]] = {}
    _all_lock = threading.Lock()

    def __init__(self, host: str, port: int, timeout_s: float) -> None:
        self.host, self.port, self.timeout_s = host, port, timeout_s
        self.idle: list[TCPStore] = []
        self.lock = threading.Lock()

    @classmethod
    def of(cls, host: str, port: int, timeout_s: float) -> _Clients:
        with cls._all_lock:
            found = cls._all.get((host, port, timeout_s))
            if found is None:
                found = cls._all[(host, port, timeout_s)] = cls(host, port, timeout_s)
            return found

    @contextlib.contextmanager
    def client(self) -> Iterator[TCPStore]:
        """A connection for one operation; dropped (not reused) if the operation fails."""
        with self.lock:
            store = self.idle.pop() if self.idle else None
        if store is None:
            try:
                with _CONNECT:
                    store = TCPStore(self.host, self.port, is_master=False,
                                     timeout=datetime.timedelta(seconds=self.timeout_s))
            except (DistError, RuntimeError) as exc:
                msg = f"cannot reach the store at {self.host}:{self.port}: {exc}"
                raise LinkFailedError(msg) from None
        try:
            yield store
        except DistStoreError as exc:
            if "timeout" in str(exc).lower():  # a wait that expired: the connection is fine
                with self.lock:
                    self.idle.append(store)
            raise
        else:
            with self.lock:
                self.idle.append(store)


def start_store_server(host: str, port: int, timeout_s: float) -> TCPStore:
    """Start a store server on ``host:port`` (port 0 picks a free one; see ``.port``).

    Raises:
        LinkFailedError: the address cannot be bound.
    """
    try:
        return TCPStore(host, port, is_master=True, wait_for_workers=False,
                        timeout=datetime.timedelta(seconds=timeout_s))
    except (DistError, RuntimeError, OSError) as exc:
        raise LinkFailedError(f"cannot listen on {host}:{port}: {exc}") from None


class StoreChannel:
    """Queues and reply keys under ``prefix`` in the store at ``host:port``.

    Each thread connects on first use, with ``timeout_s`` for the store's
    own operations; waits take their own deadline.
    """

    def __init__(self, host: str, port: int, prefix: str, timeout_s: float) -> None:
        self.host, self.port, self.prefix, self.timeout_s = host, port, prefix, timeout_s
        self._clients = _Clients.of(host, port, timeout_s)

    @staticmethod
    def _lost(exc: Exception) -> LinkFailedError:
        return LinkFailedError(f"control channel lost: {str(exc).splitlines()[0]}")

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}"

    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to counter ``key``; the new value."""
        try:
            with self._clients.client() as store:
                return int(store.add(self._key(key), amount))
        except DistError as exc:
            raise self._lost(exc) from None

    def put(self, key: str, message: dict[str, Any]) -> None:
        """Write a message at a reply key."""
        try:
            with self._clients.client() as store:
                store.set(self._key(key), encode(message).decode())
        except DistError as exc:
            raise self._lost(exc) from None

    def post(self, queue: str, message: dict[str, Any]) -> None:
        """Append a message to ``queue``."""
        self.put(f"{queue}/{self.add(f'{queue}/n', 1)}", message)

    def take(self, key: str, timeout_s: float) -> dict[str, Any]:
        """Wait up to ``timeout_s`` for a message at ``key``, read it and delete it.

        Raises:
            TransferTimeoutError: nothing arrived in time.
            LinkFailedError: the store is gone (its process ended).
            InvalidParamError: the message is not a JSON object.
        """
        full = self._key(key)
        try:
            with self._clients.client() as store:
                store.wait([full], datetime.timedelta(seconds=max(timeout_s, 0.001)))
                raw = store.get(full)
                store.delete_key(full)
        except DistStoreError as exc:
            if "timeout" in str(exc).lower():
                raise TransferTimeoutError(f"no reply at {full!r} within {timeout_s:.3f} s") \
                    from None
            raise self._lost(exc) from None
        except DistError as exc:
            raise self._lost(exc) from None
        return decode(raw)


class QueueReader:
    """Reads one queue of a channel in order (one reader per queue)."""

    def __init__(self, channel: StoreChannel, queue: str) -> None:
        self.channel, self.queue, self.position = channel, queue, 0

    def next(self, timeout_s: float = FOREVER_S) -> dict[str, Any]:
        """The next message, waiting up to ``timeout_s`` (see :meth:`StoreChannel.take`)."""
        try:
            message = self.channel.take(f"{self.queue}/{self.position + 1}", timeout_s)
        except InvalidParamError:
            self.position += 1  # read and deleted, but not JSON: skip it
            raise
        self.position += 1
        return message
