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
* ``copied_*``      block copies the shell must perform (copy-on-write).

Replay applies, per group, nulls and frees, then releases, registrations and
appends.  Taking from the head and returning to the tail commute as long as
the queue never runs dry, which a valid transition guarantees.
"""

from __future__ import annotations

from typing import Any

import attrs

from kvfunc.core._state import BlockId, RequestId

__all__ = ["DELTA_VERSION", "BlocksChanged", "DeltaBuilder"]

DELTA_VERSION = 1

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

    @property
    def is_empty(self) -> bool:
        """True when the transition changed nothing."""
        return not (self.registered_keys or self.nulled_keys or self.freed_keys
                    or self.released_keys or self.appended_keys or self.copied_keys)

    def new_block_ids(self, key: str) -> tuple[BlockId, ...]:
        """Blocks taken from ``key``'s pool, in hand-out order (for zeroing).

        >>> BlocksChanged(appended_keys=("a", "a"), appended_request_ids=(1, 1),
        ...               appended_block_ids=(0, 5)).new_block_ids("a")
        (5,)
        """
        return tuple(b for k, b in zip(self.appended_keys, self.appended_block_ids, strict=True)
                     if k == key and b)


EMPTY_DELTA = BlocksChanged()


class DeltaBuilder:
    """Mutable row collector used inside one transition, then frozen once."""

    __slots__ = ("appended", "freed", "nulled", "registered", "released")

    def __init__(self) -> None:
        self.registered: list[tuple[str, RequestId]] = []
        self.nulled: list[tuple[str, RequestId, int]] = []
        self.freed: list[tuple[str, BlockId]] = []
        self.released: list[tuple[str, RequestId]] = []
        self.appended: list[tuple[str, RequestId, BlockId]] = []

    def build(self) -> BlocksChanged:
        """Freeze the collected rows into one columnar record."""
        if not (self.registered or self.nulled or self.freed or self.released or self.appended):
            return EMPTY_DELTA
        reg = tuple(zip(*self.registered, strict=True)) or (_EMPTY, _EMPTY)
        nul = tuple(zip(*self.nulled, strict=True)) or (_EMPTY, _EMPTY, _EMPTY)
        fre = tuple(zip(*self.freed, strict=True)) or (_EMPTY, _EMPTY)
        rel = tuple(zip(*self.released, strict=True)) or (_EMPTY, _EMPTY)
        app = tuple(zip(*self.appended, strict=True)) or (_EMPTY, _EMPTY, _EMPTY)
        return BlocksChanged(DELTA_VERSION, reg[0], reg[1], nul[0], nul[1], nul[2], fre[0], fre[1],
                             rel[0], rel[1], app[0], app[1], app[2])
