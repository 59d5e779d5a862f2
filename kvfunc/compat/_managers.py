"""The seed's single-type managers, as views over a shared store.

Each manager wraps one group of the current :class:`~kvfunc.KVState`.  A
manager built on its own owns a one-group store; ``KVCacheManager`` rebinds
all of its managers (and their block pools) to one shared store, so a call
through a manager object is seen by the ``KVCacheManager`` and vice versa.
All policy comes from :mod:`kvfunc.core`; these classes only translate the
seed's method shapes and messages.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

from kvfunc.compat._store import BlockPool, Store, take_check
from kvfunc.core import (
    FullAttention,
    GroupState,
    InvalidArgumentError,
    InvalidTypeError,
    KVState,
    Mamba,
    NotSupportedError,
    SlidingWindow,
    UnknownAttentionTypeError,
)
from kvfunc.core._internal import (
    GroupCopy,
    check_request_id,
    excerpt,
    free_into,
    group_cache_entries,
    recycle_into,
    row_table,
)

__all__ = [
    "ATTN_TYPE_MANAGER_MAP",
    "FullAttentionManager",
    "MambaManager",
    "SingleTypeKVCacheManager",
    "SlidingWindowManager",
    "create_single_type_managers",
]

logger = logging.getLogger("kvfunc.compat")


def _check_count(name: str, value: object) -> int:
    """``value`` if it is a non-negative int (not a bool); else a typed error naming it."""
    if type(value) is not int:
        msg = f"{name} must be a non-negative int, but got {excerpt(value)}"
        raise InvalidTypeError(msg)
    if value < 0:
        raise InvalidArgumentError(f"{name} must be non-negative, but got {excerpt(value)}")
    return value


def _check_num_tokens(num_tokens: object) -> int:
    return _check_count("num_tokens", num_tokens)


class SingleTypeKVCacheManager:
    """Base single-type manager (seed §3.1): append-only, with reservations.

    >>> m = FullAttentionManager("FullAttention", 6, 4, manager_key="full")
    >>> m.pre_allocate_blocks("a", 9)
    (3, True)
    >>> m.allocate_new_blocks("a", 3); m.get_blocks("a"), m.get_num_free_blocks()
    ([1, 2, 3], 2)
    """

    _abstract: ClassVar[bool] = True

    def __init__(self, attn_type: str, block_num: int, block_size: int,
                 manager_key: str | None = None, max_model_len: int | None = None,
                 **kwargs: Any) -> None:
        self.attn_type = attn_type
        self.manager_key = manager_key if manager_key is not None else attn_type
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.block_pool = BlockPool(block_num, block_size)  # the seed's first check
        policy = self._make_policy(block_num, block_size, kwargs)
        limit = max_model_len if type(max_model_len) is int and max_model_len >= 0 else 0
        store = Store(KVState.create({self.manager_key: policy}, limit))
        self._bind(store, 0)

    def _make_policy(self, block_num: int, block_size: int, kwargs: Mapping[str, Any]) -> Any:
        # The base class allocates like full attention; only skipping is abstract.
        return FullAttention(num_blocks=block_num, block_size=block_size)

    def _bind(self, store: Store, index: int) -> None:
        self._store = store
        self._index = index
        self.block_pool._store = store
        self.block_pool._index = index

    @property
    def _group(self) -> GroupCopy:
        return self._store.tr.copy(self._index)

    def _parts(self) -> tuple[GroupState, Any]:
        """This manager's group and pool as values (a ``KVCacheManager`` composes them)."""
        state = self._store.state
        return state.groups[self._index], state.pools[state.groups[self._index].pool]

    @property
    def req_to_blocks(self) -> Mapping[Any, list[int]]:
        """Read-only snapshot: request id -> block ids (zero-block registrations too)."""
        rows = self._group.items()
        return types.MappingProxyType({r: list(row_table(row)) for r, row in rows})

    def pre_allocate_blocks(self, request_id: Any, num_tokens: int,
                            reserved_tokens: int = 0) -> tuple[int, bool]:
        """``(blocks needed, whether they can be had)`` for ``num_tokens``; changes nothing."""
        check_request_id(request_id)
        _check_num_tokens(num_tokens)
        _check_count("reserved_tokens", reserved_tokens)
        g = self._group
        row = g.row(request_id)
        _, need = g.policy.plan_blocks(0 if row is None else row.length, num_tokens)
        reserve = g.policy.num_reserved_blocks(reserved_tokens, len(g.rows))
        ok = need <= g.pool.count - reserve
        if not ok:
            logger.debug("%s: request %r needs %d blocks, %d free, %d reserved",
                         self.manager_key, request_id, need, g.pool.count, reserve)
        return need, bool(ok)

    def allocate_new_blocks(self, request_id: Any, block_num_to_allocate: int,
                            num_tokens: int | None = None) -> None:
        """Take blocks from the pool and append them (registers the request even for 0).

        A table that starts empty in a windowed group gets its null head first,
        and the result must span ``ceil(num_tokens / block_size)`` entries; the
        check happens before any block is taken (the seed checked after).
        """
        check_request_id(request_id)
        if num_tokens is not None:  # read only by a window's first allocation: checked always
            _check_num_tokens(num_tokens)
        g = self._group
        take_check(g, block_num_to_allocate)
        row = g.row(request_id)
        nulls = 0
        if (row is None or not row.length) and g.window is not None:
            if num_tokens is None:
                msg = f"num_tokens is required for the first allocation of {excerpt(request_id)}"
                raise InvalidTypeError(msg)
            nulls, expected = g.policy.plan_blocks(0, num_tokens)
            if block_num_to_allocate != expected:
                got = excerpt(nulls + block_num_to_allocate)
                msg = ("Sliding-window block table length mismatch after prefill allocation: "
                       f"got={got}, expected={nulls + expected}")
                raise InvalidArgumentError(msg)
        tr = self._store.tr
        if row is None:
            row = g.register(request_id, tr.seq)
            tr.seq += 1
        g.put(request_id, g.grow(request_id, row, block_num_to_allocate, nulls))

    def free(self, request_id: Any) -> None:
        """Release the request's blocks in logical order; unknown ids are a no-op."""
        check_request_id(request_id)
        free_into(self._store.tr, request_id, frozenset((self.manager_key,)))

    def get_blocks(self, request_id: Any) -> list[int]:
        """A snapshot list of the request's block ids (``[]`` when unknown)."""
        check_request_id(request_id)
        row = self._group.row(request_id)
        return [] if row is None else list(row_table(row))

    def get_num_free_blocks(self) -> int:
        """Free blocks in this manager's pool."""
        return self._group.pool.count

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens that no longer need KV once this many are computed."""
        raise NotSupportedError("Subclasses must implement get_num_skipped_tokens")

    def remove_skipped_blocks(self, request_id: Any, total_computed_tokens: int) -> None:
        """Null the blocks that slid out and free them, highest index first."""
        check_request_id(request_id)
        _check_count("total_computed_tokens", total_computed_tokens)
        skipped = self.get_num_skipped_tokens(total_computed_tokens)
        if skipped <= 0:
            return
        recycle_into(self._store.tr, request_id, total_computed_tokens,
                     frozenset((self.manager_key,)))

    @staticmethod
    def validate_and_build_kwargs(entries: Iterable[Any]) -> dict[str, Any]:
        """Type arguments shared by a group's cache entries."""
        raise NotSupportedError("Subclasses must implement validate_and_build_kwargs")


class FullAttentionManager(SingleTypeKVCacheManager):
    """Full attention (seed §3.2); ``compress_ratio`` only matters to sizing/slots."""

    _abstract: ClassVar[bool] = False

    def __init__(self, attn_type: str, block_num: int, block_size: int,
                 manager_key: str | None = None, max_model_len: int | None = None,
                 compress_ratio: int = 1, **kwargs: Any) -> None:
        self.compress_ratio = compress_ratio
        super().__init__(attn_type, block_num, block_size, manager_key, max_model_len,
                         compress_ratio=compress_ratio, **kwargs)

    def _make_policy(self, block_num: int, block_size: int, kwargs: Mapping[str, Any]) -> Any:
        return FullAttention(num_blocks=block_num, block_size=block_size,
                             compress_ratio=kwargs["compress_ratio"])

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Full attention keeps every token: 0."""
        return 0

    @staticmethod
    def validate_and_build_kwargs(entries: Iterable[Any]) -> dict[str, Any]:
        """``{"compress_ratio": r}``; every entry must share it."""
        return FullAttention.kwargs_from_entries(entries)


class SlidingWindowManager(SingleTypeKVCacheManager):
    """Sliding-window attention (seed §3.3)."""

    _abstract: ClassVar[bool] = False

    def __init__(self, attn_type: str, block_num: int, block_size: int,
                 manager_key: str | None = None, max_model_len: int | None = None, *,
                 sliding_window: int, **kwargs: Any) -> None:
        self.sliding_window = sliding_window
        super().__init__(attn_type, block_num, block_size, manager_key, max_model_len,
                         sliding_window=sliding_window, **kwargs)

    def _make_policy(self, block_num: int, block_size: int, kwargs: Mapping[str, Any]) -> Any:
        return SlidingWindow(num_blocks=block_num, block_size=block_size,
                             sliding_window=kwargs["sliding_window"])

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """``max(0, C - W + 1)``."""
        _check_count("num_computed_tokens", num_computed_tokens)
        return int(self._group.policy.num_skipped_tokens(num_computed_tokens))

    @staticmethod
    def validate_and_build_kwargs(entries: Iterable[Any]) -> dict[str, Any]:
        """``{"sliding_window": W}``; every entry must define the same one."""
        return SlidingWindow.kwargs_from_entries(entries)


class MambaManager(SingleTypeKVCacheManager):
    """Mamba state blocks (seed §3.4): 1 block, then topped up to ``1 + next_n``."""

    _abstract: ClassVar[bool] = False

    def __init__(self, attn_type: str, block_num: int, block_size: int,
                 manager_key: str | None = None, max_model_len: int | None = None,
                 next_n: int = 0, **kwargs: Any) -> None:
        self.next_n = next_n
        super().__init__(attn_type, block_num, block_size, manager_key, max_model_len,
                         next_n=next_n, **kwargs)

    def _make_policy(self, block_num: int, block_size: int, kwargs: Mapping[str, Any]) -> Any:
        return Mamba(num_blocks=block_num, block_size=block_size, next_n=kwargs["next_n"])

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """A state never drops tokens: 0."""
        return 0

    @staticmethod
    def validate_and_build_kwargs(entries: Iterable[Any]) -> dict[str, Any]:
        """``{"next_n": n}``; every entry must share it."""
        return Mamba.kwargs_from_entries(entries)


ATTN_TYPE_MANAGER_MAP: dict[str, type[SingleTypeKVCacheManager]] = {
    "FullAttention": FullAttentionManager,
    "SlidingWindow": SlidingWindowManager,
    "Mamba": MambaManager,
}


def _manager_class(attn_type: str) -> type[SingleTypeKVCacheManager]:
    cls = ATTN_TYPE_MANAGER_MAP.get(attn_type)
    if cls is None:
        msg = (f"Unknown attn_type: {attn_type}, Please add a SingleTypeKVCacheManager class "
               f"corresponding to {attn_type}.")
        raise UnknownAttentionTypeError(msg)
    return cls


def create_single_type_managers(cache_info: Any, block_num_by_type: Mapping[str, int],
                                max_model_len: int) -> list[SingleTypeKVCacheManager]:
    """One manager per ``group_key`` of the paged caches, in first-appearance order.

    >>> from kvfunc import CacheEntry, LayerCacheInfo, ModelCacheInfo
    >>> e = CacheEntry("kv", "FullAttention", 64, 4, "bfloat16", True, block_size=16)
    >>> ms = create_single_type_managers(ModelCacheInfo(1, [LayerCacheInfo(0, [e])]),
    ...                                  {"FullAttention": 10}, 1024)
    >>> [(m.manager_key, m.get_num_free_blocks()) for m in ms]
    [('FullAttention', 9)]
    """
    if not hasattr(cache_info, "layer_infos"):
        msg = f"cache_info must be a ModelCacheInfo, but got {type(cache_info).__name__}"
        raise InvalidTypeError(msg)
    if not isinstance(block_num_by_type, Mapping):
        msg = (f"block_num_by_type must be a mapping of manager keys to block counts, but got "
               f"{type(block_num_by_type).__name__}")
        raise InvalidTypeError(msg)
    managers = []
    for key, cls, block_size, entries in group_cache_entries(cache_info, block_num_by_type,
                                                              _manager_class):
        kwargs = cls.validate_and_build_kwargs(entries)
        attn_type = entries[0].attn_type
        manager = cls(attn_type=attn_type, block_num=block_num_by_type[key],
                      block_size=block_size, manager_key=key, max_model_len=max_model_len,
                      **kwargs)
        logger.info("created %s for manager_key=%s: block_num=%d, block_size=%d, %s",
                    cls.__name__, key, block_num_by_type[key], block_size, kwargs)
        managers.append(manager)
    return managers
