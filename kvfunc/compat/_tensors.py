"""The seed's ``allocate_cache_tensors`` (spec §5.3), made all-or-nothing.

The tensors come from :mod:`kvfunc.shell._tensors`; this module only keeps
the seed's signature and its way of handing them over: each entry's
``tensor`` field is set and its ``tensor_setter`` called.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvfunc.core import CacheEntry, ModelCacheInfo
from kvfunc.shell._device import DeviceLike
from kvfunc.shell._tensors import create_cache_tensors, plan_cache_tensors

__all__ = ["allocate_cache_tensors"]


def _attach(entry: CacheEntry, tensor: Any) -> None:
    # The records are frozen, but ``tensor`` is an attachment, not part of the
    # record's value (it is excluded from eq and hash): setting it changes no
    # record's identity, which is what freezing protects.
    object.__setattr__(entry, "tensor", tensor)


def allocate_cache_tensors(device: DeviceLike, cache_info: ModelCacheInfo,
                           block_num_by_type: Mapping[str, int]) -> None:
    """Allocate every paged cache tensor, attach it and call its ``tensor_setter``.

    Same shapes, dtypes, alignment (2 MiB), allocators and error messages as
    the seed; unlike the seed, every entry is checked and every tensor
    allocated before the first one is attached, so a failure part-way
    attaches nothing and calls no setter.  Setters run after all tensors are
    attached, in the seed's order; if one raises, the entries get their
    previous tensors back (setters already called are not undone).

    Args:
        device: ``"cpu"``, ``"cuda[:i]"``, ``"npu[:i]"``, ``"auto"`` or a
            ``torch.device``.
        cache_info: the model's caches; paged entries must have a setter.
        block_num_by_type: ``{manager_key: num_blocks}``.

    Raises:
        InvalidCacheInfo: an entry without ``tensor_setter``, a bad storage
            block size, layout, head count or dim, an unsupported attention
            type, or a Mamba cache with the swapped-memory allocator.
        MissingKeyError: a manager key without a block count (a ``KeyError``).
        InvalidArgumentError: an invalid allocator or block count.

    >>> from kvfunc.core import CacheEntry, LayerCacheInfo, ModelCacheInfo
    >>> seen = []
    >>> e = CacheEntry("k", "FullAttention", 8, 2, "fp16", True, block_size=4,
    ...                tensor_setter=seen.append)
    >>> allocate_cache_tensors("cpu", ModelCacheInfo(1, [LayerCacheInfo(0, [e])]),
    ...                        {"FullAttention": 5})
    >>> e.tensor.shape, seen[0] is e.tensor
    (torch.Size([5, 4, 2, 8]), True)
    """
    specs = plan_cache_tensors(cache_info, block_num_by_type, require_setter=True)
    tensors = create_cache_tensors(specs, device)
    previous = [spec.entry.tensor for spec in specs]
    for spec, tensor in zip(specs, tensors, strict=True):
        _attach(spec.entry, tensor)
    try:
        for spec, tensor in zip(specs, tensors, strict=True):
            setter = spec.entry.tensor_setter
            assert setter is not None  # plan_cache_tensors checked it
            setter(tensor)
    except BaseException:
        for spec, old in zip(reversed(specs), reversed(previous), strict=True):
            _attach(spec.entry, old)
        raise
