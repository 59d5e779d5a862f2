"""Control messages between two clusters: plain JSON, validated field by field.

Nothing received from a peer is unpickled.  A message is a JSON object; each
field is read through a typed accessor that checks its type and range and
raises :class:`InvalidParamError` for anything else, so a malformed or
hostile message fails before it reaches a tensor.  Errors travel as
``{"ok": false, "code": "<LLMStatusCode name>", "message": ...}`` and come back
as the class of that code (:func:`raise_if_error`).  Pure: no torch.
"""

from __future__ import annotations

import json
import re
from typing import Any

from kvfunc.core import LLMError, LLMStatusCode
from kvfunc.datadist._errors import InvalidParamError, error_for
from kvfunc.datadist._types import MAX_ID, BlocksCacheKey, CacheKey

__all__ = [
    "MAX_DEPTH",
    "MAX_MESSAGE_BYTES",
    "PROTOCOL_VERSION",
    "decode",
    "encode",
    "error_reply",
    "get_bool",
    "get_int",
    "get_ints",
    "get_str",
    "key_from_json",
    "key_to_json",
    "nesting_depth",
    "raise_if_error",
]

# 2: a pull's accept says whether it wants an ack; 3: a pull lists the receives posted;
# 4: links are framed TCP connections (control and data), no store
PROTOCOL_VERSION = 4
MAX_MESSAGE_BYTES = 16 << 20  # a pull of 1M blocks lists ~8 MB of block ids
MAX_DEPTH = 16  # kvfunc's own messages nest 4 deep
_STRINGS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')  # a JSON string, unrolled: linear
_BRACKETS = re.compile(rb"[\[\]{}]")


def encode(message: dict[str, Any]) -> bytes:
    """A message as compact UTF-8 JSON.

    >>> encode({"op": "pull", "tid": 3})
    b'{"op":"pull","tid":3}'
    """
    return json.dumps(message, separators=(",", ":"), allow_nan=False).encode()


def nesting_depth(raw: bytes, limit: int = MAX_DEPTH) -> int:
    """How deep ``raw``'s JSON arrays and objects nest, counted up to ``limit + 1``.

    Brackets inside strings do not count.  It reads no further than the
    first place deeper than ``limit``, so a hostile 100,000-deep message costs
    a few microseconds, and the parser never recurses past ``limit``.

    >>> nesting_depth(b'{"a": [1, [2]], "b": "[[["}')
    3
    >>> nesting_depth(b"[" * 100_000, limit=16)
    17
    """
    depth = deepest = 0
    for match in _BRACKETS.finditer(_STRINGS.sub(b'""', raw)):
        if match.group() in (b"[", b"{"):
            depth += 1
            deepest = max(deepest, depth)
            if deepest > limit:
                break
        else:
            depth -= 1
    return deepest


def decode(raw: bytes) -> dict[str, Any]:
    """A message received from a peer: a JSON object of bounded size and depth.

    Size and depth are checked before the parser sees the message.

    >>> decode(b'{"ok": true}')
    {'ok': True}
    >>> decode(b'[1]')
    Traceback (most recent call last):
    ...
    kvfunc.datadist._errors.InvalidParamError: LLM_PARAM_INVALID: a control message must be ...
    """
    if len(raw) > MAX_MESSAGE_BYTES:
        raise InvalidParamError(f"control message of {len(raw)} bytes is over the limit")
    if nesting_depth(raw) > MAX_DEPTH:
        raise InvalidParamError(f"control message nests deeper than {MAX_DEPTH}")
    try:
        message = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise InvalidParamError(f"control message is not JSON: {exc}") from None
    if not isinstance(message, dict):
        raise InvalidParamError(f"a control message must be a JSON object, got {raw[:80]!r}")
    return message


def get_int(message: dict[str, Any], name: str, lo: int = 0, hi: int = MAX_ID) -> int:
    """Field ``name``: an int in ``[lo, hi]``.

    >>> get_int({"n": 4}, "n", 0, 3)
    Traceback (most recent call last):
    ...
    kvfunc.datadist._errors.InvalidParamError: LLM_PARAM_INVALID: field 'n' must be an int in ...
    """
    value = message.get(name)
    if type(value) is not int or not lo <= value <= hi:
        raise InvalidParamError(f"field {name!r} must be an int in [{lo}, {hi}], got {value!r}")
    return value


def get_ints(message: dict[str, Any], name: str, hi: int, max_len: int = 1 << 24
             ) -> list[int]:
    """Field ``name``: a list of ints, each in ``[0, hi)`` — block indices are checked here.

    >>> get_ints({"rows": [0, 2]}, "rows", 3)
    [0, 2]
    >>> get_ints({"rows": [0, 3]}, "rows", 3)
    Traceback (most recent call last):
    ...
    kvfunc.datadist._errors.InvalidParamError: LLM_PARAM_INVALID: field 'rows' holds 3, ...
    """
    value = message.get(name)
    if not isinstance(value, list) or len(value) > max_len:
        raise InvalidParamError(f"field {name!r} must be a list of at most {max_len} ints")
    for item in value:
        if type(item) is not int or not 0 <= item < hi:
            raise InvalidParamError(f"field {name!r} holds {item!r}, outside [0, {hi})")
    return value


def get_str(message: dict[str, Any], name: str, max_len: int = 4096) -> str:
    """Field ``name``: a string of bounded length."""
    value = message.get(name)
    if not isinstance(value, str) or len(value) > max_len:
        raise InvalidParamError(f"field {name!r} must be a string, got {value!r:.80}")
    return value


def get_bool(message: dict[str, Any], name: str) -> bool:
    """Field ``name``: a boolean."""
    value = message.get(name)
    if type(value) is not bool:
        raise InvalidParamError(f"field {name!r} must be true or false, got {value!r:.80}")
    return value


def key_to_json(key: CacheKey | BlocksCacheKey) -> dict[str, Any]:
    """A key as a JSON object (read back with :func:`key_from_json`).

    >>> key_to_json(BlocksCacheKey(1, 2))
    {'kind': 'blocks', 'prompt_cluster_id': 1, 'model_id': 2}
    """
    if isinstance(key, BlocksCacheKey):
        return {"kind": "blocks", "prompt_cluster_id": key.prompt_cluster_id,
                "model_id": key.model_id}
    return {"kind": "cache", "prompt_cluster_id": key.prompt_cluster_id,
            "req_id": key.req_id, "model_id": key.model_id, "prefix_id": key.prefix_id}


def key_from_json(data: object) -> CacheKey | BlocksCacheKey:
    """A key received from a peer, validated (:class:`CacheKey` checks its own fields).

    >>> key_from_json({"kind": "cache", "prompt_cluster_id": 0, "req_id": 3, "model_id": 0})
    CacheKey(prompt_cluster_id=0, req_id=3, model_id=0, prefix_id=None)
    """
    if not isinstance(data, dict):
        raise InvalidParamError(f"a cache key must be a JSON object, got {data!r:.80}")
    kind = data.get("kind")
    if kind == "blocks":
        return BlocksCacheKey(get_int(data, "prompt_cluster_id"), get_int(data, "model_id"))
    if kind == "cache":
        return CacheKey(get_int(data, "prompt_cluster_id"), data.get("req_id"),
                        get_int(data, "model_id"), data.get("prefix_id"))
    raise InvalidParamError(f"unknown cache key kind {kind!r}")


def error_reply(exc: BaseException) -> dict[str, Any]:
    """The reply that carries ``exc`` to the peer (its status code and message).

    >>> from kvfunc.datadist._errors import CacheNotExistError
    >>> error_reply(CacheNotExistError("no key"))["code"]
    'LLM_KV_CACHE_NOT_EXIST'
    """
    code = exc.status_code if isinstance(exc, LLMError) else LLMStatusCode.LLM_FAILED
    text = str(exc).removeprefix(f"{code.name}: ")
    return {"ok": False, "code": code.name, "message": f"peer: {text}"[:4000]}


def raise_if_error(reply: dict[str, Any]) -> dict[str, Any]:
    """Return ``reply`` if it says ``ok``; else raise the error it carries.

    >>> raise_if_error({"ok": False, "code": "LLM_NOT_YET_LINK", "message": "x"})
    Traceback (most recent call last):
    ...
    kvfunc.datadist._errors.NotLinkedError: LLM_NOT_YET_LINK: x
    """
    if get_bool(reply, "ok"):
        return reply
    name = reply.get("code")
    code = LLMStatusCode[name] if isinstance(name, str) and name in LLMStatusCode.__members__ \
        else LLMStatusCode.LLM_UNKNOWN_ERROR
    raise error_for(code, get_str(reply, "message"))
