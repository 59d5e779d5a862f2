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


def _addrs(value: object) -> tuple[int, ...] | int:
    if type(value) is int:
        check_id("dst_cache_id", value)
        return value
    if isinstance(value, str | bytes) or not hasattr(value, "__iter__"):
        raise InvalidParamError(f"dst_addrs must be a list of tensor addresses (or a cache id), "
                                f"got {value!r:.80}")
    addrs = tuple(value)
    if not addrs or not all(type(a) is int and 0 < a < 2**64 for a in addrs):
        raise InvalidParamError(f"dst_addrs must be non-empty addresses, got {list(addrs)!r:.80}")
    return addrs


def _layer_range(_: object, __: object, value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, range) or value.step != 1 or not value or value.start < 0:
        raise InvalidParamError(f"src_layer_range must be a non-empty range(start, stop) of "
                                f"layers with step 1, got {value!r}")


@attrs.frozen
class TransferConfig:
    """Where :meth:`CacheManager.transfer_cache_async` sends: a decoder's cache.

    LLM-DataDist's form names the decoder's cache by the addresses of its
    tensors (its ``per_device_tensor_addrs[0]``, one per tensor sent); for
    an ordinary cache, each address moved by ``b`` rows names batch entry
    ``b``.  The decoder resolves them against its own registered caches, so
    an address that names no tensor of one of its caches is refused.
    kvfunc's form gives the decoder cache's id instead (an int), with
    ``dst_batch_index``.

    Attributes:
        dst_cluster_id: the decoder cluster.
        dst_addrs: the decoder cache's tensor addresses, or its cache id.
        src_layer_range: the layers of this side to send (step 1), all if None;
            tensors ``start * t .. stop * t - 1`` for ``t`` tensors per layer.
        src_batch_index: the entry of an ordinary source cache to send.
        dst_batch_index: with a cache id, the entry of an ordinary decoder cache.

    >>> TransferConfig(2, [0x7F0000, 0x7F1000], range(1, 2)).src_layer_range
    range(1, 2)
    >>> TransferConfig(2, 9).dst_cache_id
    9
    """

    dst_cluster_id: int = attrs.field(validator=_id("dst_cluster_id"))
    dst_addrs: tuple[int, ...] | int = attrs.field(converter=_addrs)
    src_layer_range: range | None = attrs.field(default=None, validator=_layer_range)
    src_batch_index: int = attrs.field(default=0, validator=_id("src_batch_index"))
    dst_batch_index: int = attrs.field(default=0, validator=_id("dst_batch_index"),
                                       kw_only=True)

    @property
    def dst_cache_id(self) -> int | None:
        """The decoder cache's id, where the config names it by id."""
        return self.dst_addrs if isinstance(self.dst_addrs, int) else None


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
