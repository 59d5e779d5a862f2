"""Block tables and slot mappings rebuilt from a state (spec §5.6, §5.7).

A block table holds, per batch row, a request's block ids in logical order,
right-padded with the null block 0.  A slot mapping gives, per token, the
cache row its K/V goes to::

    position p of batch row r, block size bs, table T:
        slot = T[r, p // bs] * bs + p % bs

    tokens:  | r0: p=5  p=6 | r1: p=0 | r2: p=17 |      cu_seqlens_q = [2, 3, 4]

Positions whose table entry is null (a sliding window's dead head, padding
rows) land in the null block's slots ``[0, bs)``: the null block is the
garbage sink for writes nobody reads.

Everything is vectorised: one pass of Python over the requests (their
tables are tuples in the state), none over tokens or blocks.  For a batch
that changes a little every step, :class:`kvfunc.shell.BlockTableBuffer`
keeps the tables up to date from deltas instead.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from kvfunc.core import (
    BlockId,
    BlocksChanged,
    InvalidArgumentError,
    InvalidTypeError,
    KVState,
    RequestId,
    TierDelta,
)
from kvfunc.shell._device import DeviceLike, resolve_device

__all__ = [
    "TokenRows",
    "block_indices",
    "build_block_tables",
    "build_slot_mappings",
    "device_delta",
    "int_array",
    "is_dummy_request",
    "pack_rows",
    "slot_mapping",
    "token_rows",
]


def device_delta(delta: object) -> BlocksChanged:
    """What changed on the device: ``delta`` itself, or a :class:`~kvfunc.TierDelta`'s device
    delta (its moves copy block contents, never table entries); else a typed error.

    >>> device_delta(BlocksChanged()).is_empty
    True
    >>> device_delta("junk")
    Traceback (most recent call last):
    ...
    kvfunc.core._errors.InvalidTypeError: expected a BlocksChanged or TierDelta delta, got str
    """
    if isinstance(delta, TierDelta):
        delta = delta.device
    if not isinstance(delta, BlocksChanged):
        msg = f"expected a BlocksChanged or TierDelta delta, got {type(delta).__name__}"
        raise InvalidTypeError(msg)
    return delta


def is_dummy_request(request_id: object) -> bool:
    """True for the seed's padding requests: an int id below 0 (``-1``)."""
    return type(request_id) is int and request_id < 0


def pack_rows(tables: Sequence[Sequence[BlockId]], width: int, num_rows: int) -> torch.Tensor:
    """An int32 ``[num_rows, width]`` CPU tensor: row ``i`` is ``tables[i]`` padded with 0.

    Rows past ``len(tables)`` are all null.  The caller checks lengths.

    >>> pack_rows([(3, 4), (), (7,)], 3, 4).tolist()
    [[3, 4, 0], [0, 0, 0], [7, 0, 0], [0, 0, 0]]
    """
    out = torch.zeros(num_rows, width, dtype=torch.int32)
    flat: list[int] = []
    for table in tables:
        flat += table
    if flat:
        # One C-level pack of every id beats building a tensor from a list 5x.
        buf = bytearray(4 * len(flat))
        struct.pack_into(f"={len(flat)}i", buf, 0, *flat)
        lens = torch.tensor([len(t) for t in tables])
        mask = torch.arange(width) < lens[:, None]
        out[:len(tables)][mask] = torch.frombuffer(buf, dtype=torch.int32)
    return out


def _check_request_ids(request_ids: Sequence[Any]) -> None:
    for rid in request_ids:
        if not isinstance(rid, str | int):
            msg = f"request ids must be str or int, but got {rid!r}"
            raise InvalidTypeError(msg)


def build_block_tables(state: KVState, request_ids: Sequence[RequestId] | None,
                       widths: int | Mapping[str, int], *, batch_size: int | None = None,
                       is_prefill: bool = False, device: DeviceLike = "cpu"
                       ) -> dict[str, torch.Tensor]:
    """``{manager_key: int32 [batch_size, width]}`` block tables, in manager order (§5.6).

    Row ``i`` holds ``request_ids[i]``'s blocks padded with the null block;
    rows past the requests, unknown requests and ``request_ids=None`` give
    null rows.  Mamba groups take the first ``1`` (prefill) or ``1 + next_n``
    ids of each table; a real request with fewer raises, a dummy (id < 0) is
    padded.

    Args:
        state: the allocator state.
        request_ids: the batch's requests in row order, or None.
        widths: one width for every non-Mamba group, or ``{manager_key: width}``.
        batch_size: rows; defaults to ``len(request_ids)``.
        is_prefill: Mamba width 1 instead of ``1 + next_n``.
        device: where the tables go.

    Raises:
        InvalidArgumentError: a width missing for a group, a table wider than
            its width, a Mamba table too short, ``batch_size`` below the
            number of requests (or missing with no requests).

    >>> from kvfunc.core import FullAttention, KVState, allocate_slots
    >>> s = KVState.create({"full": FullAttention(num_blocks=8, block_size=4)}, 64)
    >>> s = allocate_slots(s, "a", 0, 9).state
    >>> build_block_tables(s, ["a", "b"], 4, batch_size=3)["full"].tolist()
    [[1, 2, 3, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
    """
    ids = list(request_ids) if request_ids is not None else []
    _check_request_ids(ids)
    if batch_size is None:
        if request_ids is None:
            raise InvalidArgumentError("batch_size is required when request_ids is None")
        batch_size = len(ids)
    if type(batch_size) is not int or batch_size < len(ids):
        msg = (f"batch_size must be an int of at least len(requests)={len(ids)}, "
               f"but got {batch_size!r}")
        raise InvalidArgumentError(msg)
    out: dict[str, torch.Tensor] = {}
    for g in state.groups:
        key, policy = g.key, g.policy
        get = g.tables.get
        tables = [get(rid, ()) for rid in ids]
        if policy.attn_type == "Mamba":
            width = 1 if is_prefill else 1 + policy.next_n  # type: ignore[attr-defined]
            for rid, table in zip(ids, tables, strict=True):
                if len(table) < width and not is_dummy_request(rid):
                    msg = (f"Mamba block table requires {width} blocks for request {rid}, "
                           f"but got {len(table)} blocks: {list(table)}.")
                    raise InvalidArgumentError(msg)
            tables = [t[:width] for t in tables]
        else:
            width = _width(widths, key)
            for rid, table in zip(ids, tables, strict=True):
                if len(table) > width:
                    msg = (f"block table for manager_key={key}, request_id={rid} exceeds "
                           f"max_block_num: blocks={len(table)}, max_block_num={width}")
                    raise InvalidArgumentError(msg)
        out[key] = pack_rows(tables, width, batch_size)
    dev = resolve_device(device)
    return {k: t.to(dev) for k, t in out.items()} if dev.type != "cpu" else out


def _width(widths: int | Mapping[str, int], key: str) -> int:
    if isinstance(widths, Mapping):
        if key not in widths:
            raise InvalidArgumentError(f"max_block_num is required for manager_key={key}")
        width = widths[key]
    else:
        width = widths
    if type(width) is not int or width < 0:
        msg = f"max_block_num for manager_key={key} must be a non-negative int, but got {width!r}"
        raise InvalidArgumentError(msg)
    return width


def int_array(value: Any, name: str) -> np.ndarray:
    """``value`` (a tensor on any device, an array or a sequence) as a 1-D int64 host array.

    >>> int_array([3, 4], "position_ids").tolist()
    [3, 4]
    """
    if isinstance(value, torch.Tensor):
        arr = (value if value.device.type == "cpu" else value.to("cpu")).detach().numpy()
    else:
        arr = np.asarray(value)
        if arr.size == 0:
            arr = arr.astype(np.int64)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        msg = (f"{name} must be a 1-D integer sequence, but got {arr.dtype} of shape "
               f"{list(arr.shape)}")
        raise InvalidTypeError(msg)
    return arr.astype(np.int64, copy=False)


class TokenRows(NamedTuple):
    """A batch's tokens: positions, the batch row of each, and the number of rows."""

    positions: np.ndarray
    rows: np.ndarray
    num_rows: int


def token_rows(positions: Any, cu_seqlens_q: Any) -> TokenRows:
    """The positions of a batch, the batch row of each token and the row count, checked.

    ``cu_seqlens_q`` holds the cumulative end of each row's tokens (the
    seed's ``actual_seq_lengths_cu_q``, without a leading 0); positions after
    its last entry are ignored, as in the seed.  Arrays are int64 on the host.

    Raises:
        InvalidTypeError: not 1-D integer sequences.
        InvalidArgumentError: ends that decrease or pass the positions, or a
            negative position.

    >>> pos, rows, num_rows = token_rows([5, 6, 0, 17, 99], [2, 3, 4])
    >>> pos.tolist(), rows.tolist(), num_rows
    ([5, 6, 0, 17], [0, 0, 1, 2], 3)
    """
    pos = int_array(positions, "position_ids")
    ends = int_array(cu_seqlens_q, "actual_seq_lengths_cu_q")
    num_rows = len(ends)
    total = int(ends[-1]) if num_rows else 0
    counts = ends.copy()
    counts[1:] -= ends[:-1]
    if num_rows and (counts.min() < 0 or total > len(pos)):
        msg = (f"actual_seq_lengths_cu_q must be non-decreasing ends within the "
               f"{len(pos)} positions, but got {ends.tolist()}")
        raise InvalidArgumentError(msg)
    pos = pos[:total]
    rows = np.repeat(np.arange(num_rows, dtype=np.int64), counts)
    if total and pos.min() < 0:
        i = int(np.flatnonzero(pos < 0)[0])
        msg = (f"positions must be non-negative, but position_ids[{i}] = {int(pos[i])} "
               f"(batch row {int(rows[i])})")
        raise InvalidArgumentError(msg)
    return TokenRows(pos, rows, num_rows)


def block_indices(pos: np.ndarray, rows: np.ndarray, block_size: int, width: int,
                  name: str) -> np.ndarray:
    """``pos // block_size``, checked against the table width (the seed's message).

    The error names the first batch row that reaches past the width and
    that row's largest block index.

    >>> block_indices(np.array([0, 9]), np.array([0, 1]), 4, 2, "t")
    Traceback (most recent call last):
    ...
    kvfunc.core._errors.InvalidArgumentError: block_indices out of range for t: max_index=2, ...
    """
    blk = pos // block_size
    if len(blk) and blk.max() >= width:
        row = rows[np.flatnonzero(blk >= width)[0]]
        worst = int(blk[rows == row].max())
        msg = (f"block_indices out of range for {name}: max_index={worst}, "
               f"block_table_width={width}")
        raise InvalidArgumentError(msg)
    return blk


def _slots(table: torch.Tensor, pos: np.ndarray, rows: np.ndarray, block_size: int,
           name: str) -> torch.Tensor:
    """Slots of checked tokens, gathered on the table's device."""
    blk = block_indices(pos, rows, block_size, table.shape[1], name)
    dev = table.device
    blk_t = torch.from_numpy(blk).to(dev)
    offsets = torch.from_numpy(pos - blk * block_size).to(dev)
    return table[torch.from_numpy(rows).to(dev), blk_t].to(torch.int64) * block_size + offsets


def _check_table(table: Any, name: str, num_rows: int) -> torch.Tensor:
    if not isinstance(table, torch.Tensor) or table.dim() != 2 \
            or table.dtype.is_floating_point or table.dtype == torch.bool:
        msg = f"block_table for {name} must be a 2-D integer tensor, but got {table!r}"
        raise InvalidTypeError(msg)
    if table.shape[1] == 0:
        raise InvalidArgumentError(f"block_table for {name} must have non-zero width")
    if table.shape[0] < num_rows:
        msg = (f"block_table for {name} has {table.shape[0]} rows, but "
               f"actual_seq_lengths_cu_q describes {num_rows}")
        raise InvalidArgumentError(msg)
    return table


def slot_mapping(block_table: torch.Tensor, positions: Any, cu_seqlens_q: Any,
                 block_size: int, *, name: str = "block_table") -> torch.Tensor:
    """The int64 slot of every token, on the table's device (see the module docstring).

    Raises:
        InvalidTypeError, InvalidArgumentError: as :func:`token_rows`; a table
            that is not 2-D integer, has width 0 or fewer rows than the batch,
            or a block index at or past its width.

    >>> table = torch.tensor([[4, 2], [7, 0]], dtype=torch.int32)
    >>> slot_mapping(table, [0, 5, 3], [2, 3], 4).tolist()
    [16, 9, 31]
    """
    pos, rows, num_rows = token_rows(positions, cu_seqlens_q)
    table = _check_table(block_table, name, num_rows)
    return _slots(table, pos, rows, block_size, name)


def build_slot_mappings(state: KVState, block_tables: Mapping[str, torch.Tensor],
                        positions: Any, cu_seqlens_q: Any) -> dict[str, torch.Tensor]:
    """``{manager_key: int64 slots}`` for every group but Mamba and compressed ones (§5.7).

    The table of every non-Mamba group is required and checked (width > 0)
    even when compression (``compress_ratio > 1``) then skips the group.  An
    empty ``cu_seqlens_q`` gives empty mappings.

    Raises:
        InvalidArgumentError: a missing table, width 0, too few rows, a
            block index past the width, bad ``cu_seqlens_q``, a negative position.
        InvalidTypeError: positions or ends that are not 1-D integers.

    >>> from kvfunc.core import FullAttention, KVState, allocate_slots
    >>> s = KVState.create({"full": FullAttention(num_blocks=8, block_size=4)}, 64)
    >>> s = allocate_slots(s, "a", 0, 9).state
    >>> tables = build_block_tables(s, ["a"], 4)
    >>> build_slot_mappings(s, tables, [4, 8], [2])["full"].tolist()
    [8, 12]
    """
    pos, rows, num_rows = token_rows(positions, cu_seqlens_q)
    out: dict[str, torch.Tensor] = {}
    for g in state.groups:
        policy = g.policy
        if policy.attn_type == "Mamba":
            continue
        key = g.key
        if key not in block_tables:
            raise InvalidArgumentError(f"block_table is required for manager_key={key}")
        _check_table(block_tables[key], f"manager_key={key}", 0)
        if getattr(policy, "compress_ratio", 1) > 1:
            continue
        table = _check_table(block_tables[key], f"manager_key={key}", num_rows)
        out[key] = _slots(table, pos, rows, policy.block_size, f"manager_key={key}")
    return out
