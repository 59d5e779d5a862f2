"""DataDist value types: roles, placements, dtypes, cache descs, keys, options.

All frozen records, validated on construction (a bad value raises
:class:`InvalidParamError`, status ``LLM_PARAM_INVALID``).  Pure: no torch;
a dtype is a :class:`DataType` whose value is torch's name for it.
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Mapping
from typing import Any

import attrs

from kvfunc.core import dtype_itemsize
from kvfunc.datadist._errors import InvalidParamError

__all__ = [
    "MAX_ID",
    "BlocksCacheKey",
    "CacheDesc",
    "CacheKey",
    "CacheKeyByIdAndIndex",
    "ClusterInfo",
    "DataDistOptions",
    "DataType",
    "LLMRole",
    "Placement",
    "PoolConfig",
    "TransferConfig",
    "check_id",
]

MAX_ID = 2**63 - 1  # ids travel as JSON integers and as int64 in tensors


class LLMRole(enum.IntEnum):
    """The side of a prefill/decode pair: PROMPT computes the KV, DECODER continues."""

    PROMPT = 1
    DECODER = 2


class Placement(enum.IntEnum):
    """Where a cache lives: the device pool or the host pool."""

    HOST = 0
    DEVICE = 1


class DataType(enum.Enum):
    """Element types of a cache; the value is torch's name for the dtype.

    >>> DataType.DT_BF16.itemsize, DataType("float32").name
    (2, 'DT_FLOAT')
    """

    DT_FLOAT = "float32"
    DT_FLOAT16 = "float16"
    DT_BF16 = "bfloat16"
    DT_DOUBLE = "float64"
    DT_INT8 = "int8"
    DT_UINT8 = "uint8"
    DT_INT16 = "int16"
    DT_INT32 = "int32"
    DT_INT64 = "int64"
    DT_BOOL = "bool"

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return dtype_itemsize(self.value)


def check_id(name: str, value: object, *, allow_none: bool = False) -> None:
    """Raise :class:`InvalidParamError` unless ``value`` is an int in ``[0, MAX_ID]``.

    >>> check_id("cluster_id", 3)
    >>> check_id("cluster_id", -1)
    Traceback (most recent call last):
    ...
    kvfunc.datadist._errors.InvalidParamError: LLM_PARAM_INVALID: cluster_id must be ...
    """
    if value is None and allow_none:
        return
    if type(value) is not int or not 0 <= value <= MAX_ID:
        raise InvalidParamError(f"{name} must be an int in [0, 2**63), but got {value!r}")


def _id(name: str) -> Any:
    def validate(_: object, __: object, value: object) -> None:
        check_id(name, value)
    return validate


def _shape(value: object) -> tuple[int, ...]:
    if isinstance(value, str | bytes) or not hasattr(value, "__iter__"):
        raise InvalidParamError(f"shape must be a sequence of ints, but got {value!r}")
    shape = tuple(value)
    if not shape or not all(type(d) is int and d > 0 for d in shape):
        raise InvalidParamError(f"shape must be non-empty positive ints, but got {list(shape)}")
    return shape


def _enum(cls: type[enum.Enum], name: str) -> Any:
    def validate(_: object, __: object, value: object) -> None:
        if not isinstance(value, cls):
            raise InvalidParamError(f"{name} must be a {cls.__name__}, but got {value!r}")
    return validate


@attrs.frozen
class CacheDesc:
    """``num_tensors`` tensors of one ``shape`` and ``data_type`` (K and V of every layer).

    ``shape[0]`` is the batch size of an ordinary cache and the number of
    blocks of a blocks cache; a *row* is one index along it.

    >>> d = CacheDesc(4, (8, 16, 2, 8), DataType.DT_FLOAT16)
    >>> d.row_nbytes, d.tensor_nbytes, d.nbytes, d.placement.name
    (512, 4096, 16384, 'DEVICE')
    """

    num_tensors: int = attrs.field()
    shape: tuple[int, ...] = attrs.field(converter=_shape)
    data_type: DataType = attrs.field(validator=_enum(DataType, "data_type"))
    placement: Placement = attrs.field(default=Placement.DEVICE,
                                       validator=_enum(Placement, "placement"))

    @num_tensors.validator
    def _check_num_tensors(self, _: object, value: object) -> None:
        if type(value) is not int or not 0 < value <= 65536:
            raise InvalidParamError(f"num_tensors must be an int in [1, 65536], got {value!r}")

    @property
    def num_rows(self) -> int:
        """``shape[0]``: batch size, or number of blocks."""
        return self.shape[0]

    @property
    def row_shape(self) -> tuple[int, ...]:
        """The shape of one row (one batch entry or one block)."""
        return self.shape[1:]

    @property
    def row_nbytes(self) -> int:
        """Bytes of one row of one tensor."""
        return math.prod(self.row_shape) * self.data_type.itemsize

    @property
    def tensor_nbytes(self) -> int:
        """Bytes of one tensor."""
        return self.num_rows * self.row_nbytes

    @property
    def nbytes(self) -> int:
        """Bytes of the whole cache."""
        return self.num_tensors * self.tensor_nbytes

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict; :meth:`from_json` reads it back (validated)."""
        return {"num_tensors": self.num_tensors, "shape": list(self.shape),
                "data_type": self.data_type.value, "placement": int(self.placement)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CacheDesc:
        """Rebuild a desc received from a peer, validating every field.

        >>> d = CacheDesc(2, (4, 3), DataType.DT_INT8)
        >>> CacheDesc.from_json(d.to_json()) == d
        True
        """
        try:
            return cls(data["num_tensors"], data["shape"], DataType(data["data_type"]),
                       Placement(data["placement"]))
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, InvalidParamError):
                raise
            raise InvalidParamError(f"malformed cache desc {data!r}: {exc}") from None


@attrs.frozen
class CacheKey:
    """Names one batch entry of a cache on a prompt cluster.

    Exactly one of ``req_id`` (a request) and ``prefix_id`` (a shared
    prefix) is given.

    >>> CacheKey(0, req_id=7)
    CacheKey(prompt_cluster_id=0, req_id=7, model_id=0, prefix_id=None)
    """

    prompt_cluster_id: int = attrs.field(validator=_id("prompt_cluster_id"))
    req_id: int | None = None
    model_id: int = attrs.field(default=0, validator=_id("model_id"))
    prefix_id: int | None = None

    def __attrs_post_init__(self) -> None:
        check_id("req_id", self.req_id, allow_none=True)
        check_id("prefix_id", self.prefix_id, allow_none=True)
        if (self.req_id is None) == (self.prefix_id is None):
            msg = (f"exactly one of req_id and prefix_id must be given, but got "
                   f"req_id={self.req_id!r}, prefix_id={self.prefix_id!r}")
            raise InvalidParamError(msg)


@attrs.frozen
class BlocksCacheKey:
    """Names a whole blocks cache (a paged KV pool) on a prompt cluster.

    >>> BlocksCacheKey(1, model_id=2).model_id
    2
    """

    prompt_cluster_id: int = attrs.field(validator=_id("prompt_cluster_id"))
    model_id: int = attrs.field(default=0, validator=_id("model_id"))


@attrs.frozen
class CacheKeyByIdAndIndex:
    """Names a cache of a remote cluster by its ``cache_id`` (the target of a push).

    >>> CacheKeyByIdAndIndex(2, 5).batch_index
    0
    """

    cluster_id: int = attrs.field(validator=_id("cluster_id"))
    cache_id: int = attrs.field(validator=_id("cache_id"))
    batch_index: int = attrs.field(default=0, validator=_id("batch_index"))


@attrs.frozen
class TransferConfig:
    """Where :meth:`CacheManager.transfer_cache_async` sends: a decoder's cache.

    >>> TransferConfig(2, 9).dst_cluster_id
    2
    """

    dst_cluster_id: int = attrs.field(validator=_id("dst_cluster_id"))
    dst_cache_id: int = attrs.field(validator=_id("dst_cache_id"))
    dst_batch_index: int = attrs.field(default=0, validator=_id("dst_batch_index"))


def _port(_: Any, __: Any, value: int) -> None:
    if type(value) is not int or not 0 < value < 65536:
        raise InvalidParamError(f"port must be an int in [1, 65535], but got {value!r}")


def _host(_: Any, __: Any, value: str) -> None:
    if not isinstance(value, str) or not value or any(c.isspace() for c in value):
        raise InvalidParamError(f"ip must be a non-empty host name or address, got {value!r}")


@attrs.frozen
class ClusterInfo:
    """A remote cluster to link to: its id and the address it listens on.

    >>> ClusterInfo(0, "127.0.0.1", 26000).remote_port
    26000
    """

    remote_cluster_id: int = attrs.field(validator=_id("remote_cluster_id"))
    remote_ip: str = attrs.field(validator=_host)
    remote_port: int = attrs.field(validator=_port)


@attrs.frozen
class PoolConfig:
    """A memory pool: ``memory_size`` bytes carved in pages of ``2**page_shift`` bytes.

    >>> PoolConfig.from_json('{"memory_size": 1048576, "page_shift": 16}').page_size
    65536
    """

    memory_size: int
    page_shift: int = 16

    def __attrs_post_init__(self) -> None:
        if type(self.memory_size) is not int or self.memory_size <= 0:
            raise InvalidParamError(f"memory_size must be a positive int, got "
                                    f"{self.memory_size!r}")
        if type(self.page_shift) is not int or not 6 <= self.page_shift <= 30:
            raise InvalidParamError(f"page_shift must be an int in [6, 30], got "
                                    f"{self.page_shift!r}")

    @property
    def page_size(self) -> int:
        """Bytes of one page (every cache starts on a page boundary)."""
        return 1 << self.page_shift

    @classmethod
    def from_json(cls, value: object) -> PoolConfig:
        """Read ``{"memory_size": bytes, "page_shift": 16}`` (a JSON text or a mapping)."""
        try:
            data = json.loads(value) if isinstance(value, str) else dict(value)  # type: ignore[call-overload]
            extra = set(data) - {"memory_size", "page_shift"}
            if extra:
                raise InvalidParamError(f"unknown pool option(s) {sorted(extra)}")
            return cls(data["memory_size"], data.get("page_shift", 16))
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, InvalidParamError):
                raise
            raise InvalidParamError(f"malformed pool config {value!r}: {exc}") from None


_TRANSPORTS = ("tcp", "gloo", "nccl", "hccl", "mooncake")
_KNOWN_OPTIONS = ("llm.MemPoolConfig", "llm.HostMemPoolConfig", "llm.listenIpInfo",
                  "llm.SyncKvCacheWaitTime", "llm.TransferBackend", "llm.Device")


def _parse_listen(value: object) -> tuple[str, int]:
    host, sep, port = str(value).rpartition(":")
    if not sep or not port.isdigit():
        raise InvalidParamError(f"llm.listenIpInfo must be 'ip:port', got {value!r}")
    if not host or not 0 <= int(port) < 65536:
        raise InvalidParamError(f"llm.listenIpInfo must be 'ip:port', got {value!r}")
    return host, int(port)


def _parse_ms(value: object) -> int:
    text = str(value)
    if type(value) is bool or not text.isdigit() or not 0 < int(text) < 2**31:
        raise InvalidParamError(f"llm.SyncKvCacheWaitTime must be a positive number of ms, "
                                f"got {value!r}")
    return int(text)


@attrs.frozen
class DataDistOptions:
    """The options of an ``LLMDataDist``, parsed and checked.

    Keys: ``llm.MemPoolConfig`` / ``llm.HostMemPoolConfig`` (pool configs,
    see :class:`PoolConfig`), ``llm.listenIpInfo`` (``"ip:port"``; port 0
    picks a free one), ``llm.SyncKvCacheWaitTime`` (ms a transfer may take,
    default 5000), ``llm.TransferBackend`` (``tcp``, ``gloo``, ``nccl``,
    ``hccl`` or ``mooncake``; default from the device: ``tcp`` on the CPU),
    ``llm.Device`` (the device pool's device, default ``"auto"``).

    >>> o = DataDistOptions.from_mapping({"llm.MemPoolConfig": '{"memory_size": 4096}',
    ...                                   "llm.listenIpInfo": "127.0.0.1:0"})
    >>> o.device_pool.memory_size, o.listen, o.sync_timeout_ms, o.host_pool
    (4096, ('127.0.0.1', 0), 5000, None)
    """

    device_pool: PoolConfig | None = None
    host_pool: PoolConfig | None = None
    listen: tuple[str, int] | None = None
    sync_timeout_ms: int = 5000
    transport: str | None = None
    device: str = "auto"

    @classmethod
    def from_mapping(cls, options: Mapping[str, object] | None) -> DataDistOptions:
        """Parse an options mapping (values are strings or plain values)."""
        if options is None:
            return cls()
        if not isinstance(options, Mapping):
            raise InvalidParamError(f"options must be a mapping, got {type(options).__name__}")
        unknown = sorted(set(options) - set(_KNOWN_OPTIONS))
        if unknown:
            raise InvalidParamError(f"unknown option(s) {unknown}; known: {list(_KNOWN_OPTIONS)}")
        get = options.get
        transport = get("llm.TransferBackend")
        if transport is not None and transport not in _TRANSPORTS:
            raise InvalidParamError(f"llm.TransferBackend must be one of {list(_TRANSPORTS)}, "
                                    f"got {transport!r}")
        device = get("llm.Device", "auto")
        if not isinstance(device, str):
            raise InvalidParamError(f"llm.Device must be a device name, got {device!r}")
        pool, host_pool = get("llm.MemPoolConfig"), get("llm.HostMemPoolConfig")
        listen = get("llm.listenIpInfo")
        return cls(
            device_pool=None if pool is None else PoolConfig.from_json(pool),
            host_pool=None if host_pool is None else PoolConfig.from_json(host_pool),
            listen=None if listen is None else _parse_listen(listen),
            sync_timeout_ms=_parse_ms(get("llm.SyncKvCacheWaitTime", 5000)),
            transport=None if transport is None else str(transport),
            device=device)
