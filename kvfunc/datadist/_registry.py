"""The cache registry, pure: which caches exist, where, and who references them.

Theory of operation
-------------------
A :class:`RegistryState` is an immutable value: one :class:`RangeState` per
configured pool (DEVICE, HOST), the live caches by ``cache_id``, and the key
bindings (``CacheKey`` / ``BlocksCacheKey`` -> ``(cache_id, batch_index)``).
Every operation is a function ``(state, ...) -> new state`` (plus what the
caller needs), so a refused or failed call changes nothing, and the torch
layer swaps one reference under a lock.

The reference-count rule (LLM-DataDist's): a cache is held by its
``cache_id`` and by each ``CacheKey`` bound to it; its memory goes back to
the pool only when every reference is gone.  Two more holders exist here:

* a blocks cache is held by its id only (its ``BlocksCacheKey`` names it
  but does not keep it alive);
* a *pin* holds a cache while a transfer reads or writes it, so dropping
  the last reference mid-transfer defers the release to the transfer's end
  instead of handing memory that is being written to someone else.

Keys exist only on the PROMPT role.  A key bound twice is an error;
deallocating an unknown or already freed cache, or removing an unknown key,
is a no-op.  Pure: standard library, attrs and kvfunc's pure parts only.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from kvfunc.core._internal import FrozenDict
from kvfunc.datadist._errors import CacheNotExistError, InvalidParamError
from kvfunc.datadist._ranges import (
    RangeState,
    allocate_range,
    check_range_invariants,
    page_round,
    release_range,
)
from kvfunc.datadist._types import BlocksCacheKey, CacheDesc, CacheKey, LLMRole, Placement

__all__ = [
    "AnyKey",
    "CacheRecord",
    "RegistryState",
    "allocate_blocks_cache",
    "allocate_cache",
    "check_registry",
    "deallocate_cache",
    "find_cache",
    "find_key",
    "pin_cache",
    "remove_cache_key",
    "unpin_cache",
]

AnyKey = CacheKey | BlocksCacheKey


@attrs.frozen
class CacheRecord:
    """One live cache: its desc, its byte range in its pool, and its references."""

    cache_id: int
    desc: CacheDesc
    offset: int
    nbytes: int  # reserved: page rounded
    is_blocks_cache: bool
    has_id_ref: bool = True
    keys: tuple[AnyKey, ...] = ()
    pins: int = 0

    @property
    def alive(self) -> bool:
        """Whether anything still holds the memory."""
        held_by_keys = bool(self.keys) and not self.is_blocks_cache
        return self.has_id_ref or held_by_keys or self.pins > 0


@attrs.frozen
class RegistryState:
    """Pools, live caches and key bindings of one cluster (see the module docstring)."""

    role: LLMRole
    cluster_id: int
    pools: FrozenDict[Placement, RangeState]
    caches: FrozenDict[int, CacheRecord]
    bindings: FrozenDict[AnyKey, tuple[int, int]]
    next_cache_id: int = 1

    @classmethod
    def create(cls, role: LLMRole, cluster_id: int,
               pool_bytes: dict[Placement, tuple[int, int]]) -> RegistryState:
        """A registry with pools ``{placement: (size, page_size)}`` and no caches.

        >>> s = RegistryState.create(LLMRole.PROMPT, 0, {Placement.DEVICE: (1 << 20, 4096)})
        >>> s.pools[Placement.DEVICE].free_bytes
        1048576
        """
        if not isinstance(role, LLMRole):
            raise InvalidParamError(f"role must be an LLMRole, got {role!r}")
        pools = FrozenDict({p: RangeState.create(size, page)
                            for p, (size, page) in pool_bytes.items()})
        return cls(role, cluster_id, pools, FrozenDict(), FrozenDict())

    def used_bytes(self, placement: Placement = Placement.DEVICE) -> int:
        """Bytes of the pool held by live caches (0 for an unconfigured pool)."""
        pool = self.pools.get(placement)
        return 0 if pool is None else pool.used_bytes


@attrs.frozen
class CacheAllocation:
    """The result of an allocation: ``ok`` False (pool exhausted) leaves ``state`` as it was."""

    ok: bool
    state: RegistryState
    record: CacheRecord | None
    reason: str = ""


def _with(state: RegistryState, caches: dict[int, CacheRecord],
          bindings: dict[AnyKey, tuple[int, int]] | None = None,
          pools: dict[Placement, RangeState] | None = None, next_id: int | None = None
          ) -> RegistryState:
    return RegistryState(
        state.role, state.cluster_id,
        state.pools if pools is None else FrozenDict(pools), FrozenDict(caches),
        state.bindings if bindings is None else FrozenDict(bindings),
        state.next_cache_id if next_id is None else next_id)


def _check_key_owner(state: RegistryState, key: AnyKey) -> None:
    if state.role is not LLMRole.PROMPT:
        raise InvalidParamError(f"cache keys are only accepted on the PROMPT role, this "
                                f"cluster is {state.role.name}: {key!r}")
    if key.prompt_cluster_id != state.cluster_id:
        raise InvalidParamError(f"{key!r} names prompt cluster {key.prompt_cluster_id}, "
                                f"but this cluster is {state.cluster_id}")
    if key in state.bindings:
        raise InvalidParamError(f"{key!r} is already bound to cache "
                                f"{state.bindings[key][0]}")


def _allocate(state: RegistryState, desc: CacheDesc, keys: dict[AnyKey, int],
              is_blocks: bool) -> CacheAllocation:
    if not isinstance(desc, CacheDesc):
        raise InvalidParamError(f"cache_desc must be a CacheDesc, got {desc!r}")
    pool = state.pools.get(desc.placement)
    if pool is None:
        raise InvalidParamError(f"no {desc.placement.name} memory pool is configured "
                                f"(llm.{'Host' if desc.placement is Placement.HOST else ''}"
                                "MemPoolConfig)")
    found = allocate_range(pool, desc.nbytes)
    if found is None:
        reason = (f"the {desc.placement.name} pool cannot hold {desc.nbytes} bytes: "
                  f"{pool.free_bytes} of {pool.size} free, largest free range "
                  f"{max((n for _, n in pool.free), default=0)}")
        return CacheAllocation(False, state, None, reason)
    new_pool, offset = found
    cid = state.next_cache_id
    record = CacheRecord(cid, desc, offset, page_round(desc.nbytes, pool.page_size), is_blocks,
                         keys=tuple(keys))
    bindings = dict(state.bindings)
    bindings.update({key: (cid, index) for key, index in keys.items()})
    new = _with(state, {**state.caches, cid: record}, bindings,
                {**state.pools, desc.placement: new_pool}, cid + 1)
    return CacheAllocation(True, new, record)


def allocate_cache(state: RegistryState, desc: CacheDesc,
                   cache_keys: Sequence[CacheKey | None] = ()) -> CacheAllocation:
    """Carve a cache out of its pool; ``cache_keys[i]`` names batch entry ``i``.

    ``None`` entries leave a batch index unnamed.  Returns ``ok=False`` with
    the input state when the pool has no free range large enough.

    Raises:
        InvalidParamError: keys on the DECODER role, for another cluster,
            already bound or repeated, more keys than batch entries, no pool
            for the desc's placement.

    >>> from kvfunc.datadist._types import DataType
    >>> s = RegistryState.create(LLMRole.PROMPT, 0, {Placement.DEVICE: (1 << 16, 4096)})
    >>> a = allocate_cache(s, CacheDesc(2, (2, 8), DataType.DT_FLOAT), [CacheKey(0, 1)])
    >>> a.ok, a.record.cache_id, a.state.bindings[CacheKey(0, 1)], a.state.used_bytes()
    (True, 1, (1, 0), 4096)
    """
    if isinstance(cache_keys, CacheKey | str) or not isinstance(cache_keys, Sequence):
        raise InvalidParamError(f"cache_keys must be a list of CacheKey, got {cache_keys!r}")
    keys: dict[AnyKey, int] = {}
    for index, key in enumerate(cache_keys):
        if key is None:
            continue
        if not isinstance(key, CacheKey):
            raise InvalidParamError(f"cache_keys[{index}] must be a CacheKey, got {key!r}")
        _check_key_owner(state, key)
        if key in keys:
            raise InvalidParamError(f"{key!r} appears twice in cache_keys")
        keys[key] = index
    if isinstance(desc, CacheDesc) and len(cache_keys) > desc.num_rows:
        raise InvalidParamError(f"{len(cache_keys)} cache keys for a batch of {desc.num_rows}")
    return _allocate(state, desc, keys, False)


def allocate_blocks_cache(state: RegistryState, desc: CacheDesc,
                          blocks_cache_key: BlocksCacheKey | None = None) -> CacheAllocation:
    """Carve a blocks cache (``desc.shape[0]`` blocks) out of its pool.

    >>> from kvfunc.datadist._types import DataType
    >>> s = RegistryState.create(LLMRole.PROMPT, 0, {Placement.DEVICE: (1 << 16, 4096)})
    >>> a = allocate_blocks_cache(s, CacheDesc(2, (10, 64), DataType.DT_INT8), BlocksCacheKey(0))
    >>> a.record.is_blocks_cache, a.state.bindings[BlocksCacheKey(0)]
    (True, (1, 0))
    """
    keys: dict[AnyKey, int] = {}
    if blocks_cache_key is not None:
        if not isinstance(blocks_cache_key, BlocksCacheKey):
            raise InvalidParamError(f"blocks_cache_key must be a BlocksCacheKey, got "
                                    f"{blocks_cache_key!r}")
        _check_key_owner(state, blocks_cache_key)
        keys[blocks_cache_key] = 0
    return _allocate(state, desc, keys, True)


def _settle(state: RegistryState, record: CacheRecord, caches: dict[int, CacheRecord],
            bindings: dict[AnyKey, tuple[int, int]]) -> tuple[RegistryState, tuple[int, ...]]:
    """Store ``record`` (updated) or, when nothing holds it, release its memory."""
    if record.alive:
        caches[record.cache_id] = record
        return _with(state, caches, bindings), ()
    del caches[record.cache_id]
    for key in record.keys:
        bindings.pop(key, None)
    placement = record.desc.placement
    pool = release_range(state.pools[placement], record.offset, record.nbytes)
    return _with(state, caches, bindings, {**state.pools, placement: pool}), (record.cache_id,)


def deallocate_cache(state: RegistryState, cache_id: int
                     ) -> tuple[RegistryState, tuple[int, ...]]:
    """Drop the ``cache_id`` reference; returns the new state and the ids released.

    The memory stays while keys (of an ordinary cache) or pins hold it.  A
    blocks cache's key is unbound at once.  Unknown or freed ids: no-op.

    >>> from kvfunc.datadist._types import DataType
    >>> s = RegistryState.create(LLMRole.PROMPT, 0, {Placement.DEVICE: (1 << 16, 4096)})
    >>> s = allocate_cache(s, CacheDesc(1, (1, 8), DataType.DT_FLOAT), [CacheKey(0, 1)]).state
    >>> s, released = deallocate_cache(s, 1); released, s.used_bytes()
    ((), 4096)
    >>> s, released = remove_cache_key(s, CacheKey(0, 1)); released, s.used_bytes()
    ((1,), 0)
    """
    record = state.caches.get(cache_id) if type(cache_id) is int else None
    if record is None or not record.has_id_ref:
        return state, ()
    bindings = dict(state.bindings)
    keys = record.keys
    if record.is_blocks_cache:
        for key in keys:
            bindings.pop(key, None)
        keys = ()
    updated = attrs.evolve(record, has_id_ref=False, keys=keys)
    return _settle(state, updated, dict(state.caches), bindings)


def remove_cache_key(state: RegistryState, cache_key: CacheKey
                     ) -> tuple[RegistryState, tuple[int, ...]]:
    """Drop a key's reference (PROMPT only; also what a successful pull does).

    The key can no longer be pulled.  An unknown key is a no-op.

    Raises:
        InvalidParamError: not a ``CacheKey``, or the DECODER role.

    >>> s = RegistryState.create(LLMRole.PROMPT, 0, {})
    >>> remove_cache_key(s, CacheKey(0, 5))[0] is s
    True
    """
    if not isinstance(cache_key, CacheKey):
        raise InvalidParamError(f"cache_key must be a CacheKey, got {cache_key!r}")
    if state.role is not LLMRole.PROMPT:
        raise InvalidParamError("remove_cache_key is only accepted on the PROMPT role")
    bound = state.bindings.get(cache_key)
    if bound is None:
        return state, ()
    bindings = dict(state.bindings)
    del bindings[cache_key]
    record = state.caches[bound[0]]
    updated = attrs.evolve(record, keys=tuple(k for k in record.keys if k != cache_key))
    return _settle(state, updated, dict(state.caches), bindings)


def find_key(state: RegistryState, key: AnyKey) -> tuple[CacheRecord, int]:
    """The cache and batch index a key names.

    Raises:
        CacheNotExistError: no such key (never bound, pulled or removed).

    >>> find_key(RegistryState.create(LLMRole.PROMPT, 0, {}), CacheKey(0, 1))
    Traceback (most recent call last):
    ...
    kvfunc.datadist._errors.CacheNotExistError: LLM_KV_CACHE_NOT_EXIST: no cache under ...
    """
    bound = state.bindings.get(key)
    if bound is None:
        raise CacheNotExistError(f"no cache under {key!r} on cluster {state.cluster_id} "
                                 "(never allocated, already pulled, or removed)")
    return state.caches[bound[0]], bound[1]


def find_cache(state: RegistryState, cache_id: int) -> CacheRecord:
    """The live cache with this id whose id reference is held.

    Raises:
        CacheNotExistError: no such cache, or it was deallocated.
    """
    record = state.caches.get(cache_id)
    if record is None or not record.has_id_ref:
        raise CacheNotExistError(f"no cache {cache_id} on cluster {state.cluster_id}")
    return record


def pin_cache(state: RegistryState, cache_id: int) -> RegistryState:
    """Hold a live cache for a transfer (see :func:`unpin_cache`)."""
    record = state.caches[cache_id]
    return _with(state, {**state.caches, cache_id: attrs.evolve(record, pins=record.pins + 1)})


def unpin_cache(state: RegistryState, cache_id: int) -> tuple[RegistryState, tuple[int, ...]]:
    """Release a transfer's hold; frees the memory if nothing else holds it."""
    record = state.caches[cache_id]
    assert record.pins > 0, f"cache {cache_id} is not pinned"
    updated = attrs.evolve(record, pins=record.pins - 1)
    return _settle(state, updated, dict(state.caches), dict(state.bindings))


def check_registry(state: RegistryState) -> None:
    """Assert the registry's invariants (tests call it after every step).

    Ranges tile each pool exactly; every record is alive, inside its pool
    and keyed by its id; bindings and records' keys agree; batch indices
    are in range.
    """
    held: dict[Placement, list[tuple[int, int]]] = {p: [] for p in state.pools}
    for cid, record in state.caches.items():
        assert cid == record.cache_id and cid < state.next_cache_id, record
        assert record.alive, f"dead record kept: {record}"
        assert record.nbytes >= record.desc.nbytes, record
        held[record.desc.placement].append((record.offset, record.nbytes))
        for key in record.keys:
            bound = state.bindings.get(key)
            assert bound is not None and bound[0] == cid, (key, bound, cid)
    for p, pool in state.pools.items():
        check_range_invariants(pool, held[p])
    for key, (cid, index) in state.bindings.items():
        holder = state.caches.get(cid)
        assert holder is not None and key in holder.keys, (key, cid)
        assert 0 <= index < holder.desc.num_rows, (key, index)
