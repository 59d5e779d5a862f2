"""Reference paged attention in plain torch: write through slots, read through tables.

Not fast, but obviously right: it is what proves block tables, slot
mappings and the null-block handling correct (a decoder that uses it must
produce the logits of the same decoder with dense attention).

* :func:`write_to_cache` stores one entry per token at its slot;
* :func:`gather_from_cache` reads the entries of given positions of one
  request through its block-table row;
* :func:`attend` is scaled-dot-product attention with a causal and an
  optional sliding-window mask, grouped-query heads broadcast;
* :func:`paged_attention` does a batch: for each request, the entries of its
  cached positions are gathered from the cache and this step's entries are
  taken as computed (a sliding-window prefill writes its dead head into the
  null block, so the step's own tokens must not be read back), then attended.

A sliding window ``W`` lets a query at position ``p`` see keys ``p-W+1 .. p``;
it is the allocator's rule (tokens ``0 .. C-W`` are dead once ``C`` are
computed), so the cached positions read start at ``max(0, C-W+1)`` and every
one of them lies in a live block.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from kvfunc.core import InvalidArgumentError, InvalidTypeError
from kvfunc.shell._tables import int_array

__all__ = ["attend", "gather_from_cache", "paged_attention", "write_to_cache"]

_LAYOUTS = ("BnBsND", "BnNBsD")


def _block_size(cache: torch.Tensor, layout: str) -> int:
    if layout not in _LAYOUTS:
        msg = f"unsupported cache_layout {layout!r}; expected one of {list(_LAYOUTS)}"
        raise InvalidArgumentError(msg)
    if cache.dim() < 3:
        raise InvalidArgumentError(f"a paged cache has at least 3 dims, got {list(cache.shape)}")
    return cache.shape[1] if layout == "BnBsND" else cache.shape[2]


def _entry_shape(cache: torch.Tensor, layout: str) -> list[int]:
    shape = list(cache.shape[1:])
    del shape[0 if layout == "BnBsND" else 1]
    return shape


def write_to_cache(cache: torch.Tensor, slot_mapping: torch.Tensor, values: torch.Tensor, *,
                   layout: str = "BnBsND") -> None:
    """Store ``values[t]`` (one token's ``[N, *dims]`` entry) at slot ``slot_mapping[t]``.

    The cache may be a view whose blocks lie apart (a shared pool's overlaid
    view, :func:`kvfunc.shell.with_shared_cache_tensors`).

    Raises:
        InvalidTypeError: dtype or device of ``values`` differs from the cache's.
        InvalidArgumentError: shapes or lengths that do not fit, a slot
            outside ``[0, num_blocks * block_size)``.  Nothing is written then.

    >>> cache = torch.zeros(2, 2, 1, 1)  # 2 blocks of 2 slots, BnBsND
    >>> write_to_cache(cache, torch.tensor([3, 0]), torch.tensor([[[7.0]], [[5.0]]]))
    >>> cache.view(-1).tolist()
    [5.0, 0.0, 0.0, 7.0]
    """
    bs = _block_size(cache, layout)
    if values.dtype != cache.dtype or values.device != cache.device:
        msg = (f"values are {values.dtype} on {values.device}, but the cache is "
               f"{cache.dtype} on {cache.device}")
        raise InvalidTypeError(msg)
    slots = torch.from_numpy(int_array(slot_mapping, "slot_mapping"))
    if list(values.shape) != [len(slots), *_entry_shape(cache, layout)]:
        msg = (f"values of shape {list(values.shape)} do not fit {len(slots)} slots of a "
               f"cache with entries {_entry_shape(cache, layout)}")
        raise InvalidArgumentError(msg)
    limit = cache.shape[0] * bs
    if len(slots) and (int(slots.min()) < 0 or int(slots.max()) >= limit):
        bad = int(slots.min()) if int(slots.min()) < 0 else int(slots.max())
        raise InvalidArgumentError(f"slot_mapping holds slot {bad}, outside [0, {limit})")
    slots = slots.to(cache.device)
    if layout == "BnBsND" and cache.stride(0) == bs * cache.stride(1):
        cache.view(limit, *cache.shape[2:]).index_copy_(0, slots, values)
    elif layout == "BnBsND":  # blocks apart (a shared pool's overlaid view): no flat view
        cache[slots // bs, slots % bs] = values
    else:
        cache[slots // bs, :, slots % bs] = values


def gather_from_cache(cache: torch.Tensor, block_table_row: torch.Tensor,
                      positions: torch.Tensor, *, layout: str = "BnBsND") -> torch.Tensor:
    """The ``[S, N, *dims]`` entries of ``positions`` of one request, via its table row.

    >>> cache = torch.arange(8.0).view(4, 2, 1, 1)  # 4 blocks of 2 slots
    >>> gather_from_cache(cache, torch.tensor([3, 1]), torch.tensor([0, 1, 2])).view(-1).tolist()
    [6.0, 7.0, 2.0]
    """
    bs = _block_size(cache, layout)
    pos = positions.to(cache.device)
    blocks = block_table_row.to(cache.device, torch.int64)[pos // bs]
    if layout == "BnBsND":
        return cache[blocks, pos % bs]
    return cache[blocks, :, pos % bs]


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           query_positions: torch.Tensor, key_positions: torch.Tensor, *,
           sliding_window: int | None = None, scale: float | None = None) -> torch.Tensor:
    """Causal (and windowed) attention of ``[T, Hq, D]`` queries over ``[S, Hkv, D]`` keys.

    Query heads are split evenly over key heads (grouped-query attention).

    >>> q = k = v = torch.ones(2, 2, 4)
    >>> attend(q, k[:, :1], v[:, :1], torch.tensor([0, 1]), torch.tensor([0, 1])).shape
    torch.Size([2, 2, 4])
    """
    groups = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(groups, dim=1).transpose(0, 1)
    v = value.repeat_interleave(groups, dim=1).transpose(0, 1)
    diff = query_positions[:, None] - key_positions[None, :]
    mask = diff >= 0
    if sliding_window is not None:
        mask &= diff < sliding_window
    out = F.scaled_dot_product_attention(query.transpose(0, 1), k, v, attn_mask=mask,
                                         scale=scale)
    return out.transpose(0, 1)


def _pair(entries: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return entries[0], entries[1]


def paged_attention(query: torch.Tensor, caches: Sequence[torch.Tensor],
                    new_entries: Sequence[torch.Tensor], block_tables: torch.Tensor,
                    positions: torch.Tensor, cu_seqlens_q: Sequence[int], *,
                    layout: str = "BnBsND", sliding_window: int | None = None,
                    scale: float | None = None,
                    to_kv: Callable[[Sequence[torch.Tensor]],
                                    tuple[torch.Tensor, torch.Tensor]] = _pair
                    ) -> torch.Tensor:
    """Attention of a batch whose earlier tokens live in paged caches.

    Row ``r`` of the batch owns tokens ``cu[r-1]:cu[r]`` at consecutive
    positions ``C, C+1, ...`` (``C`` tokens cached before this step) and
    block-table row ``r``.  For each row the cached entries of positions
    ``lo .. C-1`` (``lo = max(0, C-W+1)`` with a window, else 0) are gathered
    from every cache in ``caches``, this step's ``new_entries`` appended, and
    ``to_kv`` turns them into keys and values (by default the two caches are
    K and V; a latent cache up-projects instead).

    >>> kc, vc = torch.zeros(3, 2, 1, 4), torch.zeros(3, 2, 1, 4)
    >>> k = v = q = torch.ones(1, 1, 4)
    >>> table = torch.tensor([[1, 2]], dtype=torch.int32)
    >>> paged_attention(q, [kc, vc], [k, v], table, torch.tensor([0]), [1]).shape
    torch.Size([1, 1, 4])
    """
    outputs = []
    start = 0
    for row, end in enumerate(cu_seqlens_q):
        pos = positions[start:end]
        if len(pos):
            cached = int(pos[0])
            lo = 0 if sliding_window is None else max(0, cached - sliding_window + 1)
            old = torch.arange(lo, cached, device=positions.device)
            entries = [torch.cat([gather_from_cache(c, block_tables[row], old, layout=layout),
                                  n[start:end]]) for c, n in zip(caches, new_entries, strict=True)]
            key, value = to_kv(entries)
            outputs.append(attend(query[start:end], key, value, pos, torch.cat([old, pos]),
                                  sliding_window=sliding_window, scale=scale))
        start = end
    if not outputs:
        return query.new_empty(0, *query.shape[1:])
    return torch.cat(outputs)
