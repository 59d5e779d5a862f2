"""The one mutable cell of the compat layer, and the seed's ``BlockPool``.

A :class:`Store` holds a transient over the current :class:`~kvfunc.KVState`.
Every compat object (a ``KVCacheManager``, its single-type managers, their
block pools) is a view that edits the store's transient through the core's
functions, so calls through any of them are seen by all the others.  Reading
:attr:`Store.state` freezes the transient into an immutable value (O(groups)
plus one table copy at the next write); :meth:`Store.restore` swaps in any
earlier state in O(groups).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvfunc.core import (
    NULL_BLOCK,
    BlockIndexError,
    DoubleFreeError,
    FullAttention,
    InvalidArgumentError,
    InvalidTypeError,
    KVState,
    OutOfBlocksError,
)
from kvfunc.core._internal import GroupCopy, PoolCopy, Transient, excerpt

__all__ = ["BlockPool", "Store"]


class Store:
    """A swappable transient over the current state."""

    __slots__ = ("tr",)

    def __init__(self, state: KVState) -> None:
        self.tr = Transient(state)

    @property
    def state(self) -> KVState:
        """The current state as an immutable value."""
        return self.tr.freeze()

    def restore(self, state: KVState) -> None:
        """Make ``state`` current (it must have the same groups and policies)."""
        current = self.tr.src
        if not isinstance(state, KVState):
            msg = f"restore() needs a KVState, got {type(state).__name__}"
            raise InvalidTypeError(msg)
        mine = [(g.key, g.policy, g.pool) for g in current.groups]
        theirs = [(g.key, g.policy, g.pool) for g in state.groups]
        if mine != theirs or state.max_model_len != current.max_model_len:
            msg = f"cannot restore a state with groups {theirs} into a manager with {mine}"
            raise InvalidArgumentError(msg)
        if state.prefix_caching:
            msg = "the seed-compatible manager has no prefix cache: restore a plain state"
            raise InvalidArgumentError(msg)
        if any(p.linked for p in state.pools):
            msg = ("the seed-compatible manager hands blocks out in the seed's order: restore a "
                   "state made with free_order='seed'")
            raise InvalidArgumentError(msg)
        self.tr = Transient(state)


def _check_block_id(block_id: object, num_blocks: int) -> int:
    if type(block_id) is not int or not 0 <= block_id < num_blocks:
        msg = f"block_id {excerpt(block_id)} is out of range [0, {num_blocks})"
        raise BlockIndexError(msg)
    return block_id


class BlockPool:
    """The seed's per-manager pool: null block 0, FIFO hand-out, tail re-entry.

    Standalone (``BlockPool(num_blocks, block_size)``) it owns a one-group
    store; inside a ``KVCacheManager`` it is a view of its manager's group.

    >>> pool = BlockPool(5, 16)
    >>> pool.get_new_blocks(2), pool.get_num_free_blocks()
    ([1, 2], 2)
    >>> pool.free_blocks([2, 0, 1]); pool._free_block_queue
    (3, 4, 2, 1)
    """

    __slots__ = ("_index", "_store", "block_size", "num_blocks")

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if type(num_blocks) is not int:
            msg = f"num_blocks must be an int, but got {excerpt(num_blocks)}"
            raise InvalidTypeError(msg)
        if num_blocks <= 0:
            raise InvalidArgumentError("num_blocks must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # The pool never uses its block size (as in the seed); the group needs one.
        bs = block_size if type(block_size) is int and block_size > 0 else 1
        self._store = Store(KVState.create(
            {"pool": FullAttention(num_blocks=num_blocks, block_size=bs)}, 0))
        self._index = 0

    @classmethod
    def _view(cls, store: Store, index: int, num_blocks: int, block_size: int) -> BlockPool:
        pool = cls.__new__(cls)
        pool.num_blocks, pool.block_size = num_blocks, block_size
        pool._store, pool._index = store, index
        return pool

    @property
    def _pool(self) -> PoolCopy:
        return self._store.tr.copy(self._index).pool

    @property
    def _free_block_queue(self) -> tuple[int, ...]:
        """Free ids in hand-out order (a read-only snapshot)."""
        return tuple(self._pool.free_ids())

    def get_num_free_blocks(self) -> int:
        """Number of free blocks (the null block never counts)."""
        return self._pool.count

    def get_null_block(self) -> int:
        """The null block's id: always 0."""
        return NULL_BLOCK

    def get_block(self, block_id: int) -> int:
        """``block_id`` itself after a range check (``IndexError`` outside)."""
        return _check_block_id(block_id, self.num_blocks)

    def get_new_blocks(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` ids from the head of the free queue.

        The blocks are held by no request until a manager attaches them; the
        state counts them as detached.
        """
        pool = self._pool
        take_check(pool, num_blocks)
        ids = pool.take(num_blocks)
        pool.detach(ids)
        return ids

    def free_blocks(self, block_ids: Iterable[int]) -> None:
        """Return ids to the tail, in order; the null id is skipped.

        Unlike the seed, the call is atomic: every id is checked (range, not
        already free, not held by a request) before any is freed.
        """
        if isinstance(block_ids, str | bytes) or not isinstance(block_ids, Iterable):
            msg = f"block_ids must be an iterable of block ids, but got {excerpt(block_ids)}"
            raise InvalidTypeError(msg)
        ids = list(block_ids)
        pool = self._pool
        free = set(pool.free_ids())
        detached = dict(pool.detached.items())
        to_free: list[int] = []
        for b in ids:
            _check_block_id(b, self.num_blocks)
            if b == NULL_BLOCK:
                continue
            if b in free:
                msg = f"block_id {b} is already free"
                raise DoubleFreeError(msg)
            if not detached.get(b):
                msg = f"block_id {b} is held by a request; free the request instead"
                raise InvalidArgumentError(msg)
            free.add(b)
            detached[b] -= 1
            to_free.append(b)
        pool.attach(to_free)
        pool.free(to_free, self._store.tr.views[self._index].key)


def take_check(g: GroupCopy | PoolCopy, num_blocks: Any) -> None:
    """The seed's ``get_new_blocks`` argument checks, before anything is taken."""
    if type(num_blocks) is not int:
        msg = f"num_blocks must be an int, but got {excerpt(num_blocks)}"
        raise InvalidTypeError(msg)
    if num_blocks < 0:
        raise InvalidArgumentError("num_blocks must be non-negative")
    pool = g if isinstance(g, PoolCopy) else g.pool
    if num_blocks > pool.count:
        msg = f"requested {excerpt(num_blocks)} blocks, but only {pool.count} are available"
        raise OutOfBlocksError(msg)
