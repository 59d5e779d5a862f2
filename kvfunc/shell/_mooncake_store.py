"""Mooncake Store as the remote tier: blocks stored and fetched by hash, zero-copy.

Theory of operation
-------------------
A :class:`MooncakeStore` is one ``mooncake.store.MooncakeDistributedStore``
client (the optional ``kvfunc[mooncake]`` extra) with a
:class:`~kvfunc.shell.HostBlockPool`'s buffers registered, so that the store
reads and writes host blocks where they are (``batch_put_from`` /
``batch_get_into``; with the layer layout, ``*_multi_buffers``, one part per
tensor).  One block is one object, under :func:`block_key`.  Each call
groups its blocks into batches of at most ``batch_objects`` objects (and 256
parts): over TCP each object costs the store tens of microseconds, so one
call per block would cost far more than its bytes.

The store is a cache of its own: it evicts without telling anyone, so what
it holds must be asked (:meth:`MooncakeStore.contains`, ``batch_is_exist``)
before a load is planned, and a load may still find an object gone.  Keys are
write-once: a put of a key already stored keeps the first value, which is
right here since a key names its bytes.

Every outcome is bounded in time:

* ``connect`` first runs a throw-away client in a child process with a
  deadline (``probe_timeout_s``): the client's ``setup`` holds the GIL and
  retries for more than a minute when the master is down, so it cannot be
  bounded from a thread.  Only once that child connects does the real
  ``setup`` run here.  A master that dies between the two still costs that
  minute.
* every other call runs on a thread of its own with a deadline
  (``call_timeout_s``); past it the call raises :class:`StoreTimeoutError`
  naming the host blocks the call may still read or write, and the store
  refuses new calls until it returns (:meth:`MooncakeStore.wait_idle`).

Per block (``TransferResult``): a get is ``ok`` only when it read exactly one
block's bytes; an object that is absent is a ``miss``; one of another size,
or a read the store failed, is ``failed``; the host block of every block not
``ok`` is zero-filled before the call returns, so no block is left half
written.  A store that cannot be reached raises
:class:`StoreUnavailableError` (after zero-filling every destination of a
get).  Everything that is not ``ok`` means recompute.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, TypeVar

from kvfunc.core import InvalidArgumentError, InvalidTypeError
from kvfunc.shell._blocks import BlockIds, _Ids, zero_blocks
from kvfunc.shell._host_pool import HostBlockPool, check_host_pool
from kvfunc.shell._mooncake_config import MooncakeStoreConfig, import_store, probe
from kvfunc.shell._store_errors import (
    StoreError,
    StoreTimeoutError,
    StoreUnavailableError,
    mooncake_error,
)
from kvfunc.shell._store_keys import (
    TransferResult,
    check_hashes,
    key_prefix,
    outcome_of_get,
    outcome_of_put,
)

__all__ = ["MooncakeStore"]

T = TypeVar("T")
MAX_PARTS_PER_BATCH = 256  # Mooncake's TCP transport queues a bounded number of slices
RPC_FAIL = -900
def _codes(value: object, n: int, what: str) -> list[int]:
    """The per-key answers of a batch call, checked to be ``n`` ints."""
    if not isinstance(value, list | tuple) or len(value) != n or not all(
            type(c) is int for c in value):
        raise StoreError(f"{what} answered {value!r:.200}, not {n} status codes")
    return list(value)


class MooncakeStore:
    """Blocks of one host pool stored in and fetched from Mooncake Store (module docstring).

    Build one with :meth:`connect`; ``close()`` (or a ``with`` block) releases it.
    """

    def __init__(self, client: Any, config: MooncakeStoreConfig, host: HostBlockPool,
                 prefix: str) -> None:
        self._client, self.config, self.host, self._prefix = client, config, host, prefix
        self._lock = threading.Lock()
        self._stuck: threading.Event | None = None  # a call past its deadline, until it returns
        self._closed = False
        self._registered: list[int] = []
        parts = 1 if host.layout == "block" else len(host.tensors)
        self._batch = max(1, min(config.batch_objects, MAX_PARTS_PER_BATCH // parts))

    @classmethod
    def connect(cls, config: MooncakeStoreConfig, host: HostBlockPool, *, namespace: str,
                group_key: str) -> MooncakeStore:
        """Connect to the store and register ``host``'s buffers with it.

        Args:
            config: where the store is, and the deadlines.
            host: the host pool whose blocks are stored and fetched.
            namespace: the model (and whatever else keeps caches apart).
            group_key: the attention group whose blocks these are.

        Raises:
            InvalidTypeError, InvalidArgumentError: bad arguments.
            NotSupportedError: the ``mooncake`` extra (or libibverbs) is missing.
            StoreUnavailableError: the master cannot be reached in time.
            StoreError: the store refused to register the host buffers.
        """
        if not isinstance(config, MooncakeStoreConfig):
            raise InvalidTypeError(f"expected a MooncakeStoreConfig, got {type(config).__name__}")
        host = check_host_pool(host)
        prefix = key_prefix(namespace, group_key, host.fingerprint)
        store_cls = import_store()
        probe(config)
        client = store_cls()
        status = client.setup(config.local_hostname, config.metadata_server,
                              config.global_segment_bytes, config.local_buffer_bytes,
                              config.protocol, config.rdma_devices, config.master_address)
        if status != 0:
            msg = f"Mooncake client setup with master {config.master_address}"
            raise StoreUnavailableError(f"{msg} failed with status {status}")
        store = cls(client, config, host, prefix)
        try:
            for buf in host.buffers:
                if buf.numel():
                    store._register(buf.data_ptr(), buf.numel())
        except BaseException:
            store.close()
            raise
        return store

    def _register(self, address: int, nbytes: int) -> None:
        status = self._call(partial(self._client.register_buffer, address, nbytes),
                            f"registering {nbytes} bytes of host memory")
        if status != 0:
            raise mooncake_error(int(status), f"registering {nbytes} bytes of host memory")
        self._registered.append(address)

    def key(self, block_hash: bytes) -> str:
        """The store key of ``block_hash`` (see :func:`block_key`)."""
        (h,) = check_hashes([block_hash])
        return self._prefix + h.hex()

    def _call(self, fn: Callable[[], T], what: str, busy: Sequence[int] = ()) -> T:
        """``fn()`` on a thread of its own, within ``call_timeout_s``."""
        with self._lock:
            if self._closed:
                raise StoreUnavailableError(f"{what}: the store client is closed")
            if self._stuck is not None and not self._stuck.is_set():
                msg = f"{what}: an earlier call is still running past its deadline"
                raise StoreUnavailableError(msg)
        done = threading.Event()
        box: list[Any] = []

        def run() -> None:
            try:
                box.append(fn())
            except BaseException as exc:  # handed to the caller below
                box.append(exc)
            finally:
                done.set()

        threading.Thread(target=run, daemon=True, name="kvfunc-mooncake-call").start()
        if not done.wait(self.config.call_timeout_s):
            with self._lock:
                self._stuck = done
            msg = f"{what} did not return within {self.config.call_timeout_s} s"
            raise StoreTimeoutError(msg, busy_block_ids=busy)
        if isinstance(box[0], BaseException):
            raise StoreError(f"{what} raised {box[0]!r}") from box[0]
        result: T = box[0]
        return result

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no call is running past its deadline; False if ``timeout`` s passed."""
        stuck = self._stuck
        return stuck is None or stuck.wait(timeout)

    def _checked(self, block_hashes: Sequence[bytes], host_block_ids: BlockIds, *,
                 distinct_blocks: bool) -> tuple[list[str], list[int]]:
        hashes = check_hashes(block_hashes)
        ids = _Ids(host_block_ids, "host_block_ids")
        if len(ids) != len(hashes):
            msg = (f"block_hashes and host_block_ids must have the same length, but got "
                   f"{len(hashes)} and {len(ids)}")
            raise InvalidArgumentError(msg)
        ids.check_range([("the host pool", self.host.tensors[0])])
        if distinct_blocks:
            ids.check_unique()
        return [self._prefix + h.hex() for h in hashes], ids.host.tolist()

    def _batches(self, n: int) -> list[tuple[int, int]]:
        return [(lo, min(n, lo + self._batch)) for lo in range(0, n, self._batch)]

    def _transfer(self, name: str, keys: list[str], ids: list[int]) -> list[int]:
        """One batch call ``name`` (``put_from`` / ``get_into``) over ``keys``' host blocks."""
        host, client = self.host, self._client
        addresses: list[Any]
        sizes: list[Any]
        if host.layout == "block":
            base, stride = host.buffers[0].data_ptr(), host.block_stride
            call = getattr(client, f"batch_{name}")
            addresses, sizes = [base + b * stride for b in ids], [host.block_bytes] * len(ids)
        else:
            bases = [buf.data_ptr() for buf in host.buffers]
            call = getattr(client, f"batch_{name}_multi_buffers")
            addresses = [[a + b * n for a, n in zip(bases, host.part_bytes, strict=True)]
                         for b in ids]
            sizes = [list(host.part_bytes)] * len(ids)
        what = f"batch_{name} of {len(keys)} blocks"
        codes = _codes(self._call(partial(call, keys, addresses, sizes), what, ids), len(keys),
                       what)
        if RPC_FAIL in codes:
            raise mooncake_error(RPC_FAIL, f"{what} (master {self.config.master_address})")
        return codes

    def contains(self, block_hashes: Sequence[bytes]) -> tuple[bool, ...]:
        """Whether the store holds each block now (``batch_is_exist``): plan loads on this.

        The answer is a hint: the store may evict a block right after.

        Raises:
            InvalidTypeError, InvalidArgumentError: hashes that are not 1 to
                128 bytes each.
            StoreUnavailableError, StoreTimeoutError: the store is unreachable.
        """
        keys = [self._prefix + h.hex() for h in check_hashes(block_hashes)]
        found: list[bool] = []
        for lo, hi in self._batches(len(keys)):
            what = f"batch_is_exist of {hi - lo} keys"
            codes = _codes(self._call(partial(self._client.batch_is_exist, keys[lo:hi]), what),
                           hi - lo, what)
            if RPC_FAIL in codes:
                raise mooncake_error(RPC_FAIL, f"{what} (master {self.config.master_address})")
            found += [c == 1 for c in codes]
        return tuple(found)

    def put_blocks(self, block_hashes: Sequence[bytes], host_block_ids: BlockIds
                   ) -> TransferResult:
        """Store host blocks ``host_block_ids[i]`` under ``block_hashes[i]``, in batches.

        A block is ``ok`` once stored (or when the key was already stored),
        ``failed`` when the store refused it (no room, a failed transfer).
        The host blocks must not change until the call returns.

        Raises:
            InvalidTypeError, InvalidArgumentError, BlockIndexError: bad arguments.
            StoreUnavailableError: the master cannot be reached (later batches
                are not tried).
            StoreTimeoutError: a batch passed its deadline.
        """
        keys, ids = self._checked(block_hashes, host_block_ids, distinct_blocks=False)
        codes: list[int] = []
        for lo, hi in self._batches(len(keys)):
            codes += self._transfer("put_from", keys[lo:hi], ids[lo:hi])
        return TransferResult(tuple(outcome_of_put(c) for c in codes), tuple(codes),
                              self.host.block_bytes, reading=False)

    def get_blocks(self, block_hashes: Sequence[bytes], host_block_ids: BlockIds
                   ) -> TransferResult:
        """Fetch the blocks ``block_hashes[i]`` into host blocks ``host_block_ids[i]``.

        A block is ``ok`` when exactly one block's bytes were read, ``miss``
        when the store does not hold it, ``failed`` otherwise; every host
        block not ``ok`` is zero-filled before the call returns.

        Raises:
            InvalidTypeError, InvalidArgumentError, BlockIndexError: bad arguments.
            StoreUnavailableError: the master cannot be reached; every
                destination is zero-filled.
            StoreTimeoutError: a batch passed its deadline; its blocks
                (``busy_block_ids``) may still be written until
                :meth:`wait_idle`, and no destination of the call holds a
                usable block.
        """
        keys, ids = self._checked(block_hashes, host_block_ids, distinct_blocks=True)
        expected = self.host.block_bytes
        codes: list[int] = []
        try:
            for lo, hi in self._batches(len(keys)):
                codes += self._transfer("get_into", keys[lo:hi], ids[lo:hi])
        except StoreTimeoutError:
            raise
        except StoreError:
            zero_blocks(self.host.tensor_set(), ids)
            raise
        outcomes = tuple(outcome_of_get(c, expected) for c in codes)
        zero_blocks(self.host.tensor_set(), [b for b, o in zip(ids, outcomes, strict=True)
                                             if o != "ok"])
        return TransferResult(outcomes, tuple(codes), expected, reading=True)

    def close(self) -> None:
        """Unregister the host buffers and close the client (idempotent).

        If a call is still running past its deadline, waits for it up to
        ``call_timeout_s`` and, if it is still running, leaves the client to
        it.  Closing holds the interpreter for about a second when the
        master is gone, longer when this process lends memory to the store.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            stuck = self._stuck
        if stuck is not None and not stuck.wait(self.config.call_timeout_s):
            return
        for address in self._registered:
            self._client.unregister_buffer(address)
        self._registered = []
        self._client.close()

    def __enter__(self) -> MooncakeStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
