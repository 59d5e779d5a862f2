"""Errors of a remote block store, and Mooncake Store's error codes mapped onto them.

Every class derives from :class:`StoreError` (a :class:`kvfunc.KVFuncError`)
and from the builtin an ordinary caller would catch: ``ConnectionError``
when the store cannot be reached, ``TimeoutError`` for a deadline,
``MemoryError`` when it has no room, ``KeyError`` for an object it does not
hold, ``ValueError`` for bytes that are not what was asked or arguments it
refused.  ``code`` keeps the store's own code (``None`` when it gave none)
and ``code_name`` its name.

:func:`mooncake_error` maps each code of Mooncake Store's ``ErrorCode``
(``mooncake-store/include/types.h``) to one class; the table is
:data:`MOONCAKE_ERROR_CODES`.  A code it does not know becomes a plain
:class:`StoreError`.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvfunc.core import KVFuncError

__all__ = [
    "MOONCAKE_ERROR_CODES",
    "StoreConflictError",
    "StoreDataError",
    "StoreError",
    "StoreFullError",
    "StoreMissError",
    "StoreRequestError",
    "StoreTimeoutError",
    "StoreUnavailableError",
    "mooncake_error",
]


class StoreError(KVFuncError, RuntimeError):
    """A remote store operation failed; ``code`` is the store's own code, if any."""

    def __init__(self, message: str, *, code: int | None = None, code_name: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.code_name = code_name

    def __str__(self) -> str:  # KeyError would quote the message; keep it readable
        return str(self.args[0]) if self.args else ""


class StoreUnavailableError(StoreError, ConnectionError):
    """The store (its master or metadata service) cannot be reached, or the client is closed."""


class StoreTimeoutError(StoreError, TimeoutError):
    """A call did not return in time.

    ``busy_block_ids`` are the host blocks the call may still write: they
    must not be reused until :meth:`MooncakeStore.wait_idle` returns True.
    """

    def __init__(self, message: str, *, busy_block_ids: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.busy_block_ids = tuple(busy_block_ids)


class StoreFullError(StoreError, MemoryError):
    """The store has no room for the object."""


class StoreMissError(StoreError, KeyError):
    """The store does not hold the object (never stored, evicted, removed, not yet readable)."""


class StoreDataError(StoreError, ValueError):
    """The object exists but its bytes cannot be used: wrong size, a failed or expired read."""


class StoreConflictError(StoreError):
    """The object is in use (a lease, a replication task) or already exists."""


class StoreRequestError(StoreError, ValueError):
    """The store refused the request's arguments (a bad key, size or client)."""


_CODES: dict[int, tuple[str, type[StoreError]]] = {
    -1: ("INTERNAL_ERROR", StoreError),
    -10: ("BUFFER_OVERFLOW", StoreFullError),
    -100: ("SHARD_INDEX_OUT_OF_RANGE", StoreRequestError),
    -101: ("SEGMENT_NOT_FOUND", StoreFullError),
    -102: ("SEGMENT_ALREADY_EXISTS", StoreConflictError),
    -103: ("CLIENT_NOT_FOUND", StoreUnavailableError),
    -200: ("NO_AVAILABLE_HANDLE", StoreFullError),
    -300: ("INVALID_VERSION", StoreRequestError),
    -400: ("INVALID_KEY", StoreRequestError),
    -500: ("WRITE_FAIL", StoreDataError),
    -600: ("INVALID_PARAMS", StoreRequestError),
    -601: ("ILLEGAL_CLIENT", StoreRequestError),
    -700: ("INVALID_WRITE", StoreDataError),
    -701: ("INVALID_READ", StoreDataError),
    -702: ("INVALID_REPLICA", StoreDataError),
    -703: ("REPLICA_IS_NOT_READY", StoreMissError),
    -704: ("OBJECT_NOT_FOUND", StoreMissError),
    -705: ("OBJECT_ALREADY_EXISTS", StoreConflictError),
    -706: ("OBJECT_HAS_LEASE", StoreConflictError),
    -707: ("LEASE_EXPIRED", StoreDataError),
    -708: ("OBJECT_HAS_REPLICATION_TASK", StoreConflictError),
    -709: ("OBJECT_NO_REPLICATION_TASK", StoreConflictError),
    -710: ("REPLICA_NOT_FOUND", StoreMissError),
    -711: ("REPLICA_ALREADY_EXISTS", StoreConflictError),
    -712: ("REPLICA_IS_GONE", StoreMissError),
    -800: ("TRANSFER_FAIL", StoreDataError),
    -900: ("RPC_FAIL", StoreUnavailableError),
    -1000: ("ETCD_OPERATION_ERROR", StoreUnavailableError),
    -1001: ("ETCD_KEY_NOT_EXIST", StoreUnavailableError),
    -1002: ("ETCD_TRANSACTION_FAIL", StoreUnavailableError),
    -1003: ("ETCD_CTX_CANCELLED", StoreUnavailableError),
    -1010: ("UNAVAILABLE_IN_CURRENT_STATUS", StoreUnavailableError),
    -1011: ("UNAVAILABLE_IN_CURRENT_MODE", StoreUnavailableError),
    -1100: ("FILE_NOT_FOUND", StoreMissError),
    -1101: ("FILE_OPEN_FAIL", StoreDataError),
    -1102: ("FILE_READ_FAIL", StoreDataError),
    -1103: ("FILE_WRITE_FAIL", StoreDataError),
    -1104: ("FILE_INVALID_BUFFER", StoreDataError),
    -1105: ("FILE_LOCK_FAIL", StoreConflictError),
    -1106: ("FILE_INVALID_HANDLE", StoreDataError),
    -1200: ("BUCKET_NOT_FOUND", StoreMissError),
    -1201: ("BUCKET_ALREADY_EXISTS", StoreConflictError),
    -1202: ("KEYS_EXCEED_BUCKET_LIMIT", StoreFullError),
    -1203: ("KEYS_ULTRA_LIMIT", StoreFullError),
    -1300: ("UNABLE_OFFLOAD", StoreRequestError),
    -1301: ("UNABLE_OFFLOADING", StoreConflictError),
    -1400: ("TASK_NOT_FOUND", StoreMissError),
    -1401: ("TASK_PENDING_LIMIT_EXCEEDED", StoreFullError),
}

MOONCAKE_ERROR_CODES: dict[int, tuple[str, type[StoreError]]] = dict(_CODES)
"""``{code: (name, class)}`` for every error code of Mooncake Store (``ErrorCode``)."""


def mooncake_error(code: int, what: str, *, reading: bool = False) -> StoreError:
    """The typed error for Mooncake Store's ``code`` (a negative int), about ``what``.

    ``reading``: the code answers a read into a buffer, where
    ``INVALID_PARAMS`` (-600) means the stored object is larger than the
    buffer (a :class:`StoreDataError`, not a refused request).

    >>> e = mooncake_error(-704, "get of 'k'")
    >>> type(e).__name__, e.code, e.code_name, str(e)
    ('StoreMissError', -704, 'OBJECT_NOT_FOUND', "get of 'k': OBJECT_NOT_FOUND (-704)")
    >>> type(mooncake_error(-600, "get of 'k'", reading=True)).__name__
    'StoreDataError'
    >>> type(mooncake_error(-4242, "put")).__name__, isinstance(mooncake_error(-900, "x"),
    ...                                                         ConnectionError)
    ('StoreError', True)
    """
    name, cls = _CODES.get(code, ("UNKNOWN", StoreError))
    if reading and code == -600:
        cls = StoreDataError
    return cls(f"{what}: {name} ({code})", code=code, code_name=name)
