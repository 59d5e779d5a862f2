"""``CacheManager``: LLM-DataDist's cache API over the pure registry and the pool.

It keeps one current :class:`RegistryState` and swaps it under a lock on
every call (the registry's transitions are pure, so a refused or failed
call changes nothing).  Each live cache has two :class:`Cache` objects over
the same views: the caller's, which ``deallocate_cache`` invalidates, and
an internal one that stays until the memory is really released (a cache
still held by keys or an in-flight transfer can be served after its
caller let go).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from kvfunc.datadist import _push, _transfer
from kvfunc.datadist import _registry as reg
from kvfunc.datadist._errors import (
    DataDistFailedError,
    InvalidParamError,
    PoolOutOfMemoryError,
    TransferTimeoutError,
)
from kvfunc.datadist._link import Link
from kvfunc.datadist._local import check_rows, copy_blocks, copy_cache, swap_blocks
from kvfunc.datadist._pool import Cache, MemoryPool
from kvfunc.datadist._types import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    LLMRole,
    TransferConfig,
)

__all__ = ["CacheManager", "CacheTask", "LayerSynchronizer"]


class LayerSynchronizer(Protocol):
    """Tells :meth:`CacheManager.transfer_cache_async` when a layer's KV is computed."""

    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        """Return True once layer ``layer_index`` is computed, False if it never will be."""
        ...


class CacheTask:
    """A transfer running in the background; :meth:`synchronize` waits for it."""

    def __init__(self, run: Callable[[], None]) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None

        def body() -> None:
            try:
                run()
            except BaseException as exc:  # handed to synchronize()
                self._error = exc
            finally:
                self._done.set()

        threading.Thread(target=body, daemon=True, name="kvfunc-cache-task").start()

    @property
    def done(self) -> bool:
        """Whether the transfer has ended (successfully or not)."""
        return self._done.is_set()

    def synchronize(self, timeout_in_millis: int | None = None) -> None:
        """Wait for the whole transfer; raise its error if it failed.

        Raises:
            TransferTimeoutError: still running after ``timeout_in_millis``.
            LLMError: the transfer's own failure, with its status code.
        """
        timeout = None if timeout_in_millis is None else timeout_in_millis / 1000
        if not self._done.wait(timeout):
            raise TransferTimeoutError(f"the transfer is still running after "
                                       f"{timeout_in_millis} ms")
        if self._error is not None:
            raise self._error


def _block_lists(src_blocks: object, dst_blocks: object) -> tuple[list[int], list[int]]:
    for name, blocks in (("src_blocks", src_blocks), ("dst_blocks", dst_blocks)):
        if isinstance(blocks, str | bytes) or not isinstance(blocks, Sequence) or not blocks:
            raise InvalidParamError(f"{name} must be a non-empty list of ints, got "
                                    f"{blocks!r:.80}")
        for b in blocks:
            if type(b) is not int or b < 0:
                raise InvalidParamError(f"{name} holds {b!r}; block indices are ints >= 0")
    src, dst = list(src_blocks), list(dst_blocks)  # type: ignore[call-overload]
    if len(src) != len(dst):
        raise InvalidParamError(f"src_blocks and dst_blocks differ in length: {len(src)} "
                                f"and {len(dst)}")
    if len(set(dst)) != len(dst):
        raise InvalidParamError(f"dst_blocks repeats a block: {dst}")
    return src, dst


class CacheManager:
    """Allocate, copy, swap, pull and push caches of one ``LLMDataDist``.

    Get it from ``LLMDataDist.cache_manager``; see ``docs/datadist.md``.
    """

    def __init__(self, state: reg.RegistryState, pool: MemoryPool,
                 link_to: Callable[[int], Link], timeout_s: float) -> None:
        self._lock = threading.Lock()
        self._state = state
        self._pool = pool
        self._link_to = link_to
        self._timeout_s = timeout_s
        self._internal: dict[int, Cache] = {}
        self._handles: dict[int, Cache] = {}

    @property
    def state(self) -> reg.RegistryState:
        """The registry as it is now (an immutable snapshot)."""
        return self._state

    @property
    def role(self) -> LLMRole:
        """This cluster's role."""
        return self._state.role

    # -- registry transitions ------------------------------------------------------------
    def _apply(self, change: Callable[[reg.RegistryState],
                                      tuple[reg.RegistryState, tuple[int, ...]]]) -> None:
        with self._lock:
            self._state, released = change(self._state)
            for cid in released:
                self._internal.pop(cid, None)
                handle = self._handles.pop(cid, None)
                if handle is not None:
                    handle.invalidate()

    def _new_cache(self, allocation: reg.CacheAllocation) -> Cache:
        if not allocation.ok or allocation.record is None:
            raise PoolOutOfMemoryError(allocation.reason)
        record = allocation.record
        region = self._pool.region(record)
        self._state = allocation.state
        self._internal[record.cache_id] = Cache(record, region)
        handle = self._handles[record.cache_id] = Cache(record, region)
        return handle

    def allocate_cache(self, cache_desc: CacheDesc,
                       cache_keys: Sequence[CacheKey | None] = ()) -> Cache:
        """Carve a cache out of the pool, held by its id and by each key (PROMPT only).

        Raises:
            PoolOutOfMemoryError: the pool has no free range that large
                (``LLM_DEVICE_OUT_OF_MEMORY``); nothing is allocated.
            InvalidParamError: bad desc or keys (see ``allocate_cache`` of the registry).
        """
        with self._lock:
            return self._new_cache(reg.allocate_cache(self._state, cache_desc, cache_keys))

    def allocate_blocks_cache(self, cache_desc: CacheDesc,
                              blocks_cache_key: BlocksCacheKey | None = None) -> Cache:
        """Carve a blocks cache (``shape[0]`` blocks) out of the pool."""
        with self._lock:
            return self._new_cache(reg.allocate_blocks_cache(self._state, cache_desc,
                                                             blocks_cache_key))

    def deallocate_cache(self, cache: Cache) -> None:
        """Drop the id reference; the memory goes when keys and transfers let go too.

        An unknown or already deallocated cache is a no-op.
        """
        if not isinstance(cache, Cache):
            raise InvalidParamError(f"deallocate_cache takes a Cache, got {cache!r:.80}")
        with self._lock:
            handle = self._handles.get(cache.cache_id)
            if handle is not cache:
                return
            self._handles.pop(cache.cache_id)
            cache.invalidate()
        self._apply(lambda s: reg.deallocate_cache(s, cache.cache_id))

    def remove_cache_key(self, cache_key: CacheKey) -> None:
        """Drop a key's reference without a pull (PROMPT only); unknown keys: no-op."""
        self._apply(lambda s: reg.remove_cache_key(s, cache_key))

    def _own(self, cache: object, name: str) -> Cache:
        if not isinstance(cache, Cache) or self._handles.get(cache.cache_id) is not cache:
            raise InvalidParamError(f"{name} is not a live cache of this manager: {cache!r:.80}")
        return cache

    # -- local operations ----------------------------------------------------------------
    def copy_cache(self, dst: Cache, src: Cache, dst_batch_index: int = 0,
                   src_batch_index: int = 0, offset: int = 0, size: int = -1) -> None:
        """Copy one batch entry's bytes ``[offset, offset+size)`` of every tensor."""
        copy_cache(self._own(dst, "dst"), self._own(src, "src"), dst_batch_index,
                   src_batch_index, offset, size)

    def copy_blocks(self, cache: Cache, copy_block_info: Mapping[int, Sequence[int]]) -> None:
        """Copy block ``src`` into each of its ``dst`` blocks (copy-on-write)."""
        copy_blocks(self._own(cache, "cache"), copy_block_info)

    def swap_blocks(self, src_cache: Cache, dst_cache: Cache,
                    src_to_dst: Mapping[int, int]) -> None:
        """Copy blocks HOST -> DEVICE (swap in) or DEVICE -> HOST (swap out)."""
        swap_blocks(self._own(src_cache, "src_cache"), self._own(dst_cache, "dst_cache"),
                    src_to_dst)

    # -- transfers -----------------------------------------------------------------------
    def _require(self, role: LLMRole, what: str) -> None:
        if self._state.role is not role:
            raise InvalidParamError(f"{what} is a {role.name} operation; this cluster is "
                                    f"{self._state.role.name}")

    def pull_cache(self, cache_key: CacheKey, cache: Cache, batch_index: int = 0) -> None:
        """Fetch the batch entry ``cache_key`` names into entry ``batch_index`` (DECODER).

        On success the key's reference on the prompt cluster is released.

        Raises:
            CacheNotExistError: the prompt cluster has no such key.
            TransferTimeoutError: the transfer did not finish in time.
            NotLinkedError: the key's cluster is not linked.
        """
        self._require(LLMRole.DECODER, "pull_cache")
        if not isinstance(cache_key, CacheKey):
            raise InvalidParamError(f"cache_key must be a CacheKey, got {cache_key!r:.80}")
        dst = self._own(cache, "cache")
        if dst.is_blocks_cache:
            raise InvalidParamError("pull_cache fills an ordinary cache; use pull_blocks")
        rows = check_rows("batch_index", [batch_index], dst.cache_desc.num_rows)
        link = self._link_to(cache_key.prompt_cluster_id)
        _transfer.pull(self, link, cache_key, self._internal[dst.cache_id], rows, None,
                       self._timeout_s)

    def pull_blocks(self, src_cache_key: BlocksCacheKey, dst_cache: Cache,
                    src_blocks: Sequence[int], dst_blocks: Sequence[int]) -> None:
        """Fetch the prompt cluster's ``src_blocks`` into ``dst_blocks`` (DECODER).

        Blocks pair by position.  Every index is checked (destinations here,
        sources by the prompt cluster) before anything moves.
        """
        self._require(LLMRole.DECODER, "pull_blocks")
        if not isinstance(src_cache_key, BlocksCacheKey):
            raise InvalidParamError(f"src_cache_key must be a BlocksCacheKey, got "
                                    f"{src_cache_key!r:.80}")
        dst = self._own(dst_cache, "dst_cache")
        if not dst.is_blocks_cache:
            raise InvalidParamError("pull_blocks fills a blocks cache; use pull_cache")
        src, rows = _block_lists(src_blocks, dst_blocks)
        check_rows("dst_blocks", rows, dst.cache_desc.num_rows)
        link = self._link_to(src_cache_key.prompt_cluster_id)
        _transfer.pull(self, link, src_cache_key, self._internal[dst.cache_id], rows, src,
                       self._timeout_s)

    def push_cache(self, dst_cache_key: CacheKeyByIdAndIndex, src_cache: Cache,
                   src_batch_index: int = 0) -> None:
        """Send batch entry ``src_batch_index`` into a decoder's cache (PROMPT)."""
        self._require(LLMRole.PROMPT, "push_cache")
        src = self._push_source(dst_cache_key, src_cache, blocks=False)
        rows = check_rows("src_batch_index", [src_batch_index], src.cache_desc.num_rows)
        self._push_all(src, dst_cache_key, rows, (dst_cache_key.batch_index,))

    def push_blocks(self, dst_cache_key: CacheKeyByIdAndIndex, src_cache: Cache,
                    src_blocks: Sequence[int], dst_blocks: Sequence[int]) -> None:
        """Send ``src_blocks`` into a decoder's blocks cache at ``dst_blocks`` (PROMPT)."""
        self._require(LLMRole.PROMPT, "push_blocks")
        src = self._push_source(dst_cache_key, src_cache, blocks=True)
        rows, dst = _block_lists(src_blocks, dst_blocks)
        check_rows("src_blocks", rows, src.cache_desc.num_rows)
        self._push_all(src, dst_cache_key, rows, tuple(dst))

    def _push_all(self, src: Cache, key: CacheKeyByIdAndIndex, rows: list[int],
                  dst_rows: tuple[int, ...]) -> None:
        n = src.cache_desc.num_tensors
        target = _push.PushTarget(self._link_to(key.cluster_id), key.cache_id, None, dst_rows,
                                  src.is_blocks_cache, tuple(range(n)), tuple(rows))
        _push.push(self, [target], self._internal[src.cache_id], n, None, self._timeout_s)

    def _push_source(self, key: object, cache: object, *, blocks: bool) -> Cache:
        if not isinstance(key, CacheKeyByIdAndIndex):
            raise InvalidParamError(f"dst_cache_key must be a CacheKeyByIdAndIndex, got "
                                    f"{key!r:.80}")
        src = self._own(cache, "src_cache")
        if src.is_blocks_cache != blocks:
            raise InvalidParamError(f"src_cache must {'' if blocks else 'not '}be a blocks "
                                    "cache here")
        return src

    def transfer_cache_async(self, src_cache: Cache, layer_synchronizer: LayerSynchronizer,
                             transfer_configs: Sequence[TransferConfig],
                             src_blocks: Sequence[int] | None = None,
                             dst_blocks: Sequence[int] | None = None, *,
                             tensor_num_per_layer: int = 2) -> CacheTask:
        """Push ``src_cache`` to decoders layer by layer while the model computes (PROMPT).

        Layer ``i`` (tensors ``i*t .. i*t+t-1``, ``t = tensor_num_per_layer``)
        is sent as soon as ``layer_synchronizer.synchronize_layer(i, timeout)``
        returns True.  Each :class:`TransferConfig` names a decoder cache (by
        its tensors' addresses, or by id) and may send a range of layers
        (``src_layer_range``) and, from an ordinary cache, one entry
        (``src_batch_index``).  Blocks caches name ``src_blocks`` /
        ``dst_blocks``.

        Raises:
            InvalidParamError: a bad config (addresses that do not count the
                tensors sent, a layer range past the cache, a batch index on
                a blocks cache), bad blocks; nothing is sent.
            NotLinkedError: a config's cluster is not linked.
        """
        self._require(LLMRole.PROMPT, "transfer_cache_async")
        src = self._own(src_cache, "src_cache")
        desc = src.cache_desc
        t = tensor_num_per_layer
        _transfer.layers_of(desc.num_tensors, t)  # checks t
        if not callable(getattr(layer_synchronizer, "synchronize_layer", None)):
            raise InvalidParamError("layer_synchronizer needs a synchronize_layer method")
        if isinstance(transfer_configs, TransferConfig) or not transfer_configs or \
                not all(isinstance(c, TransferConfig) for c in transfer_configs):
            raise InvalidParamError("transfer_configs must be a non-empty list of "
                                    "TransferConfig")
        if src.is_blocks_cache:
            rows, dst = _block_lists(src_blocks, dst_blocks)
            check_rows("src_blocks", rows, desc.num_rows)
        elif src_blocks is not None or dst_blocks is not None:
            raise InvalidParamError("src_blocks/dst_blocks apply to blocks caches only")
        targets = [self._target(src, c, t, rows if src.is_blocks_cache else None,
                                tuple(dst) if src.is_blocks_cache else None)
                   for c in transfer_configs]
        timeout_ms = int(self._timeout_s * 1000)

        def wait_layer(i: int) -> None:
            try:
                ok = layer_synchronizer.synchronize_layer(i, timeout_ms)
            except Exception as exc:
                raise DataDistFailedError(f"synchronize_layer({i}) raised {exc!r}") from exc
            if ok is not True:
                raise TransferTimeoutError(f"layer {i} was not computed in {timeout_ms} ms")

        internal = self._internal[src.cache_id]
        return CacheTask(lambda: _push.push(self, targets, internal, t, wait_layer,
                                            self._timeout_s))

    def _target(self, src: Cache, config: TransferConfig, t: int, rows: list[int] | None,
                dst_rows: tuple[int, ...] | None) -> _push.PushTarget:
        """The push target of one :class:`TransferConfig` (checked here, before any send)."""
        desc = src.cache_desc
        layers = config.src_layer_range or range(desc.num_tensors // t)
        if layers.stop * t > desc.num_tensors:
            raise InvalidParamError(f"src_layer_range {layers} passes the cache's "
                                    f"{desc.num_tensors // t} layers")
        tensors = tuple(range(layers.start * t, layers.stop * t))
        addrs = config.dst_addrs if isinstance(config.dst_addrs, tuple) else None
        if addrs is not None and len(addrs) != len(tensors):
            raise InvalidParamError(f"{len(addrs)} dst_addrs for {len(tensors)} tensors sent "
                                    "(one per tensor)")
        if src.is_blocks_cache:
            if config.src_batch_index:
                raise InvalidParamError("src_batch_index applies to ordinary caches only")
            src_rows = tuple(rows or ())
        else:
            src_rows = tuple(check_rows("src_batch_index", [config.src_batch_index],
                                        desc.num_rows))
            dst_rows = None if addrs is not None else (config.dst_batch_index,)
        return _push.PushTarget(self._link_to(config.dst_cluster_id), config.dst_cache_id,
                                addrs, dst_rows, src.is_blocks_cache, tensors, src_rows,
                                layers.start)

    # -- used by the transfer code -------------------------------------------------------
    def _pin(self, cache_id: int) -> None:
        with self._lock:
            self._state = reg.pin_cache(self._state, cache_id)

    def _unpin(self, cache_id: int) -> None:
        self._apply(lambda s: reg.unpin_cache(s, cache_id))

    def _pin_key(self, key: CacheKey | BlocksCacheKey) -> tuple[Cache, int]:
        with self._lock:
            record, batch_index = reg.find_key(self._state, key)
            self._state = reg.pin_cache(self._state, record.cache_id)
            return self._internal[record.cache_id], batch_index

    def _pin_addrs(self, addrs: Sequence[int]) -> tuple[Cache, list[int], int]:
        """The live cache whose tensors ``addrs`` name, pinned; its tensor indices and the
        row they name (see :meth:`Cache.locate`).

        Raises:
            InvalidParamError: no cache of this cluster, or not one cache, is named.
        """
        with self._lock:
            for cache in self._internal.values():
                found = cache.locate(addrs)
                if found is not None:
                    self._state = reg.pin_cache(self._state, cache.cache_id)
                    return cache, *found
        raise InvalidParamError(f"addresses {[hex(a) for a in addrs[:4]]} name no cache of "
                                f"cluster {self._state.cluster_id}")

    def _pin_id(self, cache_id: int) -> Cache:
        with self._lock:
            record = reg.find_cache(self._state, cache_id)
            self._state = reg.pin_cache(self._state, record.cache_id)
            return self._internal[cache_id]

    def _release_key(self, key: CacheKey) -> None:
        self._apply(lambda s: reg.remove_cache_key(s, key))

    def __repr__(self) -> str:
        s = self._state
        return (f"<CacheManager {s.role.name} cluster {s.cluster_id}: {len(s.caches)} caches, "
                f"{s.used_bytes()} bytes used>")


