"""Block handles: vLLM's ``KVCacheBlock`` objects that stand for kvfunc block ids.

vLLM's scheduler receives blocks as ``KVCacheBlock`` objects (inside
``KVCacheBlocks``) and hands some back: a prefix hit's blocks to
``allocate_slots``, a deferred free's blocks to ``block_pool.free_blocks``.
kvfunc's state is the truth about every block; a handle carries only its
``block_id`` (its ``ref_cnt`` and hash fields are not kept up to date).  There
is one handle per (group, block id), made when first needed, so that a handle
given back names its group; block 0 is vLLM's one null block in every group.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["Handles"]


class Handles:
    """One handle per (group, block id), made on first use.

    ``block_type`` is vLLM's ``KVCacheBlock`` (any class built as
    ``block_type(block_id, is_null=...)``).

    >>> from dataclasses import dataclass
    >>> @dataclass(eq=False)
    ... class Block:
    ...     block_id: int
    ...     is_null: bool = False
    >>> h = Handles(8, 2, Block)
    >>> [b.block_id for b in h.blocks(1, (0, 3))], h.blocks(0, (0,))[0].is_null
    ([0, 3], True)
    >>> h.group_of(h.blocks(1, (3,))[0]), h.group_of(h.blocks(0, (3,))[0])
    (1, 0)
    """

    __slots__ = ("_block", "by_group", "null", "num_blocks")

    def __init__(self, num_blocks: int, num_groups: int, block_type: Any) -> None:
        self._block = block_type
        self.num_blocks = num_blocks
        self.null = block_type(0, is_null=True)
        self.by_group: tuple[list[Any], ...] = tuple(
            [self.null] + [None] * (num_blocks - 1) for _ in range(num_groups))

    def _make(self, group: int, block_id: int) -> Any:
        handle = self.by_group[group][block_id] = self._block(block_id)
        return handle

    def blocks(self, group: int, ids: Iterable[int]) -> list[Any]:
        """The handles of ``ids`` (block 0 is the null handle) in group ``group``."""
        hs = self.by_group[group]
        return [h if (h := hs[b]) is not None else self._make(group, b) for b in ids]

    def group_of(self, block: Any) -> int | None:
        """The group whose handle ``block`` is (``None`` for the null block or a stranger)."""
        b = getattr(block, "block_id", None)
        if type(b) is not int or not 0 < b < self.num_blocks:
            return None
        for g, hs in enumerate(self.by_group):
            if hs[b] is block:
                return g
        return None
