"""kvfunc's paged caches in a DataDist pool, and a request's KV moved between two clusters.

:func:`allocate_paged_caches` carves a model's paged cache tensors out of
the pool: the entries of one manager key with one block shape and dtype
become the tensors of one blocks cache (full-attention K and V of every
layer, say), so a request's blocks move with one pull per cache.  The model
gets the tensors (views into the pool) through a new ``ModelCacheInfo``.

Both sides then list their paged tensors with the allocator's
``KVCacheManager.get_contiguous_buf_infos()`` and pair the entries **by
position** (:meth:`PagedCaches.layout`, :func:`check_paired`): entry ``i``
here and there must be the same manager key, block bytes, storage block
size, cache and tensor.  Block ids pair by position as well, per manager
key, up to the shorter list, so logical block ``k`` of the prompt side
lands in logical block ``k`` of the decoder.  Pairs where either side holds
the null block (a sliding window's dead head, which the two sides size
differently) are skipped: there is nothing live to send, or nowhere live to
put it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from kvfunc.core import NULL_BLOCK, ModelCacheInfo
from kvfunc.datadist._cache_manager import CacheManager, CacheTask, LayerSynchronizer
from kvfunc.datadist._errors import InvalidParamError
from kvfunc.datadist._pool import Cache
from kvfunc.datadist._types import (
    BlocksCacheKey,
    CacheDesc,
    CacheKeyByIdAndIndex,
    DataType,
    LLMRole,
    TransferConfig,
)
from kvfunc.shell import plan_cache_tensors

__all__ = ["PagedCaches", "allocate_paged_caches", "check_paired", "pull_request_blocks",
           "push_request_blocks"]

Layout = tuple[tuple[str, int, int, int, int], ...]


@attrs.frozen
class PagedCaches:
    """The blocks caches behind a model's paged tensors (see the module docstring)."""

    caches: tuple[Cache, ...]
    manager_keys: tuple[str, ...]  # per cache
    model_ids: tuple[int, ...]  # per cache: its BlocksCacheKey model id on a PROMPT cluster
    layer_ids: tuple[tuple[int, ...], ...]  # per cache: the model layer of each of its layers
    cache_info: ModelCacheInfo  # the model's caches, each entry's tensor a pool view

    @property
    def cache_ids(self) -> tuple[int, ...]:
        """The caches' ids (what a prompt cluster needs to push into them)."""
        return tuple(c.cache_id for c in self.caches)

    def tensors_per_layer(self, index: int) -> int:
        """Tensors of cache ``index`` that belong to one model layer."""
        return self.caches[index].cache_desc.num_tensors // len(self.layer_ids[index])

    def layout(self, buf_infos: tuple[list[int], list[int], list[int], list[str], list[int]]
               ) -> Layout:
        """Each ``get_contiguous_buf_infos()`` entry as ``(key, item_len, block_size, cache,
        tensor)``, in its order; JSON-able, for :func:`check_paired` with the peer's.

        Raises:
            InvalidParamError: an entry is not exactly one tensor of these caches.
        """
        where = {t.data_ptr(): (c, j) for c, cache in enumerate(self.caches)
                 for j, t in enumerate(cache.tensors)}
        ptrs, lens, item_lens, keys, block_sizes = buf_infos
        out = []
        for ptr, nbytes, item, key, bs in zip(ptrs, lens, item_lens, keys, block_sizes,
                                              strict=True):
            found = where.get(ptr)
            if found is None or self.caches[found[0]].cache_desc.tensor_nbytes != nbytes:
                raise InvalidParamError(f"buffer {ptr:#x} of {nbytes} bytes ({key}) is not a "
                                        "tensor of these paged caches")
            out.append((key, item, bs, *found))
        return tuple(out)


def check_paired(layout: Sequence[Sequence[Any]], peer_layout: Sequence[Sequence[Any]]) -> None:
    """Both sides' buffer lists pair by position: same length, same entry at each position.

    >>> check_paired([("FullAttention", 512, 16, 0, 0)], [["FullAttention", 512, 16, 0, 0]])
    >>> check_paired([("FullAttention", 512, 16, 0, 0)], [])
    Traceback (most recent call last):
    ...
    kvfunc.datadist._errors.InvalidParamError: LLM_PARAM_INVALID: KV entry count mismatch: ...
    """
    if len(layout) != len(peer_layout):
        raise InvalidParamError(f"KV entry count mismatch: {len(layout)} here, "
                                f"{len(peer_layout)} on the peer")
    for i, (mine, theirs) in enumerate(zip(layout, peer_layout, strict=True)):
        if list(mine) != list(theirs):
            raise InvalidParamError(f"KV entry {i} does not pair: {list(mine)} here, "
                                    f"{list(theirs)} on the peer")


def allocate_paged_caches(cache_manager: CacheManager, cache_info: ModelCacheInfo,
                          block_num_by_type: Mapping[str, int], *, model_id_base: int = 0
                          ) -> PagedCaches:
    """Carve every paged cache tensor of ``cache_info`` out of the DataDist pool.

    On a PROMPT cluster cache ``g`` is named ``BlocksCacheKey(cluster, model_id_base + g)``
    so decoders can pull from it.  All or nothing: if the pool runs out part
    way, the caches already carved are given back and the error raised.

    Raises:
        PoolOutOfMemoryError: the pool cannot hold them all.
        InvalidCacheInfo, MissingKeyError, InvalidArgumentError: as
            ``kvfunc.shell.plan_cache_tensors``.
    """
    specs = plan_cache_tensors(cache_info, block_num_by_type)
    groups: dict[tuple[str, tuple[int, ...], Any], list[int]] = {}
    for n, spec in enumerate(specs):
        groups.setdefault((spec.entry.group_key, spec.shape, spec.dtype), []).append(n)
    state = cache_manager.state
    caches: list[Cache] = []
    tensor_of: dict[int, Any] = {}
    layer_ids: list[tuple[int, ...]] = []
    try:
        for g, ((_, shape, dtype), members) in enumerate(groups.items()):
            desc = CacheDesc(len(members), shape, DataType(str(dtype).removeprefix("torch.")))
            name = BlocksCacheKey(state.cluster_id, model_id_base + g) \
                if state.role is LLMRole.PROMPT else None
            cache = cache_manager.allocate_blocks_cache(desc, name)
            caches.append(cache)
            layers = [specs[n].layer_idx for n in members]
            distinct = tuple(dict.fromkeys(layers))
            per_layer = len(members) // len(distinct)
            if any(layers.count(layer) != per_layer for layer in distinct):
                distinct = tuple(layers)  # uneven: one tensor per layer step
            layer_ids.append(distinct)
            for j, n in enumerate(members):
                tensor_of[n] = cache.tensors[j]
    except BaseException:
        for cache in caches:
            cache_manager.deallocate_cache(cache)
        raise
    tensors = iter(tensor_of[n] for n in range(len(specs)))
    layers_out = []
    for layer in cache_info.layer_infos:
        entries = tuple(attrs.evolve(e, tensor=next(tensors)) if e.needs_block else e
                        for e in layer.caches)
        layers_out.append(attrs.evolve(layer, caches=entries))
    info = attrs.evolve(cache_info, layer_infos=layers_out)
    return PagedCaches(tuple(caches), tuple(k for k, _, _ in groups),
                       tuple(model_id_base + g for g in range(len(groups))), tuple(layer_ids),
                       info)


def _pairs(src: Sequence[int], dst: Sequence[int]) -> tuple[list[int], list[int]]:
    pairs = [(s, d) for s, d in zip(src, dst, strict=False)
             if s != NULL_BLOCK and d != NULL_BLOCK]
    return [s for s, _ in pairs], [d for _, d in pairs]


def pull_request_blocks(cache_manager: CacheManager, paged: PagedCaches, layout: Layout,
                        peer_layout: Sequence[Sequence[Any]], prompt_cluster_id: int,
                        src_block_ids: Mapping[str, Sequence[int]],
                        dst_block_ids: Mapping[str, Sequence[int]]) -> None:
    """Pull one request's blocks from a prompt cluster into this decoder's (one pull per cache).

    ``src_block_ids`` / ``dst_block_ids`` are ``get_block_ids(request_id)`` of
    the prompt and the decoder side.
    """
    check_paired(layout, peer_layout)
    for g, cache in enumerate(paged.caches):
        key = paged.manager_keys[g]
        src, dst = _pairs(src_block_ids.get(key, ()), dst_block_ids.get(key, ()))
        if src:
            cache_manager.pull_blocks(BlocksCacheKey(prompt_cluster_id, paged.model_ids[g]),
                                      cache, src, dst)


class _CacheLayers:
    """Maps a cache's own layer ``i`` to the model layer the synchronizer knows."""

    def __init__(self, inner: LayerSynchronizer, layer_ids: tuple[int, ...]) -> None:
        self.inner, self.layer_ids = inner, layer_ids

    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        return self.inner.synchronize_layer(self.layer_ids[layer_index], timeout_in_millis)


def push_request_blocks(cache_manager: CacheManager, paged: PagedCaches, layout: Layout,
                        peer_layout: Sequence[Sequence[Any]], decoder_cluster_id: int,
                        dst_cache_ids: Sequence[int], src_block_ids: Mapping[str, Sequence[int]],
                        dst_block_ids: Mapping[str, Sequence[int]],
                        layer_synchronizer: LayerSynchronizer | None = None) -> list[CacheTask]:
    """Push one request's blocks into a decoder's caches ``dst_cache_ids`` (paired by position).

    With a ``layer_synchronizer`` (model layer indices) each cache is sent
    layer by layer as the model computes, and the running tasks are
    returned; without one the pushes are done when this returns (``[]``).
    """
    check_paired(layout, peer_layout)
    if len(dst_cache_ids) != len(paged.caches):
        raise InvalidParamError(f"{len(dst_cache_ids)} decoder caches for "
                                f"{len(paged.caches)} caches here")
    tasks = []
    for g, cache in enumerate(paged.caches):
        key = paged.manager_keys[g]
        src, dst = _pairs(src_block_ids.get(key, ()), dst_block_ids.get(key, ()))
        if not src:
            continue
        if layer_synchronizer is None:
            cache_manager.push_blocks(CacheKeyByIdAndIndex(decoder_cluster_id,
                                                           dst_cache_ids[g]), cache, src, dst)
            continue
        tasks.append(cache_manager.transfer_cache_async(
            cache, _CacheLayers(layer_synchronizer, paged.layer_ids[g]),
            [TransferConfig(decoder_cluster_id, dst_cache_ids[g])], src, dst,
            tensor_num_per_layer=paged.tensors_per_layer(g)))
    return tasks
