"""The allocator's state: immutable values, cheap to keep.

Theory of operation
-------------------
A :class:`KVState` is ``max_model_len`` and a tuple of :class:`GroupState`,
one per manager key in manager order.  A group holds

* its policy (a frozen record: pool size, block size, type parameters);
* its block tables as rows (``_rows``): a persistent vector of
  :class:`~kvfunc.core._rows.Row` indexed by the slot that the lineage's
  shared :class:`~kvfunc.core._rows.SlotMap` gives each request id;
* the free queue (``_pool``): a ring of chunks with ``free_head`` and
  ``num_free``, exactly the seed's FIFO;
* ``num_detached``: blocks taken straight from the pool (the seed's
  ``BlockPool.get_new_blocks``) that no request holds;
* with prefix caching, a :class:`~kvfunc.core._cache.GroupCache`.

Conservation: ``num_free + held + num_detached == num_blocks - 1``, where
``held`` counts the distinct non-null blocks of all tables; the null block 0
is never free and never held.  :func:`check_invariants` checks it and more.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, NoReturn, TypeVar

import attrs
from pyrsistent import PVector, pvector

from kvfunc.core._cache import GroupCache, live_ring_ids
from kvfunc.core._checks import MAX_NUM_BLOCKS, excerpt
from kvfunc.core._errors import InvalidArgumentError, InvalidTypeError, UnknownRequestError
from kvfunc.core._policy import Policy, policies_by_key, policy_class
from kvfunc.core._pool import FREE_CHUNK, new_ring, ring_entries
from kvfunc.core._rows import Row, SlotMap, TablesView, row_of, row_table

__all__ = [
    "NULL_BLOCK", "BlockId", "FrozenDict", "GroupState", "KVState", "RequestId",
    "check_state", "find_group", "reslot", "usage_string",
]

BlockId = int
RequestId = str | int
NULL_BLOCK: BlockId = 0

_K = TypeVar("_K")
_V = TypeVar("_V")
_EMPTY_ROWS: PVector[Row | None] = pvector()


class FrozenDict(dict[_K, _V]):
    """A ``dict`` whose mutating methods raise: reads at dict speed.

    >>> d = FrozenDict({"a": (1, 2)})
    >>> d["a"]
    (1, 2)
    >>> d["b"] = ()
    Traceback (most recent call last):
    ...
    TypeError: FrozenDict is immutable
    """

    __slots__ = ()

    def _immutable(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError("FrozenDict is immutable")

    __setitem__ = _immutable
    __delitem__ = _immutable
    __ior__ = _immutable
    clear = _immutable
    pop = _immutable
    popitem = _immutable
    setdefault = _immutable
    update = _immutable

    def __repr__(self) -> str:
        return f"FrozenDict({dict.__repr__(self)})"

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(frozenset(self.items()))


@attrs.frozen(slots=True, eq=False, repr=False)
class GroupState:
    """One manager key's pool and block tables (see the module docstring)."""

    key: str
    policy: Policy
    rows: PVector[Row | None]
    num_rows: int
    slots: SlotMap
    free_ring: PVector[tuple[BlockId, ...]]
    free_head: int
    num_free: int
    num_detached: int = 0
    cache: GroupCache | None = None

    @classmethod
    def create(cls, key: str, policy: Policy, *, caching: bool = False,
               slots: SlotMap | None = None) -> GroupState:
        """A fresh group: ids ``1 .. num_blocks - 1`` free in order, null block 0.

        With ``caching`` the group also counts references and keeps a prefix
        cache (see :class:`~kvfunc.core._cache.GroupCache`).

        >>> from kvfunc.core._policy import FullAttention
        >>> GroupState.create("full", FullAttention(num_blocks=4, block_size=16)).free_block_ids()
        (1, 2, 3)
        """
        n = policy.num_blocks
        if type(n) is not int or not 0 < n <= MAX_NUM_BLOCKS:
            msg = f"group {key!r}: num_blocks must be in 1..{MAX_NUM_BLOCKS}, got {excerpt(n)}"
            raise InvalidArgumentError(msg)
        slots = SlotMap() if slots is None else slots
        if caching:  # every block starts on the stack; the ring (twice the room) starts empty
            return cls(key, policy, _EMPTY_ROWS, 0, slots, new_ring((), 2 * (n - 1)), 0, n - 1,
                       0, GroupCache.create(n))
        return cls(key, policy, _EMPTY_ROWS, 0, slots, new_ring(range(1, n), n - 1), 0, n - 1)

    def row(self, request_id: RequestId) -> Row | None:
        """The request's row, or None when it is not registered here."""
        return row_of(self.rows, self.slots, request_id)

    def table(self, request_id: RequestId) -> tuple[BlockId, ...]:
        """The request's block ids in logical order (null entries are 0; ``()`` when unknown)."""
        row = self.row(request_id)
        return () if row is None else row_table(row)

    @property
    def tables(self) -> Mapping[RequestId, tuple[BlockId, ...]]:
        """Every registered request's table, as a read-only mapping built on access."""
        return TablesView(self.rows, self.slots)

    def free_block_ids(self) -> tuple[BlockId, ...]:
        """Free block ids in hand-out order (head first)."""
        cache = self.cache
        if cache is None:
            return tuple(ring_entries(self.free_ring, self.free_head, self.num_free))
        ring, head = self.free_ring, self.free_head
        live = live_ring_ids(lambda c: ring[c], FREE_CHUNK, head, len(ring) * FREE_CHUNK,
                             cache.ring_entries, cache.stale)
        return (*cache.stack_ids(), *live)

    def num_held(self) -> int:
        """Distinct non-null blocks held by tables."""
        return len({b for t in self.tables.values() for b in t if b})

    def _identity(self) -> tuple[Any, ...]:
        cache = None if self.cache is None else self.cache.identity()
        return (self.key, self.policy, dict(self.tables), self.free_block_ids(),
                self.num_detached, cache)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, GroupState):
            return NotImplemented
        return self is other or self._identity() == other._identity()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (f"GroupState(key={self.key!r}, policy={self.policy!r}, "
                f"tables={dict(self.tables)!r}, free={self.num_free}, "
                f"detached={self.num_detached})")


def reslot(groups: Iterable[GroupState]) -> tuple[GroupState, ...]:
    """The same groups on one fresh :class:`SlotMap` holding only their live requests."""
    groups = tuple(groups)
    slots = SlotMap()
    rebuilt = []
    for g in groups:
        rows: list[Row | None] = []
        for rid in g.tables:
            slot = slots.slot_of(rid)
            rows.extend([None] * (slot + 1 - len(rows)))
            rows[slot] = g.row(rid)
        rebuilt.append(attrs.evolve(g, rows=pvector(rows), slots=slots))
    return tuple(rebuilt)


@attrs.frozen(slots=True, repr=False)
class KVState:
    """The whole allocator state: one :class:`GroupState` per manager key.

    States are values: equal when their groups are equal, never mutated.
    Keeping an old state costs only what later states changed.

    >>> from kvfunc.core._policy import FullAttention, SlidingWindow
    >>> s = KVState.create({"full": FullAttention(num_blocks=20, block_size=16),
    ...                     "swa": SlidingWindow(num_blocks=10, block_size=16,
    ...                                          sliding_window=64)},
    ...                    max_model_len=4096)
    >>> s.manager_keys
    ('full', 'swa')
    """

    max_model_len: int
    groups: tuple[GroupState, ...]
    #: the fold's lane over this state's rows, cached by the first step run on it (the
    #: state is immutable, so it stays true); a slot, not a dict: states are kept by the
    #: thousand
    _lane: Any = attrs.field(init=False, default=None, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        groups = self.groups
        if groups and any(g.slots is not groups[0].slots for g in groups):
            object.__setattr__(self, "groups", reslot(groups))  # built from several lineages

    @classmethod
    def create(cls, groups: Mapping[str, Policy], max_model_len: int, *,
               enable_prefix_caching: bool = False) -> KVState:
        """A fresh state from ``{manager_key: policy}`` in manager order.

        ``enable_prefix_caching`` turns on reference counts, the prefix cache
        and forks in every group (see :func:`~kvfunc.lookup_prefix`); without
        it the state hands out exactly the seed's block ids.

        >>> from kvfunc.core._policy import FullAttention
        >>> KVState.create({"full": FullAttention(num_blocks=3, block_size=4)}, 64)
        KVState(max_model_len=64, groups=('full',), usage='full:1/3')
        """
        if type(max_model_len) is not int or max_model_len < 0:
            msg = f"max_model_len must be a non-negative int, but got {excerpt(max_model_len)}"
            raise InvalidArgumentError(msg)
        if type(enable_prefix_caching) is not bool:
            msg = f"enable_prefix_caching must be a bool, but got {excerpt(enable_prefix_caching)}"
            raise InvalidArgumentError(msg)
        items = policies_by_key(groups)
        if enable_prefix_caching:
            for k, p in items:
                if p.window is not None and p.window < 1:
                    msg = (f"group {k!r}: prefix caching needs a window of at least one token, "
                           f"got {p.window}")
                    raise InvalidArgumentError(msg)
        slots = SlotMap()
        return cls(max_model_len, tuple(
            GroupState.create(k, p, caching=enable_prefix_caching, slots=slots)
            for k, p in items))

    @property
    def prefix_caching(self) -> bool:
        """True when the state was created with ``enable_prefix_caching``."""
        groups = self.groups
        return bool(groups) and groups[0].cache is not None  # all groups cache, or none

    @classmethod
    def from_cache_info(cls, info: Any, block_num_by_type: Mapping[str, int], max_model_len: int,
                        *, enable_prefix_caching: bool = False) -> KVState:
        """A fresh state whose groups follow a ``ModelCacheInfo`` (seed §3.5).

        Entries with ``needs_block`` are grouped by ``group_key`` in order of
        first appearance; each group must share one attention type and one
        block size, and its policy takes the type's parameters.

        >>> from kvfunc.core._cache_info import CacheEntry, LayerCacheInfo, ModelCacheInfo
        >>> e = CacheEntry("k", "FullAttention", 128, 8, "bfloat16", True, block_size=16)
        >>> info = ModelCacheInfo(1, [LayerCacheInfo(0, [e])])
        >>> KVState.from_cache_info(info, {"FullAttention": 100}, 8192).manager_keys
        ('FullAttention',)
        """
        return cls.create(dict(_policies_from_cache_info(info, block_num_by_type)), max_model_len,
                          enable_prefix_caching=enable_prefix_caching)

    @property
    def manager_keys(self) -> tuple[str, ...]:
        """Manager keys in manager order."""
        return tuple(g.key for g in self.groups)

    def group(self, key: str) -> GroupState:
        """The group of ``key``; unknown keys raise :class:`~kvfunc.UnknownRequestError`."""
        return find_group(self.groups, key)

    def request_ids(self) -> tuple[RequestId, ...]:
        """Every request registered in any group, in slot order (first registration first)."""
        seen: dict[RequestId, None] = {}
        for g in self.groups:
            seen.update(dict.fromkeys(g.tables))
        return tuple(sorted(seen, key=self.groups[0].slots.slots.__getitem__)) if seen else ()

    def __repr__(self) -> str:
        usage = usage_string((g.key, g.policy.num_blocks, g.num_free) for g in self.groups)
        return (f"KVState(max_model_len={self.max_model_len}, "
                f"groups={self.manager_keys!r}, usage={usage!r})")


def check_state(value: object, what: str = "state") -> KVState:
    """``value`` if it is a :class:`KVState`, else a typed error naming what came instead.

    >>> check_state(None)
    Traceback (most recent call last):
    ...
    kvfunc.core._errors.InvalidTypeError: state must be a KVState, but got NoneType
    """
    if type(value) is not KVState:
        hint = " (pass its .state)" if hasattr(value, "state") and hasattr(value, "delta") else ""
        msg = f"{what} must be a KVState, but got {type(value).__name__}{hint}"
        raise InvalidTypeError(msg)
    return value


_G = TypeVar("_G")


def usage_string(groups: Iterable[tuple[str, int, int]]) -> str:
    """``"key:used/num_blocks,..."`` from ``(key, num_blocks, num_free)``; ``"0/0"`` for none."""
    text = ",".join(f"{key}:{total - free}/{total}" for key, total, free in groups)
    return text or "0/0"


def find_group(groups: Iterable[_G], key: str) -> _G:
    """The group whose ``key`` is ``key`` (states and working copies alike)."""
    groups = tuple(groups)
    for g in groups:
        if g.key == key:  # type: ignore[attr-defined]
            return g
    known = [g.key for g in groups]  # type: ignore[attr-defined]
    msg = f"unknown manager_key {excerpt(key)}; known keys: {known}"
    raise UnknownRequestError(msg)


def group_cache_entries(
    info: Any, block_num_by_type: Mapping[str, int], resolve: Callable[[str], Any]
) -> Iterator[tuple[str, Any, int, list[Any]]]:
    """Group paged cache entries by ``group_key`` as the seed does (spec §3.5).

    Yields ``(key, resolve(attn_type), block_size, entries)`` per group in order
    of first appearance, after the seed's checks in the seed's order (unknown
    key, one attention type, known type via ``resolve``, one block size).
    """
    groups: dict[str, list[Any]] = {}
    for layer in info.layer_infos:
        for cache in layer.caches:
            if not cache.needs_block:
                continue
            key = cache.group_key
            if key not in block_num_by_type:
                msg = (
                    f"Unknown manager_key '{key}' found in layer {layer.layer_idx}, cache "
                    f"{cache.cache_name}, attn_type={cache.attn_type}. Supported cache types "
                    f"are: {list(block_num_by_type.keys())}"
                )
                raise InvalidArgumentError(msg)
            groups.setdefault(key, []).append(cache)
    for key, entries in groups.items():
        attn_types = {e.attn_type for e in entries}
        if len(attn_types) != 1:
            msg = (f"Caches grouped into group_key={key} must share one attn_type, "
                   f"but got {sorted(attn_types)}.")
            raise InvalidArgumentError(msg)
        (attn_type,) = attn_types
        cls = resolve(attn_type)
        block_sizes = {e.block_size for e in entries}
        if len(block_sizes) != 1:
            msg = (
                f"Caches grouped into one SingleTypeKVCacheManager must share the same "
                f"block_size. group_key={key}, attn_type={attn_type}, "
                f"block_sizes={sorted(block_sizes)}."
            )
            raise InvalidArgumentError(msg)
        (block_size,) = block_sizes
        yield key, cls, block_size, entries


def _policies_from_cache_info(info: Any, block_num_by_type: Mapping[str, int]
                              ) -> Iterator[tuple[str, Policy]]:
    for key, cls, block_size, entries in group_cache_entries(info, block_num_by_type,
                                                              policy_class):
        policy: Policy = cls(num_blocks=block_num_by_type[key], block_size=block_size,
                             **cls.kwargs_from_entries(entries))
        yield key, policy
