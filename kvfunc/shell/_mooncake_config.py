"""Mooncake Store's client settings, and the bounded check that its master answers.

``MooncakeDistributedStore.setup`` holds the interpreter's GIL and retries
for more than a minute when the master is down, so no thread can put a
deadline on it.  :func:`probe` runs the same setup in a throw-away child
process instead and kills it at the deadline; only a master that answers
the child is then set up in this process.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import attrs

from kvfunc.core import InvalidArgumentError, InvalidTypeError, NotSupportedError
from kvfunc.shell._store_errors import StoreUnavailableError

__all__ = ["MooncakeStoreConfig", "import_store", "probe"]

_PROBE = """
import os, sys
from mooncake.store import MooncakeDistributedStore
client = MooncakeDistributedStore()
status = client.setup(sys.argv[1], sys.argv[2], 0, 0, sys.argv[3], sys.argv[4], sys.argv[5])
os._exit(0 if status == 0 else 3)
"""


def _positive(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        msg = f"{attribute.name} must be a positive number, but got {value!r}"
        raise InvalidArgumentError(msg)


def _non_negative_int(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if type(value) is not int or value < 0:
        raise InvalidArgumentError(f"{attribute.name} must be an int >= 0, but got {value!r}")


def _positive_int(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if type(value) is not int or value <= 0:
        raise InvalidArgumentError(f"{attribute.name} must be an int > 0, but got {value!r}")


def _text(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, str):
        raise InvalidTypeError(f"{attribute.name} must be a str, but got {value!r}")


@attrs.frozen(kw_only=True)
class MooncakeStoreConfig:
    """Where the store is and how long to wait for it.

    Attributes:
        master_address: ``host:port`` of ``mooncake_master``'s RPC service.
        metadata_server: the metadata service, e.g. the master's own HTTP
            one, ``http://host:port/metadata``.
        local_hostname: this client's address as the store's peers see it.
        protocol: ``"tcp"`` or ``"rdma"``; ``rdma_devices`` names the devices.
        global_segment_bytes: memory this process lends to the store (0: a
            client that only reads and writes the store's memory elsewhere).
        local_buffer_bytes: the client's own staging buffer (unused by the
            zero-copy calls here).
        probe_timeout_s: the deadline of the connection probe.
        call_timeout_s: the deadline of every other call.
        batch_objects: most objects per store call.

    >>> c = MooncakeStoreConfig(master_address="10.0.0.5:50051",
    ...                         metadata_server="http://10.0.0.5:8080/metadata")
    >>> c.global_segment_bytes, c.call_timeout_s, c.batch_objects
    (0, 30.0, 64)
    """

    master_address: str = attrs.field(validator=_text)
    metadata_server: str = attrs.field(validator=_text)
    local_hostname: str = attrs.field(default="127.0.0.1", validator=_text)
    protocol: str = attrs.field(default="tcp", validator=_text)
    rdma_devices: str = attrs.field(default="", validator=_text)
    global_segment_bytes: int = attrs.field(default=0, validator=_non_negative_int)
    local_buffer_bytes: int = attrs.field(default=0, validator=_non_negative_int)
    probe_timeout_s: float = attrs.field(default=10.0, validator=_positive)
    call_timeout_s: float = attrs.field(default=30.0, validator=_positive)
    batch_objects: int = attrs.field(default=64, validator=_positive_int)


def import_store() -> Any:
    """``mooncake.store.MooncakeDistributedStore``, or NotSupportedError without the extra."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except (ImportError, OSError) as exc:  # OSError: libibverbs is missing
        msg = ("the Mooncake Store tier needs mooncake-transfer-engine-non-cuda (the "
               f"kvfunc[mooncake] extra) and libibverbs1: {exc}")
        raise NotSupportedError(msg) from None
    return MooncakeDistributedStore


def probe(config: MooncakeStoreConfig) -> None:
    """Connect a throw-away client in a child process, within ``probe_timeout_s``."""
    args = [sys.executable, "-c", _PROBE, config.local_hostname, config.metadata_server,
            config.protocol, config.rdma_devices, config.master_address]
    try:
        proc = subprocess.run(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, timeout=config.probe_timeout_s,
                              check=False)
    except subprocess.TimeoutExpired:
        msg = (f"Mooncake master {config.master_address} not reached within "
               f"{config.probe_timeout_s} s")
        raise StoreUnavailableError(msg) from None
    if proc.returncode != 0:
        msg = (f"a Mooncake client could not connect to master {config.master_address} "
               f"(metadata {config.metadata_server}): exit status {proc.returncode}")
        raise StoreUnavailableError(msg)
