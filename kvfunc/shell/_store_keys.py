"""Remote-store keys of blocks, and the per-block outcome of a batch (pure: no I/O).

A block is stored under a key built from plain inputs::

    kvfunc/1/<namespace>/<group key>/<format>/<block hash, lowercase hex>

``namespace`` names the model and whatever else must keep caches apart
(weights revision, tenant), ``group key`` the attention group whose block it
is, ``format`` the host pool's :attr:`~kvfunc.shell.HostBlockPool.fingerprint`
(dtypes and block shapes, so a cache of another layout never reads these
bytes).  ``namespace`` and ``group key`` are percent-encoded with no safe
characters (``/`` becomes ``%2F``, ``%`` becomes ``%25``), so distinct inputs
always give distinct keys.

A batch reports one outcome per block (:class:`TransferResult`): ``ok``,
``miss`` (the store does not hold the object: never stored, evicted,
removed, not yet readable) or ``failed`` (it holds it but the bytes cannot be
used, or it refused the put).  Both ``miss`` and ``failed`` mean recompute.
"""

from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import quote

import attrs

from kvfunc.core import InvalidArgumentError, InvalidTypeError
from kvfunc.shell._store_errors import StoreDataError, StoreError, mooncake_error

__all__ = ["FAILED", "MISS", "OK", "TransferResult", "block_key", "check_hashes"]

KEY_PREFIX = "kvfunc/1/"
MAX_NAME_CHARS = 256
MAX_HASH_BYTES = 128
OK, MISS, FAILED = "ok", "miss", "failed"
# Codes that say the object is not there (or not readable yet): a miss, not a failure.
MISS_CODES = frozenset({-703, -704, -710, -712})


def _name(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise InvalidTypeError(f"{what} must be a str, but got {value!r}")
    if not value or len(value) > MAX_NAME_CHARS:
        msg = f"{what} must have 1 to {MAX_NAME_CHARS} characters, but got {len(value)}"
        raise InvalidArgumentError(msg)
    return quote(value, safe="")


def key_prefix(namespace: str, group_key: str, fingerprint: str) -> str:
    """The part of every key shared by one namespace, group and block format.

    >>> key_prefix("llama-3/8b", "full", "0f1e")
    'kvfunc/1/llama-3%2F8b/full/0f1e/'
    """
    return (f"{KEY_PREFIX}{_name(namespace, 'namespace')}/{_name(group_key, 'group_key')}/"
            f"{_name(fingerprint, 'fingerprint')}/")


def check_hashes(block_hashes: object) -> list[bytes]:
    """``block_hashes`` as a list of ``bytes`` of 1 to 128 bytes each, or a typed error.

    >>> check_hashes([b"\\x01", bytearray(b"\\x02")])
    [b'\\x01', b'\\x02']
    """
    if isinstance(block_hashes, str | bytes | bytearray) or not isinstance(block_hashes,
                                                                          Sequence):
        raise InvalidTypeError(f"block_hashes must be a sequence of bytes, got {block_hashes!r}")
    out = []
    for i, h in enumerate(block_hashes):
        if not isinstance(h, bytes | bytearray):
            raise InvalidTypeError(f"block_hashes[{i}] must be bytes, but got {h!r}")
        if not 0 < len(h) <= MAX_HASH_BYTES:
            msg = f"block_hashes[{i}] must have 1 to {MAX_HASH_BYTES} bytes, but has {len(h)}"
            raise InvalidArgumentError(msg)
        out.append(bytes(h))
    return out


def block_key(namespace: str, group_key: str, fingerprint: str, block_hash: bytes) -> str:
    """The store key of one block (module docstring).

    Raises:
        InvalidTypeError: a name that is not a str, a hash that is not bytes.
        InvalidArgumentError: an empty or over-long name or hash.

    >>> block_key("m", "g/1", "ab12", bytes([0, 255]))
    'kvfunc/1/m/g%2F1/ab12/00ff'
    """
    (h,) = check_hashes([block_hash])
    return key_prefix(namespace, group_key, fingerprint) + h.hex()


@attrs.frozen(slots=True)
class TransferResult:
    """Per block of a batch: ``outcomes[i]`` (``"ok"``, ``"miss"``, ``"failed"``) and ``codes[i]``.

    ``codes[i]`` is what the store answered for that block: the bytes read
    (a get), ``0`` (a put), or the store's negative error code.
    ``expected_bytes`` is one block's size; ``reading`` tells a get from a put.

    >>> r = TransferResult(("ok", "miss", "failed"), (64, -704, 10), 64, reading=True)
    >>> r.ok, r.missed, r.failed, r.leading_ok
    ((0,), (1,), (2,), 1)
    >>> type(r.error(1)).__name__, str(r.error(2)), r.error(0)
    ('StoreMissError', 'block 2: read 10 bytes, expected 64', None)
    """

    outcomes: tuple[str, ...]
    codes: tuple[int, ...]
    expected_bytes: int
    reading: bool

    def _where(self, outcome: str) -> tuple[int, ...]:
        return tuple(i for i, o in enumerate(self.outcomes) if o == outcome)

    @property
    def ok(self) -> tuple[int, ...]:
        """Positions that were stored or loaded whole."""
        return self._where(OK)

    @property
    def missed(self) -> tuple[int, ...]:
        """Positions the store does not hold (recompute)."""
        return self._where(MISS)

    @property
    def failed(self) -> tuple[int, ...]:
        """Positions the store holds but could not serve or take (recompute)."""
        return self._where(FAILED)

    @property
    def leading_ok(self) -> int:
        """How many positions from the first are ok (a prefix hit ends at the first miss)."""
        n = 0
        while n < len(self.outcomes) and self.outcomes[n] == OK:
            n += 1
        return n

    def error(self, i: int) -> StoreError | None:
        """The typed error of position ``i`` (None when it is ok)."""
        if self.outcomes[i] == OK:
            return None
        code = self.codes[i]
        if code >= 0:
            msg = f"block {i}: read {code} bytes, expected {self.expected_bytes}"
            return StoreDataError(msg)
        return mooncake_error(code, f"block {i}", reading=self.reading)


def outcome_of_get(code: int, expected: int) -> str:
    """The outcome of one get that answered ``code`` (bytes read, or an error code).

    >>> outcome_of_get(64, 64), outcome_of_get(-704, 64), outcome_of_get(32, 64)
    ('ok', 'miss', 'failed')
    """
    if code == expected:
        return OK
    return MISS if code in MISS_CODES else FAILED


def outcome_of_put(code: int) -> str:
    """The outcome of one put: ok when stored, or already stored (keys are write-once).

    >>> outcome_of_put(0), outcome_of_put(-705), outcome_of_put(-200)
    ('ok', 'ok', 'failed')
    """
    return OK if code in (0, -705) else FAILED
