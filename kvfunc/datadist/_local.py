"""Local cache operations: copy a batch entry, copy blocks, swap blocks host <-> device.

Each is one batched tensor operation over every tensor of the cache at
once: a cache's tensors are back to back in its pool (see
:meth:`Cache.stacked`), so "block ``b`` of every tensor" is one row of a
``[num_rows, num_tensors, row_bytes]`` view, and a copy of ``n`` blocks is
one ``index_select`` + ``index_copy_`` whatever the number of tensors.
Every argument is checked before the first write; an error carries
``LLM_PARAM_INVALID`` and leaves both caches as they were.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvfunc.core import KVFuncError, LLMError
from kvfunc.datadist._errors import InvalidParamError
from kvfunc.datadist._pool import Cache
from kvfunc.datadist._types import Placement
from kvfunc.shell import copy_blocks as _copy_rows
from kvfunc.shell import swap_blocks as _swap_rows

__all__ = ["check_rows", "copy_blocks", "copy_cache", "swap_blocks"]


def check_rows(name: str, rows: object, num_rows: int) -> list[int]:
    """``rows`` as a list of ints in ``[0, num_rows)``, or :class:`InvalidParamError`.

    >>> check_rows("dst_blocks", (3, 1), 4)
    [3, 1]
    >>> check_rows("dst_blocks", [4], 4)
    Traceback (most recent call last):
    ...
    kvfunc.datadist._errors.InvalidParamError: LLM_PARAM_INVALID: dst_blocks holds 4, ...
    """
    if isinstance(rows, str | bytes) or not isinstance(rows, Sequence):
        raise InvalidParamError(f"{name} must be a list of ints, got {rows!r:.80}")
    out = list(rows)
    for row in out:
        if type(row) is not int or not 0 <= row < num_rows:
            raise InvalidParamError(f"{name} holds {row!r}, outside [0, {num_rows})")
    return out


def _same_blocks(what: str, a: Cache, b: Cache) -> None:
    da, db = a.cache_desc, b.cache_desc
    if (da.num_tensors, da.row_shape, da.data_type) != (db.num_tensors, db.row_shape,
                                                        db.data_type):
        msg = (f"{what}: caches {a.cache_id} and {b.cache_id} do not match: "
               f"{da.num_tensors} x {list(da.row_shape)} {da.data_type.name} vs "
               f"{db.num_tensors} x {list(db.row_shape)} {db.data_type.name}")
        raise InvalidParamError(msg)


def _as_params(exc: KVFuncError) -> LLMError:
    return exc if isinstance(exc, LLMError) else InvalidParamError(str(exc))


def copy_cache(dst: Cache, src: Cache, dst_batch_index: int = 0, src_batch_index: int = 0,
               offset: int = 0, size: int = -1) -> None:
    """Copy bytes ``[offset, offset + size)`` of batch entry ``src_batch_index`` of
    every tensor of ``src`` into batch entry ``dst_batch_index`` of ``dst``.

    ``size = -1`` copies to the end of the source entry.  The caches need the
    same number of tensors and dtype; their entries may differ in length
    (a shared prefix copied into a longer request cache).
    """
    for cache in (dst, src):
        cache.check_valid()
        if cache.is_blocks_cache:
            raise InvalidParamError(f"copy_cache takes ordinary caches; {cache!r} is a "
                                    "blocks cache (use copy_blocks)")
    ds, ss = dst.cache_desc, src.cache_desc
    if (ds.num_tensors, ds.data_type) != (ss.num_tensors, ss.data_type):
        raise InvalidParamError(f"copy_cache: {ss.num_tensors} {ss.data_type.name} tensors "
                                f"into {ds.num_tensors} {ds.data_type.name} tensors")
    check_rows("dst_batch_index", [dst_batch_index], ds.num_rows)
    check_rows("src_batch_index", [src_batch_index], ss.num_rows)
    item = ss.data_type.itemsize
    valid = type(offset) is int and type(size) is int and offset >= 0
    end = (ss.row_nbytes if size == -1 else offset + size) if valid else 0
    if (not valid or offset % item or end % item or end <= offset
            or end > min(ss.row_nbytes, ds.row_nbytes)):
        msg = (f"copy_cache: offset={offset!r}, size={size!r} must pick whole elements inside "
               f"both entries ({ss.row_nbytes} and {ds.row_nbytes} bytes)")
        raise InvalidParamError(msg)
    target = dst.stacked()[dst_batch_index, :, offset:end]
    target.copy_(src.stacked()[src_batch_index, :, offset:end])


def copy_blocks(cache: Cache, copy_block_info: Mapping[int, Sequence[int]]) -> None:
    """Copy block ``src`` to each of its ``dst`` blocks, inside one blocks cache.

    All sources are read before any destination is written.
    """
    cache.check_valid()
    if not cache.is_blocks_cache:
        raise InvalidParamError(f"copy_blocks takes a blocks cache, got {cache!r}")
    if not isinstance(copy_block_info, Mapping):
        raise InvalidParamError(f"copy_block_info must map src -> [dst, ...], got "
                                f"{copy_block_info!r:.80}")
    n = cache.cache_desc.num_rows
    srcs: list[int] = []
    dsts: list[int] = []
    for src, targets in copy_block_info.items():
        check_rows("copy_block_info source", [src], n)
        row_targets = check_rows(f"copy_block_info[{src}]", targets, n)
        srcs += [src] * len(row_targets)
        dsts += row_targets
    try:
        _copy_rows([cache.stacked()], srcs, dsts)
    except KVFuncError as exc:
        raise _as_params(exc) from exc


def swap_blocks(src_cache: Cache, dst_cache: Cache, src_to_dst: Mapping[int, int]) -> None:
    """Copy blocks between a HOST and a DEVICE blocks cache (swap out or in)."""
    for cache in (src_cache, dst_cache):
        cache.check_valid()
        if not cache.is_blocks_cache:
            raise InvalidParamError(f"swap_blocks takes blocks caches, got {cache!r}")
    places = (src_cache.cache_desc.placement, dst_cache.cache_desc.placement)
    if places not in ((Placement.HOST, Placement.DEVICE), (Placement.DEVICE, Placement.HOST)):
        raise InvalidParamError(f"swap_blocks goes HOST -> DEVICE or DEVICE -> HOST, not "
                                f"{places[0].name} -> {places[1].name}")
    _same_blocks("swap_blocks", src_cache, dst_cache)
    if not isinstance(src_to_dst, Mapping):
        raise InvalidParamError(f"src_to_dst must map src -> dst, got {src_to_dst!r:.80}")
    srcs = check_rows("src_to_dst sources", list(src_to_dst), src_cache.cache_desc.num_rows)
    dsts = check_rows("src_to_dst targets", list(src_to_dst.values()),
                      dst_cache.cache_desc.num_rows)
    try:
        _swap_rows([src_cache.stacked()], [dst_cache.stacked()], srcs, dsts)
    except KVFuncError as exc:
        raise _as_params(exc) from exc
