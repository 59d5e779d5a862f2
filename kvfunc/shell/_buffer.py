"""A persistent block-table buffer kept up to date from deltas.

Theory of operation
-------------------
An engine's running batch changes a little every step: a few requests
arrive, a few finish, every running request gains a block now and then.
Rebuilding every table from the state each step costs a pass over every
block id; :class:`BlockTableBuffer` instead applies each transition's
:class:`~kvfunc.BlocksChanged` to tables it keeps, touching only what the
delta names:

* ``registered``: a request gets a row (a free row, else a new one at the end);
* ``appended``: the new ids are written after the row's last entry;
* ``nulled``: the recycled positions become the null block 0;
* ``copied`` (copy-on-write, a request and a table position ``>= 0``): the
  copy replaces its source at that position; copies that seed a new block
  or save a state into the cache change no table;
* ``released``: the row's entries are cleared; once a request is released
  from every group the buffer tracks, its row is freed, and the batch is
  condensed by moving the last rows into the holes (as a persistent batch
  does), so rows ``0 .. num_requests-1`` are always the live requests.

The row contents always equal a full rebuild
(:func:`kvfunc.shell.build_block_tables` over :attr:`request_ids`), which a
property test checks.  A delta is planned completely (every row, length
and width checked) before anything is written: a delta that does not fit
raises and leaves the buffer as it was.

The tables live in host memory (pinned when the target is CUDA or an NPU),
where numpy edits them in place; :meth:`block_tables` copies the live rows
to the device when they changed, asynchronously from pinned memory, and the
next edit waits for that copy first.  Slot mappings are computed on the host
copy in one vectorised pass and sent the same way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import torch

from kvfunc.core import (
    DELTA_VERSION,
    BlocksChanged,
    InvalidArgumentError,
    KVState,
    RequestId,
    TierDelta,
    UnknownRequestError,
)
from kvfunc.shell._buffer_delta import DeltaPlan, mismatch
from kvfunc.shell._device import DeviceLike, is_accelerator, resolve_device
from kvfunc.shell._tables import block_indices, device_delta, token_rows

__all__ = ["BlockTableBuffer", "TableSpec", "specs_from_state"]


@attrs.frozen(slots=True)
class TableSpec:
    """One tracked group: its key, block size, table width and whether it has slots.

    ``has_slots`` is False for Mamba and compressed groups, which get no
    slot mapping (as in the seed).
    """

    key: str
    block_size: int
    width: int
    has_slots: bool = True


def specs_from_state(state: KVState, widths: int | Mapping[str, int] | None = None
                     ) -> list[TableSpec]:
    """One spec per group of ``state``; widths default to the longest possible table.

    That is ``ceil(max_model_len / block_size)`` (or ``widths``) for paged
    groups and ``1 + next_n`` for Mamba.

    >>> from kvfunc.core import FullAttention, KVState
    >>> specs_from_state(KVState.create({"f": FullAttention(num_blocks=4, block_size=16)}, 100))
    [TableSpec(key='f', block_size=16, width=7, has_slots=True)]
    """
    if isinstance(widths, Mapping) and not set(widths) <= set(state.manager_keys):
        msg = (f"widths name unknown manager keys {sorted(set(widths) - set(state.manager_keys))}"
               f"; the state has {list(state.manager_keys)}")
        raise InvalidArgumentError(msg)
    specs = []
    for g in state.groups:
        policy = g.policy
        bs = policy.block_size
        if policy.attn_type == "Mamba":
            specs.append(TableSpec(g.key, bs, 1 + policy.next_n, False))  # type: ignore[attr-defined]
            continue
        width = -(-state.max_model_len // bs)
        if isinstance(widths, Mapping):
            width = widths.get(g.key, width)
        elif widths is not None:
            width = widths
        specs.append(TableSpec(g.key, bs, width, getattr(policy, "compress_ratio", 1) == 1))
    return specs


class BlockTableBuffer:
    """Block tables of the running requests, updated in place from deltas.

    >>> import kvfunc as kf
    >>> s = kf.KVState.create({"full": kf.FullAttention(num_blocks=9, block_size=4)}, 32)
    >>> buf = BlockTableBuffer.from_state(s, max_num_requests=4)
    >>> r = kf.allocate_batch(s, [("a", 0, 9), ("b", 0, 3)])
    >>> buf.apply(r.delta)
    >>> buf.request_ids, buf.block_tables()["full"].tolist()
    (('a', 'b'), [[1, 2, 3, 0, 0, 0, 0, 0], [4, 0, 0, 0, 0, 0, 0, 0]])
    >>> buf.slot_mappings(["b", "a"], [3, 9], [1, 2])["full"].tolist()
    [19, 13]
    """

    __slots__ = ("_copy_event", "_dev", "_dirty", "_flat", "_host", "_index", "_lens",
                 "_order", "_rows", "_specs", "_staged", "device", "max_num_requests")

    def __init__(self, specs: Sequence[TableSpec], max_num_requests: int, *,
                 device: DeviceLike = "cpu", staging: bool | None = None) -> None:
        """An empty buffer for ``specs``' groups and up to ``max_num_requests`` rows.

        ``staging`` keeps the tables handed out (:meth:`block_tables`)
        separate from the host copy that :meth:`apply` edits; it defaults to
        True on accelerators (where it is required) and False on the CPU.
        """
        if type(max_num_requests) is not int or max_num_requests < 0:
            msg = f"max_num_requests must be a non-negative int, but got {max_num_requests!r}"
            raise InvalidArgumentError(msg)
        for spec in specs:
            if type(spec.width) is not int or spec.width < 0 or spec.block_size <= 0:
                msg = f"table width must be a non-negative int and block size positive: {spec}"
                raise InvalidArgumentError(msg)
        self.device = resolve_device(device)
        self.max_num_requests = max_num_requests
        self._specs = tuple(specs)
        self._index = {spec.key: i for i, spec in enumerate(self._specs)}
        if len(self._index) != len(self._specs):
            raise InvalidArgumentError(f"duplicate manager keys in {[s.key for s in specs]}")
        accel = is_accelerator(self.device)
        self._staged = accel if staging is None else bool(staging)
        if accel and not self._staged:
            raise InvalidArgumentError(f"a buffer for {self.device} needs staging=True")
        self._host = [torch.zeros(max_num_requests, s.width, dtype=torch.int32, pin_memory=accel)
                      for s in self._specs]
        self._flat = [t.numpy().reshape(-1) for t in self._host]
        self._dev = [torch.zeros_like(t, device=self.device) if self._staged else t
                     for t in self._host]
        self._lens: list[list[int]] = [[-1] * max_num_requests for _ in self._specs]
        self._rows: dict[RequestId, int] = {}
        self._order: list[RequestId] = []
        self._dirty = False
        self._copy_event: Any = None

    @classmethod
    def from_state(cls, state: KVState, max_num_requests: int, *,
                   widths: int | Mapping[str, int] | None = None, device: DeviceLike = "cpu",
                   staging: bool | None = None) -> BlockTableBuffer:
        """A buffer for every group of ``state``, holding its requests' tables.

        Rows follow ``state.request_ids()``; widths as :func:`specs_from_state`.

        Raises:
            InvalidArgumentError: more requests than rows, a table wider than
                its width.
        """
        buf = cls(specs_from_state(state, widths), max_num_requests, device=device,
                  staging=staging)
        groups = {g.key: g for g in state.groups}
        for rid in state.request_ids():
            held = []
            for i, spec in enumerate(buf._specs):
                table = groups[spec.key].tables.get(rid)
                if table is not None:
                    buf._check_width(i, rid, len(table))
                    held.append((i, table))
            if not held:
                continue
            row = buf._new_row(len(buf._order), rid)
            buf._order.append(rid)
            buf._rows[rid] = row
            for i, table in held:
                start = row * buf._specs[i].width
                buf._flat[i][start:start + len(table)] = table
                buf._lens[i][row] = len(table)
        buf._dirty = True
        return buf

    # -- reading ---------------------------------------------------------------
    @property
    def request_ids(self) -> tuple[RequestId, ...]:
        """The requests in row order (row ``i`` holds ``request_ids[i]``)."""
        return tuple(self._order)

    @property
    def num_requests(self) -> int:
        """Live rows."""
        return len(self._order)

    @property
    def specs(self) -> tuple[TableSpec, ...]:
        """The tracked groups."""
        return self._specs

    def row_of(self, request_id: RequestId) -> int:
        """The row of a request (:class:`~kvfunc.UnknownRequestError` when it has none)."""
        try:
            return self._rows[request_id]
        except KeyError:
            raise UnknownRequestError(f"request {request_id!r} has no row in the buffer") \
                from None

    def block_tables(self, request_ids: Sequence[RequestId] | None = None
                     ) -> dict[str, torch.Tensor]:
        """``{manager_key: int32 [rows, width]}`` on the buffer's device.

        Without ``request_ids``: every live row, in row order, as views into
        the buffer (valid until the next :meth:`apply`).  With them: those
        requests' rows in that order (a gathered copy), for a batch that
        lists the requests in another order.

        Raises:
            UnknownRequestError: a request without a row.
        """
        if request_ids is not None:
            rows = torch.tensor([self.row_of(rid) for rid in request_ids], dtype=torch.int64,
                                device=self.device)
            return {k: t.index_select(0, rows) for k, t in self.block_tables().items()}
        n = len(self._order)
        if self._staged and self._dirty:
            accel = is_accelerator(self.device)
            for dev, host in zip(self._dev, self._host, strict=True):
                dev[:n].copy_(host[:n], non_blocking=accel)
            if accel:
                self._copy_event = getattr(torch, self.device.type).Event()
                self._copy_event.record()
        self._dirty = False
        return {s.key: dev[:n] for s, dev in zip(self._specs, self._dev, strict=True)}

    def slot_mappings(self, request_ids: Sequence[RequestId], positions: Any,
                      cu_seqlens_q: Any) -> dict[str, torch.Tensor]:
        """``{manager_key: int64 slots}`` of a batch, for every group with slots.

        Batch row ``r`` is ``request_ids[r]`` and owns
        ``positions[cu_seqlens_q[r-1]:cu_seqlens_q[r]]``; the batch may list
        the buffer's requests in any order, and a subset.

        Raises:
            UnknownRequestError: a request without a row.
            InvalidArgumentError, InvalidTypeError: as
                :func:`kvfunc.shell.slot_mapping` (negative positions, a
                block index past the width, bad ends).
        """
        pos, token_row, num_rows = token_rows(positions, cu_seqlens_q)
        if len(request_ids) != num_rows:
            msg = (f"{len(request_ids)} request ids for a batch of {num_rows} rows "
                   "(actual_seq_lengths_cu_q has one end per request)")
            raise InvalidArgumentError(msg)
        try:
            batch_rows = np.fromiter(map(self._rows.__getitem__, request_ids), np.int64,
                                     num_rows)
        except KeyError as exc:
            raise UnknownRequestError(f"request {exc.args[0]!r} has no row in the buffer") \
                from None
        table_row = batch_rows[token_row]
        out = {}
        accel = is_accelerator(self.device)
        for spec, flat in zip(self._specs, self._flat, strict=True):
            if not spec.has_slots:
                continue
            bs = spec.block_size
            blk = block_indices(pos, token_row, bs, spec.width, f"manager_key={spec.key}")
            slots = torch.from_numpy(flat[table_row * spec.width + blk].astype(np.int64) * bs
                                     + (pos - blk * bs))
            out[spec.key] = slots.pin_memory().to(self.device, non_blocking=True) \
                if accel else slots
        return out

    # -- writing ---------------------------------------------------------------
    def _new_row(self, row: int, rid: RequestId) -> int:
        if row >= self.max_num_requests:
            msg = (f"cannot add request {rid!r}: all {self.max_num_requests} rows of the "
                   "block-table buffer are in use")
            raise InvalidArgumentError(msg)
        return row

    def _check_width(self, i: int, rid: RequestId, length: int) -> None:
        spec = self._specs[i]
        if length > spec.width:
            msg = (f"block table for manager_key={spec.key}, request_id={rid} exceeds the "
                   f"buffer's width: blocks={length}, width={spec.width}")
            raise InvalidArgumentError(msg)

    def apply(self, delta: BlocksChanged | TierDelta) -> None:
        """Bring the tables up to date with one transition's delta.

        Rows of groups the buffer does not track are ignored.  Either the
        whole delta is applied or, on error, nothing.  A tiered transition's
        :class:`~kvfunc.TierDelta` changes the tables through its device
        delta only: its moves copy block contents, never table entries.

        Raises:
            InvalidTypeError: not a :class:`~kvfunc.BlocksChanged` or
                :class:`~kvfunc.TierDelta`.
            ReplayMismatchError: the delta names rows or positions the buffer
                does not have (it was not built from the delta's state).
            InvalidArgumentError: a table would pass its width, or more
                requests than rows.
        """
        delta = device_delta(delta)
        if delta.version != DELTA_VERSION:
            raise mismatch(f"version {delta.version} is not {DELTA_VERSION}")
        if delta.is_empty:
            return
        plan = DeltaPlan(self)
        plan.plan(delta)
        plan.commit()
