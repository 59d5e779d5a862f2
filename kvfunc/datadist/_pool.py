"""The pre-allocated pools (one byte tensor per placement) and the caches viewed in them.

A pool is allocated once, when an ``LLMDataDist`` starts; every cache is a
set of views into it at the offset the registry chose, so creating or
dropping a cache never calls the device allocator.  Tensor ``i`` of a cache
starts ``i * tensor_nbytes`` after the cache's offset: the tensors of one
cache are back to back, which lets a batched operation treat them as one
``[num_tensors, num_rows, row_bytes]`` byte view (:meth:`Cache.stacked`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvfunc.datadist._errors import InvalidParamError
from kvfunc.datadist._registry import CacheRecord
from kvfunc.datadist._types import CacheDesc, Placement, PoolConfig
from kvfunc.shell import empty_aligned, resolve_device, torch_dtype

__all__ = ["Cache", "MemoryPool"]


class MemoryPool:
    """One aligned byte tensor per configured placement.

    The DEVICE pool lives on ``device``; the HOST pool in host memory
    (pinned when the device is an accelerator, so swaps are DMA copies).

    >>> pool = MemoryPool({Placement.DEVICE: PoolConfig(1 << 16, 12)}, "cpu")
    >>> pool.buffers[Placement.DEVICE].numel(), pool.buffers[Placement.DEVICE].data_ptr() % 4096
    (65536, 0)
    """

    def __init__(self, configs: dict[Placement, PoolConfig], device: str | torch.device) -> None:
        self.device = resolve_device(device)
        self.buffers: dict[Placement, torch.Tensor] = {}
        for placement, cfg in configs.items():
            size = cfg.memory_size // cfg.page_size * cfg.page_size
            if placement is Placement.DEVICE:
                buf = empty_aligned((size,), torch.uint8, self.device, cfg.page_size)
            else:
                buf = empty_aligned((size,), torch.uint8, torch.device("cpu"), cfg.page_size)
                if self.device.type == "cuda":
                    buf = buf.pin_memory()
            self.buffers[placement] = buf

    def region(self, record: CacheRecord) -> torch.Tensor:
        """The bytes of one cache: ``[num_tensors, tensor_nbytes]`` uint8."""
        desc = record.desc
        buf = self.buffers[desc.placement]
        return buf[record.offset:record.offset + desc.nbytes].view(desc.num_tensors, -1)


class Cache:
    """A cache carved out of a pool: ``cache_desc.num_tensors`` tensor views.

    Do not use a cache after ``deallocate_cache``: its tensors are dropped
    (``tensors`` becomes empty) and the memory may belong to another cache.
    """

    def __init__(self, record: CacheRecord, region: torch.Tensor) -> None:
        desc = record.desc
        dtype = torch_dtype(desc.data_type.value)
        self.cache_id = record.cache_id
        self.cache_desc: CacheDesc = desc
        self.is_blocks_cache = record.is_blocks_cache
        self._region = region
        self.tensors: list[torch.Tensor] = [row.view(dtype).view(desc.shape) for row in region]

    @property
    def valid(self) -> bool:
        """False once the cache was deallocated."""
        return bool(self.tensors)

    @property
    def tensor_addrs(self) -> list[int]:
        """The data pointer of each tensor."""
        return [t.data_ptr() for t in self.tensors]

    @property
    def per_device_tensor_addrs(self) -> list[list[int]]:
        """``[tensor_addrs]`` (one device per cluster here)."""
        return [self.tensor_addrs]

    def locate(self, addrs: Sequence[int]) -> tuple[list[int], int] | None:
        """The tensors and the row that ``addrs`` name in this cache, or None if the
        first address is not in it.

        Each address must be where a tensor's row ``r`` starts, the same ``r``
        for all (a batch entry of an ordinary cache; 0 for a blocks cache,
        whose rows a push names itself), and name each tensor once.

        Raises:
            InvalidParamError: the first address is in this cache but the
                others do not name distinct tensors of it at one row.
        """
        desc = self.cache_desc
        start = self.tensors[0].data_ptr() if self.tensors else 0
        if not addrs or not start <= addrs[0] < start + desc.nbytes:
            return None
        tensors, rows = [], set()
        for addr in addrs:
            tensor, within = divmod(addr - start, desc.tensor_nbytes)
            if not 0 <= tensor < desc.num_tensors or within % desc.row_nbytes:
                raise InvalidParamError(f"address {addr:#x} is not where a row of a tensor "
                                        f"of cache {self.cache_id} starts")
            tensors.append(tensor)
            rows.add(within // desc.row_nbytes)
        if len(set(tensors)) != len(tensors) or len(rows) != 1:
            raise InvalidParamError(f"addresses must name distinct tensors of cache "
                                    f"{self.cache_id} at one row; they name tensors "
                                    f"{tensors!r:.80} at rows {sorted(rows)!r:.80}")
        row = rows.pop()
        if self.is_blocks_cache and row:
            raise InvalidParamError(f"address {addrs[0]:#x} names block {row} of blocks cache "
                                    f"{self.cache_id}; name its tensors' starts")
        return tensors, row

    def stacked(self) -> torch.Tensor:
        """All tensors as one ``[num_rows, num_tensors, row_bytes]`` byte view (not a copy)."""
        self.check_valid()
        desc = self.cache_desc
        return self._region.view(desc.num_tensors, desc.num_rows, desc.row_nbytes).transpose(0, 1)

    def check_valid(self) -> None:
        """Raise :class:`InvalidParamError` if the cache was deallocated."""
        if not self.tensors:
            raise InvalidParamError(f"cache {self.cache_id} was deallocated")

    def invalidate(self) -> None:
        """Drop the views (called when the cache is deallocated)."""
        self.tensors = []
        self._region = self._region[:0]

    def __repr__(self) -> str:
        kind = "blocks cache" if self.is_blocks_cache else "cache"
        return f"<{kind} {self.cache_id}: {self.cache_desc}>"
