"""Deltas: what one transition did to the cache, as plain columnar data.

One :class:`BlocksChanged` record per transition, with parallel tuples (one
row per table entry or block), never one object per block.  Rows of a
column family are in the order the transition performed them, which is what
:func:`kvfunc.replay` needs to reproduce the free queue exactly:

* ``registered_*``  requests that got an (empty) table in a group;
* ``nulled_*``      table positions replaced by the null block (recycling);
* ``freed_*``       blocks returned to the tail of a group's free queue;
* ``released_*``    requests whose table was removed;
* ``appended_*``    table entries appended; block 0 is a null entry (a
  sliding-window head), any other id was taken from the head of the queue;
* ``copied_*``      block copies the shell must perform before the step
  runs, **in row order** (a copy may read a block an earlier copy wrote);
  with prefix caching each row also names the request and the table
  position the copy lands in (copy-on-write), :data:`COPY_INTO_NEW` when the
  destination is a block the request was just given (a saved state that
  seeds a new request), or :data:`COPY_SAVED` when the destination is taken
  from the pool only to be cached (a state saved at a block boundary);
  ``copied_after`` is the number of ``appended_*`` rows the transition had
  written when it made the copy, which orders the copies' blocks among the
  appended ones taken from the same pool.

Only states with prefix caching produce the remaining families:

* ``shared_*``      appended entries that reference a block someone else
  holds or that was cached (a prefix hit, a fork): not taken from the pool,
  never to be zeroed;
* ``touched_*``     cached free blocks a hit took out of the free queue;
* ``stored_*``      full blocks cached under a hash (with the parent hash and
  the block's token ids, for KV events);
* ``evicted_*``     cached blocks forgotten because the pool handed them out;
* ``cleared_keys``  groups whose whole prefix cache was reset;
* ``hit_*``         one row per admission that asked the cache: the tokens
  hit and the tokens looked up (hit-rate metrics).

Replay applies, per group, nulls and frees, then releases, registrations and
appends.  Taking from the head and returning to the tail commute as long as
the queue never runs dry, which a valid transition guarantees.  On caching
states replay interleaves copies with appends by ``copied_after``.
"""

from __future__ import annotations

from typing import Any

import attrs

from kvfunc.core._state import BlockId, RequestId

__all__ = ["COPY_INTO_NEW", "COPY_SAVED", "DELTA_VERSION", "BlocksChanged", "CacheRows",
           "DeltaBuilder"]

DELTA_VERSION = 1
COPY_INTO_NEW = -1
COPY_SAVED = -2

_EMPTY: tuple[Any, ...] = ()


@attrs.frozen(slots=True)
class BlocksChanged:
    """The delta of one transition (see the module docstring for the columns).

    Its ``repr`` is valid Python that rebuilds an equal record:

    >>> d = BlocksChanged(appended_keys=("full",), appended_request_ids=("r1",),
    ...                   appended_block_ids=(1,))
    >>> eval(repr(d)) == d
    True
    >>> d.is_empty, BlocksChanged().is_empty
    (False, True)
    """

    version: int = DELTA_VERSION
    registered_keys: tuple[str, ...] = _EMPTY
    registered_request_ids: tuple[RequestId, ...] = _EMPTY
    nulled_keys: tuple[str, ...] = _EMPTY
    nulled_request_ids: tuple[RequestId, ...] = _EMPTY
    nulled_positions: tuple[int, ...] = _EMPTY
    freed_keys: tuple[str, ...] = _EMPTY
    freed_block_ids: tuple[BlockId, ...] = _EMPTY
    released_keys: tuple[str, ...] = _EMPTY
    released_request_ids: tuple[RequestId, ...] = _EMPTY
    appended_keys: tuple[str, ...] = _EMPTY
    appended_request_ids: tuple[RequestId, ...] = _EMPTY
    appended_block_ids: tuple[BlockId, ...] = _EMPTY
    copied_keys: tuple[str, ...] = _EMPTY
    copied_src_block_ids: tuple[BlockId, ...] = _EMPTY
    copied_dst_block_ids: tuple[BlockId, ...] = _EMPTY
    copied_request_ids: tuple[RequestId, ...] = _EMPTY
    copied_positions: tuple[int, ...] = _EMPTY
    copied_after: tuple[int, ...] = _EMPTY
    shared_keys: tuple[str, ...] = _EMPTY
    shared_request_ids: tuple[RequestId, ...] = _EMPTY
    shared_block_ids: tuple[BlockId, ...] = _EMPTY
    touched_keys: tuple[str, ...] = _EMPTY
    touched_block_ids: tuple[BlockId, ...] = _EMPTY
    stored_keys: tuple[str, ...] = _EMPTY
    stored_block_ids: tuple[BlockId, ...] = _EMPTY
    stored_hashes: tuple[bytes, ...] = _EMPTY
    stored_parent_hashes: tuple[bytes | None, ...] = _EMPTY
    stored_token_ids: tuple[tuple[int, ...], ...] = _EMPTY
    evicted_keys: tuple[str, ...] = _EMPTY
    evicted_block_ids: tuple[BlockId, ...] = _EMPTY
    evicted_hashes: tuple[bytes, ...] = _EMPTY
    cleared_keys: tuple[str, ...] = _EMPTY
    hit_request_ids: tuple[RequestId, ...] = _EMPTY
    hit_tokens: tuple[int, ...] = _EMPTY
    hit_query_tokens: tuple[int, ...] = _EMPTY

    @property
    def is_empty(self) -> bool:
        """True when the transition changed nothing."""
        return not (self.registered_keys or self.nulled_keys or self.freed_keys
                    or self.released_keys or self.appended_keys or self.copied_keys
                    or self.shared_keys or self.touched_keys or self.stored_keys
                    or self.evicted_keys or self.cleared_keys or self.hit_request_ids)

    def new_block_ids(self, key: str) -> tuple[BlockId, ...]:
        """Blocks taken from ``key``'s pool, in hand-out order (for zeroing).

        >>> BlocksChanged(appended_keys=("a", "a"), appended_request_ids=(1, 1),
        ...               appended_block_ids=(0, 5)).new_block_ids("a")
        (5,)
        """
        shared = {b for k, b in zip(self.shared_keys, self.shared_block_ids, strict=True)
                  if k == key}
        return tuple(b for k, b in zip(self.appended_keys, self.appended_block_ids, strict=True)
                     if k == key and b and b not in shared)


EMPTY_DELTA = BlocksChanged()


class CacheRows:
    """Rows only caching transitions produce (created on first use)."""

    __slots__ = ("cleared", "copied", "evicted", "hits", "shared", "stored", "touched")

    def __init__(self) -> None:
        self.copied: list[tuple[str, RequestId, int, BlockId, BlockId, int]] = []
        self.shared: list[tuple[str, RequestId, BlockId]] = []
        self.touched: list[tuple[str, BlockId]] = []
        self.stored: list[tuple[str, BlockId, bytes, bytes | None, tuple[int, ...]]] = []
        self.evicted: list[tuple[str, BlockId, bytes]] = []
        self.cleared: list[str] = []
        self.hits: list[tuple[RequestId, int, int]] = []

    def columns(self) -> tuple[tuple[Any, ...], ...]:
        """The rows as the ``BlocksChanged`` columns after ``appended_*``, in field order."""
        out: list[tuple[Any, ...]] = []
        copied = self.copied
        if copied:
            keys, rids, positions, srcs, dsts, after = zip(*copied, strict=True)
            out += (keys, srcs, dsts, rids, positions, after)
        else:
            out += (_EMPTY,) * 6
        for rows, width in ((self.shared, 3), (self.touched, 2), (self.stored, 5),
                            (self.evicted, 3)):
            out += tuple(zip(*rows, strict=True)) if rows else (_EMPTY,) * width
        out.append(tuple(self.cleared))
        out += tuple(zip(*self.hits, strict=True)) if self.hits else (_EMPTY,) * 3
        return tuple(out)

    def __bool__(self) -> bool:
        return bool(self.copied or self.shared or self.touched or self.stored or self.evicted
                    or self.cleared or self.hits)


class DeltaBuilder:
    """Mutable row collector used inside one transition, then frozen once."""

    __slots__ = ("appended", "cache", "freed", "nulled", "registered", "released")

    def __init__(self) -> None:
        self.registered: list[tuple[str, RequestId]] = []
        self.nulled: list[tuple[str, RequestId, int]] = []
        self.freed: list[tuple[str, BlockId]] = []
        self.released: list[tuple[str, RequestId]] = []
        self.appended: list[tuple[str, RequestId, BlockId]] = []
        self.cache: CacheRows | None = None

    def cache_rows(self) -> CacheRows:
        """The caching rows (created on first use)."""
        rows = self.cache
        if rows is None:
            rows = self.cache = CacheRows()
        return rows

    def build(self) -> BlocksChanged:
        """Freeze the collected rows into one columnar record."""
        cache = self.cache
        if not (self.registered or self.nulled or self.freed or self.released or self.appended
                or cache):
            return EMPTY_DELTA
        reg = tuple(zip(*self.registered, strict=True)) or (_EMPTY, _EMPTY)
        nul = tuple(zip(*self.nulled, strict=True)) or (_EMPTY, _EMPTY, _EMPTY)
        fre = tuple(zip(*self.freed, strict=True)) or (_EMPTY, _EMPTY)
        rel = tuple(zip(*self.released, strict=True)) or (_EMPTY, _EMPTY)
        app = tuple(zip(*self.appended, strict=True)) or (_EMPTY, _EMPTY, _EMPTY)
        if cache:
            return BlocksChanged(DELTA_VERSION, reg[0], reg[1], nul[0], nul[1], nul[2], fre[0],
                                 fre[1], rel[0], rel[1], app[0], app[1], app[2],
                                 *cache.columns())
        return BlocksChanged(DELTA_VERSION, reg[0], reg[1], nul[0], nul[1], nul[2], fre[0], fre[1],
                             rel[0], rel[1], app[0], app[1], app[2])
