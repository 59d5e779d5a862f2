"""Replay of deltas on a caching state (see ``_delta`` for the families).

Per delta: references dropped by nulls and releases, then the freed blocks
re-enter the queue, then the hits' touched blocks leave it, then
registrations, appends (shared entries add a reference, the others are taken
from the head, evicting what they held) interleaved with copies as
``copied_after`` says (copy-on-write and saved states take their destination
then; a copy-on-write drops its source's reference then too, or before the
frees when the delta frees that source; a saved state is cached at once, so
a later take evicts it as the transition did), the other stored hashes, and
cache resets.  Within a
transition a block is only ever freed before it is touched and touched
before anything is taken, and stored blocks are held until the transition
ends, so this order reproduces the transition exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvfunc.core._cache_transient import CacheGroupTransient
from kvfunc.core._delta import COPY_INTO_NEW, COPY_SAVED, BlocksChanged
from kvfunc.core._errors import ReplayMismatchError
from kvfunc.core._state import NULL_BLOCK, BlockId
from kvfunc.core._transient import Transient

__all__ = ["apply_cached_delta"]


def _group(tr: Transient, key: str) -> CacheGroupTransient:
    g = tr.group(key)
    assert isinstance(g, CacheGroupTransient)
    return g


def _take_one(g: CacheGroupTransient, block: BlockId, mismatch: Callable[[str], Exception]
              ) -> None:
    if g.count == 0:
        raise mismatch(f"{g.key!r} has no free block for {block!r}")
    (taken,) = g.take(1)
    if taken != block:
        raise mismatch(f"{g.key!r} hands out block {taken}, the delta says {block}")


def apply_cached_delta(tr: Transient, d: BlocksChanged,
                       mismatch: Callable[[str], ReplayMismatchError]) -> None:
    """Apply one delta to a caching transient, in the order of the module docstring."""
    for group in tr.groups:
        assert isinstance(group, CacheGroupTransient)
        group.writing()
    for key, rid, pos in zip(d.nulled_keys, d.nulled_request_ids, d.nulled_positions,
                             strict=True):
        g = _group(tr, key)
        table = g.tables.get(rid)
        if table is None or not 0 <= pos < len(table) or table[pos] == NULL_BLOCK:
            raise mismatch(f"cannot null position {pos} of {rid!r} in {key!r}: {table!r}")
        g.refs[table[pos]] -= 1
        g.set_table(rid, table[:pos] + (NULL_BLOCK,) + table[pos + 1:])
    freed = set(zip(d.freed_keys, d.freed_block_ids, strict=True))
    for key, pos, src in zip(d.copied_keys, d.copied_positions, d.copied_src_block_ids,
                             strict=True):
        if pos >= 0 and (key, src) in freed:  # its source is freed below: drop it first
            _group(tr, key).refs[src] -= 1
    for key, rid in zip(d.released_keys, d.released_request_ids, strict=True):
        g = _group(tr, key)
        if rid not in g.tables:
            raise mismatch(f"cannot release unknown request {rid!r} in {key!r}")
        for b in g.drop_table(rid):
            if b:
                g.refs[b] -= 1
    for key, block in zip(d.freed_keys, d.freed_block_ids, strict=True):
        g = _group(tr, key)
        if not 0 < block < g.policy.num_blocks or g.refs[block] != 0:
            raise mismatch(f"cannot free block {block!r} into {key!r}")
        g.give((block,))
    for key, block in zip(d.touched_keys, d.touched_block_ids, strict=True):
        g = _group(tr, key)
        if not 0 < block < g.policy.num_blocks or g.refs[block] != 0:
            raise mismatch(f"cannot touch block {block!r} of {key!r}: it is not free")
        g.stale[block] += 1  # its ring entry turns stale; the shared row adds the reference
        g.count -= 1
    for key, rid in zip(d.registered_keys, d.registered_request_ids, strict=True):
        g = _group(tr, key)
        if rid in g.tables:
            raise mismatch(f"request {rid!r} is already registered in {key!r}")
        g.set_table(rid, ())
    shared = set(zip(d.shared_keys, d.shared_request_ids, d.shared_block_ids, strict=True))
    saves: dict[tuple[str, BlockId], list[int]] = {}  # stored rows of saved states, in order
    for i, (key, block, tokens) in enumerate(zip(d.stored_keys, d.stored_block_ids,
                                                 d.stored_token_ids, strict=True)):
        if not tokens:
            saves.setdefault((key, block), []).append(i)
    consumed: set[int] = set()
    copies = list(zip(d.copied_keys, d.copied_request_ids, d.copied_positions,
                      d.copied_src_block_ids, d.copied_dst_block_ids,
                      d.copied_after or (len(d.appended_keys),) * len(d.copied_keys),
                      strict=True))
    done = 0
    appended = zip(d.appended_keys, d.appended_request_ids, d.appended_block_ids, strict=True)
    for j, (key, rid, block) in enumerate(appended):
        while done < len(copies) and copies[done][5] <= j:
            _copy(tr, copies[done], d, saves, consumed, freed, mismatch)
            done += 1
        g = _group(tr, key)
        table = g.tables.get(rid)
        if table is None:
            raise mismatch(f"cannot append to unknown request {rid!r} in {key!r}")
        if block != NULL_BLOCK:
            if (key, rid, block) in shared:
                g.refs[block] += 1
                g.changed = True
            else:
                _take_one(g, block, mismatch)
        g.set_table(rid, table + (block,))
    for row in copies[done:]:
        _copy(tr, row, d, saves, consumed, freed, mismatch)
    for i, (key, block, h) in enumerate(zip(d.stored_keys, d.stored_block_ids, d.stored_hashes,
                                            strict=True)):
        if i in consumed:
            continue
        g = _group(tr, key)
        if not 0 < block < g.policy.num_blocks or g.hash_of[block] is not None:
            raise mismatch(f"cannot cache block {block!r} of {key!r}")
        g.store(block, h)
    for key in d.cleared_keys:
        _group(tr, key).clear_cache()
    for group in tr.groups:
        assert isinstance(group, CacheGroupTransient)
        group.evicted = []


def _copy(tr: Transient, row: tuple[Any, ...], d: BlocksChanged,
          saves: dict[tuple[str, BlockId], list[int]], consumed: set[int],
          freed: set[tuple[str, BlockId]],
          mismatch: Callable[[str], ReplayMismatchError]) -> None:
    """One copy row: copy-on-write or a saved state takes its destination now."""
    key, rid, pos, src, dst, _ = row
    g = _group(tr, key)
    if pos == COPY_INTO_NEW:
        return
    _take_one(g, dst, mismatch)
    if pos == COPY_SAVED:
        g.refs[dst] = 0
        rows = saves.get((key, dst)) if src != dst else None
        if rows:  # a save evicted again in the same transition copies onto itself
            i = rows.pop(0)
            consumed.add(i)
            g.store(dst, d.stored_hashes[i])
        g.give((dst,))
        return
    table = g.tables.get(rid)
    if table is None or not 0 <= pos < len(table) or table[pos] != src:
        raise mismatch(f"cannot copy-on-write position {pos} of {rid!r} in {key!r}")
    g.set_table(rid, table[:pos] + (dst,) + table[pos + 1:])
    if (key, src) not in freed:  # drop the source here, in order with the step's shares
        g.refs[src] -= 1
        if not g.refs[src]:  # its last holder was this copy
            g.give((src,))
