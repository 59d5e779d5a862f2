"""Event batches as msgpack bytes, laid out as vLLM's msgspec encoding lays them out.

Theory of operation
-------------------
vLLM encodes its events with msgspec ``Struct`` classes declared
``array_like=True, omit_defaults=True`` and, for events, ``tag=True``: a
record is a msgpack array of its fields in declaration order, an event's
array starts with its tag (the class name).  msgspec writes every field of
an array-like record, and reads a record whose trailing fields are missing
(they take their default) or extra (they are ignored).  The same layout
here, where ``?`` marks kvfunc's extensions, written only when they differ
from their default (so an event without them is byte-for-byte vLLM's)::

    batch         [ts, [event, ...], data_parallel_rank]
    BlockStored   ["BlockStored", block_hashes, parent_block_hash, token_ids,
                   block_size, lora_id, medium, group?, block_ids?]
    BlockRemoved  ["BlockRemoved", block_hashes, medium, group?, block_ids?]
    AllBlocksCleared  ["AllBlocksCleared", groups?]

Hashes are msgpack ``bin``, strings ``str``, ``ts`` a float64.  A decoder
built from vLLM's own structs reads these bytes (it ignores the trailing
kvfunc fields), and :func:`decode_event_batch` reads vLLM's (the missing
trailing fields take their defaults).  Nothing is ever pickled: decoding
builds only the records above, from plain msgpack values it checks one by
one, so malformed bytes raise :class:`~kvfunc.InvalidArgumentError`.
"""

from __future__ import annotations

from typing import Any

import msgpack

from kvfunc.core import InvalidArgumentError, InvalidTypeError
from kvfunc.core._internal import excerpt
from kvfunc.events._events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventBatch,
)

__all__ = ["decode_event_batch", "encode_event_batch"]

_MAX_BYTES = 1 << 30  # larger payloads are refused before they are read


def _trim(fields: list[Any], defaults: tuple[Any, ...]) -> list[Any]:
    """Drop trailing extension fields (the last ``len(defaults)``) equal to their default."""
    n = len(fields)
    first_default = n - len(defaults)
    while n > first_default and fields[n - 1] == defaults[n - 1 - first_default]:
        n -= 1
    return fields[:n]


def _event_array(e: object) -> list[Any]:
    if type(e) is BlockStored:
        ids = None if e.block_ids is None else list(e.block_ids)
        return _trim(["BlockStored", list(e.block_hashes), e.parent_block_hash,
                      list(e.token_ids), e.block_size, e.lora_id, e.medium, e.group, ids],
                     ("", None))
    if type(e) is BlockRemoved:
        ids = None if e.block_ids is None else list(e.block_ids)
        return _trim(["BlockRemoved", list(e.block_hashes), e.medium, e.group, ids],
                     ("", None))
    if type(e) is AllBlocksCleared:
        return _trim(["AllBlocksCleared", list(e.groups)], ([],))
    raise InvalidTypeError(f"not a KV event: {type(e).__name__}")


def encode_event_batch(batch: KVEventBatch) -> bytes:
    """The msgpack bytes of ``batch`` (see the module docstring for the layout).

    Raises:
        InvalidTypeError: ``batch`` is not a :class:`KVEventBatch`, or holds
            something that is not an event or a field of a wrong type.

    >>> data = encode_event_batch(KVEventBatch(1.5, (AllBlocksCleared(),)))
    >>> data
    b'\\x93\\xcb?\\xf8\\x00\\x00\\x00\\x00\\x00\\x00\\x91\\x91\\xb0AllBlocksCleared\\xc0'
    >>> decode_event_batch(data) == KVEventBatch(1.5, (AllBlocksCleared(),))
    True
    """
    if not isinstance(batch, KVEventBatch):
        raise InvalidTypeError(f"batch must be a KVEventBatch, got {type(batch).__name__}")
    events = [_event_array(e) for e in batch.events]
    if isinstance(batch.ts, bool) or not isinstance(batch.ts, int | float):
        raise InvalidTypeError(f"ts must be a float, got {excerpt(batch.ts)}")
    body = [float(batch.ts), events, batch.data_parallel_rank]
    try:
        return msgpack.packb(body, use_bin_type=True)  # type: ignore[no-any-return]
    except (TypeError, ValueError, OverflowError) as exc:
        raise InvalidTypeError(f"cannot encode the batch: {exc}") from None


# -- decoding -----------------------------------------------------------------------

def _fail(msg: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"malformed KV event batch: {msg}")


def _int(v: Any, what: str, *, minimum: int | None = None) -> int:
    if type(v) is not int or (minimum is not None and v < minimum):
        raise _fail(f"{what} must be an int{'' if minimum is None else f' >= {minimum}'}, "
                    f"got {excerpt(v)}")
    return v


def _opt(v: Any, kind: type, what: str) -> Any:
    if v is not None and type(v) is not kind:
        raise _fail(f"{what} must be a {kind.__name__} or nil, got {excerpt(v)}")
    return v


def _list(v: Any, what: str) -> list[Any]:
    if type(v) is not list:
        raise _fail(f"{what} must be an array, got {excerpt(v)}")
    return v


def _hashes(v: Any, what: str) -> tuple[bytes, ...]:
    items = _list(v, what)
    if not all(type(h) is bytes for h in items):
        raise _fail(f"{what} must be an array of bin")
    return tuple(items)


def _ints(v: Any, what: str, *, minimum: int | None = None) -> tuple[int, ...]:
    return tuple(_int(x, what, minimum=minimum) for x in _list(v, what))


def _fields(arr: list[Any], required: int, defaults: tuple[Any, ...]) -> list[Any]:
    """The fields after the tag, missing trailing ones set to their defaults."""
    fields = arr[1:]
    if len(fields) < required:
        raise _fail(f"{arr[0]} needs at least {required} fields, got {len(fields)}")
    total = required + len(defaults)
    return fields[:total] + list(defaults[len(fields) - required:])


def _block_ids(v: Any, n: int, tag: str) -> tuple[int, ...] | None:
    if v is None:
        return None
    ids = _ints(v, f"{tag}.block_ids", minimum=0)
    if len(ids) != n:
        raise _fail(f"{tag} has {len(ids)} block ids for {n} hashes")
    return ids


def _event(arr: Any) -> KVCacheEvent:
    if type(arr) is not list or not arr or type(arr[0]) is not str:
        raise _fail(f"an event must be an array starting with its tag, got {excerpt(arr)}")
    tag = arr[0]
    if tag == "BlockStored":
        hashes_, parent, tokens, size, lora, medium, group, ids = _fields(
            arr, 4, (None, None, "", None))
        hashes = _hashes(hashes_, "BlockStored.block_hashes")
        return BlockStored(
            hashes, _opt(parent, bytes, "BlockStored.parent_block_hash"),
            _ints(tokens, "BlockStored.token_ids"),
            _int(size, "BlockStored.block_size", minimum=1),
            None if lora is None else _int(lora, "BlockStored.lora_id"),
            _opt(medium, str, "BlockStored.medium"), _opt(group, str, "BlockStored.group") or "",
            _block_ids(ids, len(hashes), tag))
    if tag == "BlockRemoved":
        hashes_, medium, group, ids = _fields(arr, 1, (None, "", None))
        hashes = _hashes(hashes_, "BlockRemoved.block_hashes")
        return BlockRemoved(hashes, _opt(medium, str, "BlockRemoved.medium"),
                            _opt(group, str, "BlockRemoved.group") or "",
                            _block_ids(ids, len(hashes), tag))
    if tag == "AllBlocksCleared":
        (groups,) = _fields(arr, 0, ([],))
        items = _list(groups, "AllBlocksCleared.groups")
        if not all(type(g) is str for g in items):
            raise _fail("AllBlocksCleared.groups must be an array of str")
        return AllBlocksCleared(tuple(items))
    raise _fail(f"unknown event tag {excerpt(tag)}")


def decode_event_batch(data: bytes | bytearray | memoryview) -> KVEventBatch:
    """The batch that :func:`encode_event_batch` (or vLLM) encoded into ``data``.

    Fields after the known ones are ignored (a newer publisher's additions),
    as msgspec ignores them.

    Raises:
        InvalidTypeError: ``data`` is not bytes-like.
        InvalidArgumentError: ``data`` is not a well-formed event batch.

    >>> decode_event_batch(b"\\x92\\xcb?\\xf8\\x00\\x00\\x00\\x00\\x00\\x00\\x90")
    KVEventBatch(ts=1.5, events=(), data_parallel_rank=None)
    >>> decode_event_batch(b"\\x92\\x01")
    Traceback (most recent call last):
    ...
    kvfunc.core._errors.InvalidArgumentError: malformed KV event batch: ...
    """
    if not isinstance(data, bytes | bytearray | memoryview):
        raise InvalidTypeError(f"data must be bytes, got {type(data).__name__}")
    if len(data) > _MAX_BYTES:
        raise _fail(f"{len(data)} bytes is more than the limit of {_MAX_BYTES}")
    try:
        obj = msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=True)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise _fail(f"{type(exc).__name__}: {exc}") from None
    if type(obj) is not list or len(obj) < 2:
        msg = f"a batch must be an array [ts, events, data_parallel_rank?], got {excerpt(obj)}"
        raise _fail(msg)
    ts, events = obj[0], obj[1]
    rank = obj[2] if len(obj) > 2 else None
    if type(ts) not in (float, int):
        raise _fail(f"ts must be a float, got {excerpt(ts)}")
    rank = None if rank is None else _int(rank, "data_parallel_rank")
    return KVEventBatch(float(ts), tuple(_event(e) for e in _list(events, "events")), rank)
