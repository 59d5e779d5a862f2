"""Options of an ``LLMDataDist``, and LLM-DataDist's builders for them and for links.

* :class:`DataDistOptions` parses the options mapping ``init`` takes (plain
  values or LLM-DataDist's strings) and checks every key and value.
* :class:`LLMConfig` builds that mapping from properties, as LLM-DataDist's
  ``LLMConfig.generate_options()`` does.
* :class:`LLMClusterInfo` describes a cluster to link to the way
  LLM-DataDist's link-management samples do (``remote_cluster_id`` and
  ``append_remote_ip_info``); :meth:`LLMClusterInfo.to_cluster_info`
  checks it and gives kvfunc's frozen :class:`ClusterInfo`.

Pure: no torch.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from typing import ClassVar

import attrs

from kvfunc.datadist._errors import InvalidParamError
from kvfunc.datadist._types import ClusterInfo, PoolConfig, check_id

__all__ = ["DataDistOptions", "LLMClusterInfo", "LLMConfig"]

TRANSPORTS = ("tcp", "gloo", "nccl", "hccl", "mooncake")
_KNOWN_OPTIONS = ("llm.MemPoolConfig", "llm.HostMemPoolConfig", "llm.listenIpInfo",
                  "llm.SyncKvCacheWaitTime", "llm.TransferBackend", "llm.Device",
                  "ge.flowGraphMemMaxSize", "ge.exec.deviceId")
# accepted for LLM-DataDist's sake, no effect here: one device per process, no ratio of
# the pool held back
_IGNORED_OPTIONS = ("ge.session_device_id", "llm.MemoryUtilization")


def _parse_listen(value: object) -> tuple[str, int]:
    host, sep, port = str(value).rpartition(":")
    if not sep or not port.isdigit():
        raise InvalidParamError(f"llm.listenIpInfo must be 'ip:port', got {value!r}")
    if not host or not 0 <= int(port) < 65536:
        raise InvalidParamError(f"llm.listenIpInfo must be 'ip:port', got {value!r}")
    return host, int(port)


def _parse_count(name: str, value: object, lo: int, hi: int) -> int:
    text = str(value)
    if type(value) is bool or not text.isdigit() or not lo <= int(text) < hi:
        raise InvalidParamError(f"{name} must be a whole number in [{lo}, {hi}), got {value!r}")
    return int(text)


def _device_pool(options: Mapping[str, object]) -> PoolConfig | None:
    pool, size = options.get("llm.MemPoolConfig"), options.get("ge.flowGraphMemMaxSize")
    if pool is not None and size is not None:
        raise InvalidParamError("give the device pool as llm.MemPoolConfig or as "
                                "ge.flowGraphMemMaxSize, not both")
    if size is not None:
        return PoolConfig(_parse_count("ge.flowGraphMemMaxSize", size, 1, 2**63))
    return None if pool is None else PoolConfig.from_json(pool)


@attrs.frozen
class DataDistOptions:
    """The options of an ``LLMDataDist``, parsed and checked.

    Keys: ``llm.MemPoolConfig`` / ``llm.HostMemPoolConfig`` (pool configs,
    see :class:`PoolConfig`), or ``ge.flowGraphMemMaxSize`` (the device
    pool's bytes, LLM-DataDist's name for it), ``llm.listenIpInfo``
    (``"ip:port"``; port 0 picks a free one), ``llm.SyncKvCacheWaitTime``
    (ms a transfer may take, default 5000), ``llm.TransferBackend``
    (``tcp``, ``gloo``, ``nccl``, ``hccl`` or ``mooncake``; default from the
    device: ``tcp`` on the CPU), ``llm.Device`` (the device pool's device,
    default ``"auto"``) and ``ge.exec.deviceId`` (its index on an
    accelerator).  ``ge.session_device_id`` and ``llm.MemoryUtilization``
    are accepted and have no effect; any other key is refused.

    >>> o = DataDistOptions.from_mapping({"ge.flowGraphMemMaxSize": "4096",
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
    device_id: int | None = None

    @classmethod
    def from_mapping(cls, options: Mapping[str, object] | None) -> DataDistOptions:
        """Parse an options mapping (values are strings or plain values)."""
        if options is None:
            return cls()
        if not isinstance(options, Mapping):
            raise InvalidParamError(f"options must be a mapping, got {type(options).__name__}")
        unknown = sorted(set(options) - set(_KNOWN_OPTIONS) - set(_IGNORED_OPTIONS))
        if unknown:
            raise InvalidParamError(f"unknown option(s) {unknown}; known: {list(_KNOWN_OPTIONS)}")
        get = options.get
        transport = get("llm.TransferBackend")
        if transport is not None and transport not in TRANSPORTS:
            raise InvalidParamError(f"llm.TransferBackend must be one of {list(TRANSPORTS)}, "
                                    f"got {transport!r}")
        device = get("llm.Device", "auto")
        if not isinstance(device, str):
            raise InvalidParamError(f"llm.Device must be a device name, got {device!r}")
        host_pool, listen = get("llm.HostMemPoolConfig"), get("llm.listenIpInfo")
        device_id = get("ge.exec.deviceId")
        return cls(
            device_pool=_device_pool(options),
            host_pool=None if host_pool is None else PoolConfig.from_json(host_pool),
            listen=None if listen is None else _parse_listen(listen),
            sync_timeout_ms=_parse_count("llm.SyncKvCacheWaitTime",
                                         get("llm.SyncKvCacheWaitTime", 5000), 1, 2**31),
            transport=None if transport is None else str(transport),
            device=device,
            device_id=None if device_id is None else _parse_count("ge.exec.deviceId",
                                                                  device_id, 0, 2**31))


class LLMConfig:
    """Builds ``init``'s options from properties, as LLM-DataDist's ``LLMConfig`` does.

    >>> config = LLMConfig()
    >>> config.device_id = 0
    >>> config.listen_ip_info = "127.0.0.1:26000"
    >>> config.ge_options = {"ge.flowGraphMemMaxSize": "1048576"}
    >>> sorted(config.generate_options().items())  # doctest: +NORMALIZE_WHITESPACE
    [('ge.exec.deviceId', '0'), ('ge.flowGraphMemMaxSize', '1048576'),
     ('llm.listenIpInfo', '127.0.0.1:26000')]
    """

    _FIELDS: ClassVar[dict[str, str]] = {
        "device_id": "ge.exec.deviceId", "listen_ip_info": "llm.listenIpInfo",
        "sync_kv_timeout": "llm.SyncKvCacheWaitTime", "mem_pool_cfg": "llm.MemPoolConfig",
        "host_mem_pool_cfg": "llm.HostMemPoolConfig", "transfer_backend": "llm.TransferBackend"}

    def __init__(self) -> None:
        self.device_id: int | None = None
        self.listen_ip_info: str | None = None
        self.sync_kv_timeout: int | str | None = None
        self.mem_pool_cfg: str | None = None
        self.host_mem_pool_cfg: str | None = None
        self.transfer_backend: str | None = None
        self.ge_options: dict[str, str] = {}

    def generate_options(self) -> dict[str, str]:
        """The options mapping (strings), checked by parsing it once.

        Raises:
            InvalidParamError: a property or a ``ge_options`` entry is invalid.
        """
        if not isinstance(self.ge_options, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in self.ge_options.items()):
            raise InvalidParamError(f"ge_options must map str to str, got {self.ge_options!r}")
        options = dict(self.ge_options)
        for name, key in self._FIELDS.items():
            value = getattr(self, name)
            if value is not None:
                options[key] = str(value)
        DataDistOptions.from_mapping(options)
        return options


def _ip(value: object) -> str:
    """An IPv4 address given as a string or as LLM-DataDist's little-endian int."""
    try:
        if type(value) is int:
            return str(ipaddress.IPv4Address(value.to_bytes(4, "little")))
        if isinstance(value, str):
            return str(ipaddress.ip_address(value))
    except (ValueError, OverflowError):
        pass
    raise InvalidParamError(f"ip must be an IP address (str or int), got {value!r:.80}")


class LLMClusterInfo:
    """A cluster to link to, described as LLM-DataDist's link-management samples do.

    >>> cluster = LLMClusterInfo()
    >>> cluster.remote_cluster_id = 1
    >>> cluster.append_local_ip_info("127.0.0.1", 0)
    >>> cluster.append_remote_ip_info("127.0.0.1", 26000)
    >>> cluster.to_cluster_info()
    ClusterInfo(remote_cluster_id=1, remote_ip='127.0.0.1', remote_port=26000)
    """

    def __init__(self) -> None:
        self._remote_cluster_id: int | None = None
        self.local_ip_info_list: list[tuple[str, int]] = []
        self.remote_ip_info_list: list[tuple[str, int]] = []

    @property
    def remote_cluster_id(self) -> int | None:
        """The id of the cluster to link to."""
        return self._remote_cluster_id

    @remote_cluster_id.setter
    def remote_cluster_id(self, value: int) -> None:
        check_id("remote_cluster_id", value)
        self._remote_cluster_id = value

    @staticmethod
    def _info(ip: object, port: object) -> tuple[str, int]:
        if type(port) is not int or not 0 <= port < 65536:
            raise InvalidParamError(f"port must be an int in [0, 65535], got {port!r:.80}")
        return _ip(ip), port

    def append_local_ip_info(self, ip: str | int, port: int) -> None:
        """Add this side's address (kvfunc connects from any local address; it is checked
        and kept for reference)."""
        self.local_ip_info_list.append(self._info(ip, port))

    def append_remote_ip_info(self, ip: str | int, port: int) -> None:
        """Add the address the remote cluster listens on."""
        self.remote_ip_info_list.append(self._info(ip, port))

    def to_cluster_info(self) -> ClusterInfo:
        """kvfunc's :class:`ClusterInfo` for this description.

        Raises:
            InvalidParamError: no ``remote_cluster_id``, or not exactly one
                remote address (LLM-DataDist takes one per cluster).
        """
        if self._remote_cluster_id is None:
            raise InvalidParamError("set remote_cluster_id before linking")
        if len(self.remote_ip_info_list) != 1:
            raise InvalidParamError(f"a cluster needs exactly one remote ip info (use "
                                    f"append_remote_ip_info), got {self.remote_ip_info_list}")
        ip, port = self.remote_ip_info_list[0]
        return ClusterInfo(self._remote_cluster_id, ip, port)

    def __repr__(self) -> str:
        return (f"LLMClusterInfo(remote_cluster_id={self._remote_cluster_id}, "
                f"remote={self.remote_ip_info_list}, local={self.local_ip_info_list})")

