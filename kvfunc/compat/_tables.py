"""The seed's ``prepare_block_tables`` and ``prepare_slot_mapping`` (spec §5.6, §5.7).

Thin wrappers over :mod:`kvfunc.shell._tables`, which builds both from the
manager's current :class:`~kvfunc.KVState` with vectorised torch code.
Where the seed crashed inside torch, these return the evident result (an
empty request list gives null rows, an empty batch an empty mapping) or
raise a clear error (``batch_size`` below the number of requests, negative
positions, a table with fewer rows than the batch); ``docs/compat.md``
lists them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kvfunc.core import InvalidTypeError, KVState
from kvfunc.core._internal import excerpt
from kvfunc.shell._device import DeviceLike
from kvfunc.shell._tables import build_block_tables, build_slot_mappings

__all__ = ["prepare_block_tables", "prepare_slot_mapping"]


def _state_of(kv_cache_manager: Any) -> KVState:
    state = getattr(kv_cache_manager, "state", None)
    if not isinstance(state, KVState):
        msg = ("kv_cache_manager must be a kvfunc.compat.KVCacheManager (with a .state), "
               f"but got {type(kv_cache_manager).__name__}")
        raise InvalidTypeError(msg)
    return state


def _request_ids(requests: Sequence[Any] | None) -> list[Any] | None:
    if requests is None:
        return None
    ids = []
    for request in requests:
        try:
            ids.append(request.request_id)
        except AttributeError:
            msg = f"requests must have a request_id attribute, but got {excerpt(request)}"
            raise InvalidTypeError(msg) from None
    return ids


def prepare_block_tables(requests: Sequence[Any] | None, kv_cache_manager: Any,
                         max_block_num: int | Mapping[str, int], device: DeviceLike,
                         batch_size: int = 0, is_prefill: bool = False
                         ) -> dict[str, torch.Tensor]:
    """``{manager_key: int32 [batch_size, width]}``: each request's blocks, null-padded.

    Non-Mamba width: ``max_block_num`` (an int for every manager, or a dict
    per key); Mamba width: ``1`` for prefill, else ``1 + next_n``.  Rows
    past the requests, unknown and ``None`` requests are null rows.

    Raises:
        InvalidArgumentError: a width missing for a manager, a table wider
            than its width, a real request with too few Mamba blocks, or
            ``batch_size`` below ``len(requests)`` (the seed crashed in torch).
        InvalidTypeError: a request without ``request_id``.

    >>> from types import SimpleNamespace
    >>> from kvfunc.compat import FullAttentionManager, KVCacheManager
    >>> mgr = KVCacheManager(64, [FullAttentionManager("FullAttention", 8, 4)], None)
    >>> mgr.allocate_slots("a", 0, 9)
    True
    >>> prepare_block_tables([SimpleNamespace(request_id="a")], mgr, 4, "cpu", 2)
    {'FullAttention': tensor([[1, 2, 3, 0],
            [0, 0, 0, 0]], dtype=torch.int32)}
    """
    return build_block_tables(_state_of(kv_cache_manager), _request_ids(requests),
                              max_block_num, batch_size=batch_size, is_prefill=is_prefill,
                              device=device)


def prepare_slot_mapping(position_ids: Any, actual_seq_lengths_cu_q: Any,
                         kv_cache_manager: Any, block_tables: Mapping[str, torch.Tensor]
                         ) -> dict[str, torch.Tensor]:
    """``{manager_key: int64 slots}`` for every manager but Mamba and compressed ones.

    Row ``r`` owns ``position_ids[cu[r-1]:cu[r]]``; its slot is
    ``table[r, pos // bs] * bs + pos % bs``.

    Raises:
        InvalidArgumentError: a missing or zero-width table, a block index
            past the width, a negative position, ends that decrease or pass
            the positions, a table with fewer rows than the batch.
        InvalidTypeError: positions or ends that are not 1-D integers.

    >>> from kvfunc.compat import FullAttentionManager, KVCacheManager
    >>> mgr = KVCacheManager(64, [FullAttentionManager("FullAttention", 8, 4)], None)
    >>> mgr.allocate_slots("a", 0, 9)
    True
    >>> tables = {"FullAttention": torch.tensor([[1, 2, 3, 0]], dtype=torch.int32)}
    >>> prepare_slot_mapping(torch.tensor([7, 8]), [2], mgr, tables)
    {'FullAttention': tensor([11, 12])}
    """
    return build_slot_mappings(_state_of(kv_cache_manager), block_tables, position_ids,
                               actual_seq_lengths_cu_q)
