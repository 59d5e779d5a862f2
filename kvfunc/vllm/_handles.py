"""Block handles: vLLM's ``KVCacheBlock`` objects that stand for kvfunc block ids.

vLLM's scheduler receives blocks as ``KVCacheBlock`` objects (inside
``KVCacheBlocks``) and hands some back: a prefix hit's blocks to
``allocate_slots``, a deferred free's blocks to ``block_pool.free_blocks``.
kvfunc's state is the truth about every block; a handle carries only its
``block_id`` (its ``ref_cnt`` and hash fields are not kept up to date).  As in
vLLM's pool, there is one handle per block id, all made when the manager is
built (a hand-out then costs one list read per block), and block 0 is the
one null block.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["Handles"]


class Handles:
    """One handle per block id, made up front.

    ``block_type`` is vLLM's ``KVCacheBlock`` (any class built as
    ``block_type(block_id, is_null=...)``).

    >>> from dataclasses import dataclass
    >>> @dataclass(eq=False)
    ... class Block:
    ...     block_id: int
    ...     is_null: bool = False
    >>> h = Handles(8, Block)
    >>> [b.block_id for b in h.blocks((0, 3))], h.blocks((0,))[0].is_null
    ([0, 3], True)
    >>> h.blocks((3,))[0] is h.blocks((3,))[0]
    True
    """

    __slots__ = ("_get", "null")

    def __init__(self, num_blocks: int, block_type: Any) -> None:
        self.null = block_type(0, is_null=True)
        handles = [self.null, *map(block_type, range(1, num_blocks))]
        self._get = handles.__getitem__

    def blocks(self, ids: Iterable[int]) -> list[Any]:
        """The handles of ``ids`` (block 0 is the null handle)."""
        return list(map(self._get, ids))
