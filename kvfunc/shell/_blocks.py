"""Block operations on cache tensors: copy, swap and zero, batched over blocks.

Every cache tensor keeps block ``b`` in ``tensor[b]`` (dimension 0 is the
block, whatever the layout), so each operation is one ``index_select`` /
``index_copy_`` / ``index_fill_`` per tensor over all the blocks at once,
never a Python loop per block.  Copies act simultaneously: every source is
read before any destination is written, so ``1 -> 2, 2 -> 3`` leaves the old
block 2 in block 3.

Every argument is checked against every tensor before the first write:
block ids in range, equal lengths, no destination written twice, matching
dtypes and block shapes.  A bad call raises a typed error naming the tensor
and the bad value, and no tensor is touched.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeAlias

import numpy as np
import torch

from kvfunc.core import (
    COPY_INTO_NEW,
    Appended,
    BlockIndexError,
    BlocksChanged,
    Copied,
    InvalidArgumentError,
    InvalidTypeError,
    MissingKeyError,
    TierDelta,
)
from kvfunc.shell._tables import device_delta, int_array

__all__ = ["TensorSet", "apply_delta", "copy_blocks", "swap_blocks", "zero_blocks"]

TensorSet: TypeAlias = Mapping[str, torch.Tensor] | Sequence[torch.Tensor]
BlockIds: TypeAlias = Sequence[int] | torch.Tensor | np.ndarray
_Named = list[tuple[str, torch.Tensor]]
#: Below this many ids a Python set tells repeats faster than ``torch.unique``.
_FEW_IDS = 512


def _named(tensors: TensorSet, what: str) -> _Named:
    if isinstance(tensors, torch.Tensor):
        msg = f"{what} must be a list or a mapping of tensors, not one tensor"
        raise InvalidTypeError(msg)
    if isinstance(tensors, Mapping):
        items = list(tensors.items())
    else:
        items = [(f"{what}[{i}]", t) for i, t in enumerate(tensors)]
    for name, t in items:
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            msg = f"{name} must be a tensor with a block dimension, but got {t!r}"
            raise InvalidTypeError(msg)
    return items


class _Ids:
    """Checked block ids as one int64 host tensor, moved to each device once."""

    __slots__ = ("by_device", "host", "name")

    def __init__(self, ids: BlockIds, name: str) -> None:
        self.name = name
        self.host = torch.from_numpy(np.ascontiguousarray(int_array(ids, name)))
        self.by_device: dict[torch.device, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self.host)

    def on(self, device: torch.device) -> torch.Tensor:
        found = self.by_device.get(device)
        if found is None:
            found = self.by_device[device] = self.host.to(device)
        return found

    def check_range(self, tensors: _Named, rows: int | None = None) -> None:
        """Every id within every tensor's blocks (``rows``: the fewest blocks of any, if
        known: ids below it need no look at each tensor)."""
        if not len(self.host):
            return
        lo, hi = int(self.host.min()), int(self.host.max())
        if rows is not None and 0 <= lo and hi < rows:
            return
        for name, t in tensors:
            n = t.shape[0]
            if lo < 0 or hi >= n:
                bad = lo if lo < 0 else hi
                msg = f"{self.name} holds block id {bad}, out of range [0, {n}) for {name}"
                raise BlockIndexError(msg)

    def check_unique(self) -> None:
        n = len(self.host)
        if n < _FEW_IDS and len(set(self.host.tolist())) == n:  # a set is faster for few
            return
        if len(torch.unique(self.host)) != n:
            values, counts = torch.unique(self.host, return_counts=True)
            msg = (f"{self.name} writes block {int(values[counts > 1][0])} more than once; "
                   "the result would depend on the order of the writes")
            raise InvalidArgumentError(msg)


def _pair(src: _Ids, dst: _Ids) -> None:
    if len(src) != len(dst):
        msg = (f"{src.name} and {dst.name} must have the same length, but got "
               f"{len(src)} and {len(dst)}")
        raise InvalidArgumentError(msg)
    dst.check_unique()


def copy_blocks(tensors: TensorSet, src_block_ids: BlockIds, dst_block_ids: BlockIds) -> None:
    """Copy blocks ``src[i] -> dst[i]`` inside every tensor (copy-on-write).

    Raises:
        InvalidTypeError: not tensors, or ids that are not 1-D integers.
        InvalidArgumentError: lengths differ, a destination repeats.
        BlockIndexError: an id outside a tensor's blocks.

    >>> t = torch.arange(4.0).view(4, 1)
    >>> copy_blocks([t], [1, 2], [2, 3]); t.view(-1).tolist()
    [0.0, 1.0, 1.0, 2.0]
    """
    named = _named(tensors, "tensors")
    src, dst = _Ids(src_block_ids, "src_block_ids"), _Ids(dst_block_ids, "dst_block_ids")
    _pair(src, dst)
    src.check_range(named)
    dst.check_range(named)
    _copy(named, src, dst)


def _copy(named: _Named, src: _Ids, dst: _Ids) -> None:
    if not len(src):
        return
    for _, t in named:
        t.index_copy_(0, dst.on(t.device), t.index_select(0, src.on(t.device)))


def _swap_pairs(src_tensors: TensorSet, dst_tensors: TensorSet
                ) -> list[tuple[str, torch.Tensor, str, torch.Tensor]]:
    src, dst = _named(src_tensors, "src_tensors"), _named(dst_tensors, "dst_tensors")
    if isinstance(src_tensors, Mapping) and isinstance(dst_tensors, Mapping):
        if set(src_tensors) != set(dst_tensors):
            msg = (f"src_tensors and dst_tensors must have the same keys, but got "
                   f"{sorted(src_tensors)} and {sorted(dst_tensors)}")
            raise InvalidArgumentError(msg)
        by_name = dict(dst)
        dst = [(name, by_name[name]) for name, _ in src]
    elif len(src) != len(dst):
        msg = f"{len(src)} source tensors but {len(dst)} destination tensors"
        raise InvalidArgumentError(msg)
    pairs = []
    for (sn, s), (dn, d) in zip(src, dst, strict=True):
        if s.dtype != d.dtype:
            raise InvalidTypeError(f"{sn} is {s.dtype} but {dn} is {d.dtype}")
        if s.shape[1:] != d.shape[1:]:
            msg = (f"blocks of {sn} have shape {list(s.shape[1:])} but blocks of {dn} have "
                   f"shape {list(d.shape[1:])}")
            raise InvalidArgumentError(msg)
        pairs.append((sn, s, dn, d))
    return pairs


def swap_blocks(src_tensors: TensorSet, dst_tensors: TensorSet, src_block_ids: BlockIds,
                dst_block_ids: BlockIds) -> None:
    """Copy blocks ``src_tensors[k][src[i]] -> dst_tensors[k][dst[i]]``, across devices.

    Swap-out is device caches to host caches, swap-in the reverse; pairs of
    tensors are matched by key (two mappings) or by position.  Blocks keep
    their layout, so both sides need the same dtype and block shape; the
    pools may differ in size.  Returns once the destination is written.

    Raises:
        InvalidTypeError: mismatched dtypes, ids that are not 1-D integers.
        InvalidArgumentError: mismatched block shapes, keys, counts or id
            lengths, a destination repeated.
        BlockIndexError: an id outside its side's blocks.

    >>> dev, host = [torch.arange(3.0).view(3, 1)], [torch.zeros(5, 1)]
    >>> swap_blocks(dev, host, [2, 1], [0, 4]); host[0].view(-1).tolist()
    [2.0, 0.0, 0.0, 0.0, 1.0]
    """
    pairs = _swap_pairs(src_tensors, dst_tensors)
    src, dst = _Ids(src_block_ids, "src_block_ids"), _Ids(dst_block_ids, "dst_block_ids")
    _pair(src, dst)
    src.check_range([(sn, s) for sn, s, _, _ in pairs])
    dst.check_range([(dn, d) for _, _, dn, d in pairs])
    if not len(src):
        return
    for _, s, _, d in pairs:
        d.index_copy_(0, dst.on(d.device), s.index_select(0, src.on(s.device)).to(d.device))


def zero_blocks(tensors: TensorSet, block_ids: BlockIds) -> None:
    """Fill blocks with zeros in every tensor (for example newly allocated ones).

    Raises:
        InvalidTypeError: not tensors, or ids that are not 1-D integers.
        BlockIndexError: an id outside a tensor's blocks.

    >>> t = torch.ones(3, 2)
    >>> zero_blocks({"k": t}, [0, 2]); t.tolist()
    [[0.0, 0.0], [1.0, 1.0], [0.0, 0.0]]
    """
    named = _named(tensors, "tensors")
    ids = _Ids(block_ids, "block_ids")
    ids.check_range(named)
    _zero(named, ids)


def _zero(named: _Named, ids: _Ids) -> None:
    if len(ids):
        for _, t in named:
            t.index_fill_(0, ids.on(t.device), 0)


def apply_delta(tensors_by_key: Mapping[str, TensorSet], delta: BlocksChanged | TierDelta, *,
                zero_new_blocks: bool = False) -> None:
    """Perform what a delta asks of the cache tensors: block copies, then optional zeroing.

    ``tensors_by_key`` maps each manager key to its cache tensors (see
    :func:`kvfunc.shell.cache_tensors_by_key`).  The delta's operations are
    read in order (:meth:`~kvfunc.BlocksChanged.operations`).  Its copies
    (copy-on-write, a saved state seeding a new request, a state saved into
    the cache) run first, in order: a copy that reads a block an earlier copy
    wrote (a state saved right after its copy-on-write) sees the new
    contents, and any other copies read their sources before a destination is
    written, so runs of independent copies are batched into one
    ``index_copy_`` per tensor.  Then, with ``zero_new_blocks``, the blocks
    the transition took from the pools for table entries are zeroed: the
    non-null ``Appended`` blocks (``Shared`` entries keep their cached or
    forked contents) that no ``COPY_INTO_NEW`` copy seeds.  A state saved into
    the cache and handed out again later in the same transition is zeroed
    after its copy.  Copies go first because a copy's source may, in the same
    delta, have been handed out to another request as a new block.  Every
    key's operations are checked before any tensor is written.

    A tiered transition's :class:`~kvfunc.TierDelta` applies its device
    delta; its moves are the caller's to run afterwards (a load into a new
    block must land after the block is zeroed).

    Keys whose tensors share memory (the overlaid views of a shared pool,
    :func:`kvfunc.shell.with_shared_cache_tensors`) are one block space: a
    copy of one group waits for another group's earlier copy that writes its
    block, every source in shared memory is read before a destination there
    is written, and a block handed out to one group and then seeded by a
    later copy of another is not zeroed.

    Raises:
        MissingKeyError: the delta names a key without tensors.
        InvalidTypeError, InvalidArgumentError, BlockIndexError: as
            :func:`copy_blocks` and :func:`zero_blocks`.

    Block 3 is copied into block 1, then handed out anew and zeroed; the
    shared block 2 keeps its contents:

    >>> import kvfunc as kf
    >>> t = torch.arange(1.0, 5.0).view(4, 1)
    >>> d = BlocksChanged(order="SCA", shared_keys=("full",), shared_request_ids=("a",),
    ...                   shared_block_ids=(2,), copied_keys=("full",),
    ...                   copied_request_ids=("c",), copied_positions=(kf.COPY_SAVED,),
    ...                   copied_src_block_ids=(3,), copied_dst_block_ids=(1,),
    ...                   appended_keys=("full",), appended_request_ids=("b",),
    ...                   appended_block_ids=(3,))
    >>> apply_delta({"full": [t]}, d, zero_new_blocks=True); t[:, 0].tolist()
    [1.0, 4.0, 3.0, 0.0]
    """
    delta = device_delta(delta)
    copies: list[tuple[str, int, int]] = []
    appended: list[tuple[int, str, int]] = []  # (copies before it, key, block)
    seeded: set[tuple[str, int]] = set()
    for op in delta.operations():  # in the order the transition performed them
        if type(op) is Copied:
            copies.append((op.key, op.src_block_id, op.dst_block_id))
            if op.position == COPY_INTO_NEW:
                seeded.add((op.key, op.dst_block_id))
        elif type(op) is Appended and op.block_id and zero_new_blocks:
            appended.append((len(copies), op.key, op.block_id))
    named: dict[str, _Named] = {}
    for key in dict.fromkeys([k for k, _, _ in copies] + [k for _, k, _ in appended]):
        if key not in tensors_by_key:
            msg = f"the delta names manager_key={key!r}, which has no tensors"
            raise MissingKeyError(msg)
        named[key] = _named(tensors_by_key[key], f"tensors_by_key[{key!r}]")
    domain = _domains(named)
    copy_plan = [[(named[key], _Ids(srcs, f"copy sources of {key!r}"),
                   _Ids(dsts, f"copy destinations of {key!r}"))
                  for key, (srcs, dsts) in wave.items()] for wave in _waves(copies, domain)]
    zero_plan = [(named[key], _Ids(blocks, f"new blocks of {key!r}"))
                 for key, blocks in _zeros(appended, copies, seeded, domain).items()]
    for wave in copy_plan:
        for tensors, src, dst in wave:
            src.check_range(tensors)
            dst.check_range(tensors)
    for tensors, ids in zero_plan:
        ids.check_range(tensors)
    for wave in copy_plan:
        _copy_wave(wave)
    for tensors, ids in zero_plan:
        _zero(tensors, ids)


def _domains(named: Mapping[str, _Named]) -> dict[str, int]:
    """A number per key; keys whose tensors share a storage (overlaid views) share it.

    >>> t = torch.zeros(4, 2)
    >>> _domains({"a": [("x", t[:, :1])], "b": [("y", t[:, 1:])], "c": [("z", torch.ones(1))]})
    {'a': 0, 'b': 0, 'c': 2}
    """
    keys = list(named)
    parent = list(range(len(keys)))

    def root(i: int) -> int:
        while parent[i] != i:
            i = parent[i]
        return i

    owner: dict[int, int] = {}
    for i, key in enumerate(keys):
        for _, t in named[key]:
            j = owner.setdefault(t.untyped_storage().data_ptr(), i)
            a, b = root(i), root(j)
            parent[max(a, b)] = min(a, b)
    return {key: root(i) for i, key in enumerate(keys)}


def _zeros(appended: Sequence[tuple[int, str, int]], copies: Sequence[tuple[str, int, int]],
           seeded: set[tuple[str, int]], domain: Mapping[str, int]) -> dict[str, list[int]]:
    """The new blocks to zero per key: those that no copy seeds, in their own group or,
    after they were handed out, in another group that shares their memory.

    >>> _zeros([(0, "a", 5), (0, "a", 6)], [("b", 1, 5)], set(), {"a": 0, "b": 0})
    {'a': [6]}
    """
    into: dict[tuple[int, int], list[tuple[int, str]]] = {}
    for i, (key, _, dst) in enumerate(copies):
        into.setdefault((domain[key], dst), []).append((i, key))
    out: dict[str, list[int]] = {}
    for before, key, b in appended:
        if (key, b) in seeded or any(i >= before and k != key
                                     for i, k in into.get((domain[key], b), ())):
            continue
        out.setdefault(key, []).append(b)
    return out


def _copy_wave(wave: Sequence[tuple[_Named, _Ids, _Ids]]) -> None:
    """Run one wave of copies: in each storage, every source is read before any write."""
    by_storage: dict[int, list[tuple[torch.Tensor, _Ids, _Ids]]] = {}
    for tensors, src, dst in wave:
        if len(src):
            for _, t in tensors:
                by_storage.setdefault(t.untyped_storage().data_ptr(), []).append((t, src, dst))
    for items in by_storage.values():
        read = [t.index_select(0, src.on(t.device)) for t, src, _ in items]
        for (t, _, dst), values in zip(items, read, strict=True):
            t.index_copy_(0, dst.on(t.device), values)


def _waves(copies: Sequence[tuple[str, int, int]], domain: Mapping[str, int]
           ) -> list[dict[str, tuple[list[int], list[int]]]]:
    """Split copies (in order) into runs that may each run at once, per key.

    A run ends before a copy whose source or destination an earlier copy of
    the run writes, in the same block space (keys of one domain share one),
    so running the runs one after the other, each reading all its sources
    first, equals running the copies one by one.

    >>> _waves([("a", 1, 2), ("a", 2, 3), ("b", 2, 6), ("a", 1, 3)], {"a": 0, "b": 1})
    [{'a': ([1], [2])}, {'a': ([2], [3]), 'b': ([2], [6])}, {'a': ([1], [3])}]
    """
    out: list[dict[str, tuple[list[int], list[int]]]] = []
    written: set[tuple[int, int]] = set()
    for key, s, d in copies:
        space = domain[key]
        if not out or (space, s) in written or (space, d) in written:
            out.append({})
            written = set()
        srcs, dsts = out[-1].setdefault(key, ([], []))
        srcs.append(s)
        dsts.append(d)
        written.add((space, d))
    return out
