"""The allocator's state: pools and groups as immutable values, and their working copy.

Theory of operation
-------------------
A :class:`KVState` is ``max_model_len``, a tuple of block pools
(:class:`~kvfunc.core._pool.PoolState`) and a tuple of groups
(:class:`~kvfunc.core._group.GroupState`, one per manager key in manager
order), each drawing its blocks from one pool.  Two layouts, chosen when the
state is made (``layout=``):

* ``"per-type"`` -- a pool per group (the seed's layout): each group's
  ``num_blocks`` sizes its own pool and its ids are its own;
* ``"shared"`` -- one pool for every group (vLLM's hybrid layout): ids are
  unique across groups, one free count and one eviction order cover them
  all, and a step's room check sums every group's need first.

A mapping ``{pool name: [manager keys]}`` names any other grouping.  Every
group of a pool states the pool's size as its policy's ``num_blocks``.

A :class:`~kvfunc.core._transient.Transient` is the working copy of a state
that one transition edits (``_transient``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, NoReturn, TypeVar

import attrs

from kvfunc.core._checks import MAX_NUM_BLOCKS, excerpt
from kvfunc.core._errors import InvalidArgumentError, InvalidTypeError, UnknownRequestError
from kvfunc.core._group import GroupState
from kvfunc.core._policies import policies_by_key, policy_class
from kvfunc.core._policy import Policy, check_hints
from kvfunc.core._pool import EMPTY_MAP, PoolState

__all__ = [
    "LAYOUTS", "NULL_BLOCK", "BlockId", "FrozenDict", "KVState", "RequestId",
    "check_state", "find_group", "usage_string",
]

BlockId = int
RequestId = str | int
NULL_BLOCK: BlockId = 0
LAYOUTS = ("per-type", "shared")
FREE_ORDERS = ("seed", "vllm")

_K = TypeVar("_K")
_V = TypeVar("_V")
_set = object.__setattr__


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


@attrs.frozen(slots=True, repr=False, eq=False)
class KVState:
    """The whole allocator state: block pools and the groups that draw from them.

    States are values: equal when their pools and groups are equal, never
    mutated.  Keeping an old state costs only what later states changed.

    >>> from kvfunc.core._policies import FullAttention, SlidingWindow
    >>> s = KVState.create({"full": FullAttention(num_blocks=20, block_size=16),
    ...                     "swa": SlidingWindow(num_blocks=10, block_size=16,
    ...                                          sliding_window=64)},
    ...                    max_model_len=4096)
    >>> s.manager_keys, s.layout
    (('full', 'swa'), 'per-type')
    """

    max_model_len: int
    pools: tuple[PoolState, ...]
    groups: tuple[GroupState, ...]
    #: registrations so far: a new row's ``seq`` (listing order), not part of equality
    seq: int = 0
    #: ``(pool index per group, caching, hash block sizes known to fit every group)``: what
    #: a working copy reads, derived once per lineage (its states share pools' and groups'
    #: sizes); the set only ever learns a fact about those sizes
    _shape: Any = attrs.field(init=False, default=None, eq=False, repr=False)
    #: the working copy the transition that made this state left behind, while this state
    #: is the newest of its lineage: the next transition on it goes on with it (a one-item
    #: list: ``pop`` takes it atomically, so two transitions never share it)
    _cont: Any = attrs.field(init=False, default=None, eq=False, repr=False)

    @classmethod
    def create(cls, groups: Mapping[str, Policy], max_model_len: int, *,
               enable_prefix_caching: bool = False,
               layout: str | Mapping[str, Iterable[str]] = "per-type",
               free_order: str = "seed") -> KVState:
        """A fresh state from ``{manager_key: policy}`` in manager order.

        ``enable_prefix_caching`` turns on reference counts, the prefix cache
        and forks (see :func:`~kvfunc.lookup_prefix`); without it the state
        hands out exactly the seed's block ids.  ``layout`` is ``"per-type"``
        (a pool per group), ``"shared"`` (one pool; every policy states its
        ``num_blocks``) or ``{pool name: [manager keys]}``.  ``free_order``
        is ``"seed"`` (FIFO reuse) or ``"vllm"`` (vLLM's free queue: reuse
        last in, first out); prefix caching always keeps vLLM's order.

        >>> from kvfunc.core._policies import FullAttention, SlidingWindow
        >>> KVState.create({"full": FullAttention(num_blocks=3, block_size=4)}, 64)
        KVState(max_model_len=64, groups=('full',), usage='full:1/3')
        >>> s = KVState.create({"full": FullAttention(num_blocks=8, block_size=4),
        ...                     "swa": SlidingWindow(num_blocks=8, block_size=4,
        ...                                          sliding_window=8)}, 64, layout="shared")
        >>> [(p.name, p.members) for p in s.pools]
        [('shared', ('full', 'swa'))]
        """
        if type(max_model_len) is not int or max_model_len < 0:
            msg = f"max_model_len must be a non-negative int, but got {excerpt(max_model_len)}"
            raise InvalidArgumentError(msg)
        for name, value in (("enable_prefix_caching", enable_prefix_caching),):
            if type(value) is not bool:
                raise InvalidArgumentError(f"{name} must be a bool, but got {excerpt(value)}")
        if free_order not in FREE_ORDERS:
            msg = f"free_order must be one of {list(FREE_ORDERS)}, but got {excerpt(free_order)}"
            raise InvalidArgumentError(msg)
        items = policies_by_key(groups)
        for key, policy in items:
            check_hints(key, policy)
            if enable_prefix_caching and policy.window is not None and policy.window < 1:
                msg = (f"group {key!r}: prefix caching needs a window of at least one token, "
                       f"got {policy.window}")
                raise InvalidArgumentError(msg)
        plan = pool_plan(items, layout)
        linked = enable_prefix_caching or free_order == "vllm"
        pools = tuple(PoolState.create(name, members, size, linked=linked,
                                       caching=enable_prefix_caching)
                      for name, members, size in plan)
        where = {k: j for j, (_, members, _) in enumerate(plan) for k in members}
        return cls(max_model_len, pools,
                   tuple(GroupState.of(k, p, where[k], EMPTY_MAP) for k, p in items))

    @classmethod
    def from_cache_info(cls, info: Any, block_num_by_type: Mapping[str, int], max_model_len: int,
                        *, enable_prefix_caching: bool = False,
                        layout: str | Mapping[str, Iterable[str]] = "per-type") -> KVState:
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
        if not hasattr(info, "layer_infos"):
            msg = f"info must be a ModelCacheInfo, but got {type(info).__name__}"
            raise InvalidTypeError(msg)
        if not isinstance(block_num_by_type, Mapping):
            msg = (f"block_num_by_type must be a mapping of manager keys to block counts, "
                   f"but got {type(block_num_by_type).__name__}")
            raise InvalidTypeError(msg)
        return cls.create(dict(_policies_from_cache_info(info, block_num_by_type)), max_model_len,
                          enable_prefix_caching=enable_prefix_caching, layout=layout)

    @property
    def prefix_caching(self) -> bool:
        """True when the state was created with ``enable_prefix_caching``."""
        return bool(self.pools) and self.pools[0].caching  # all pools, or none

    @property
    def layout(self) -> str:
        """``"per-type"``, ``"shared"``, or ``"custom"`` for another grouping.

        A state of one group is both layouts at once and reads ``"per-type"``
        whichever it was made with.
        """
        if all(len(p.members) == 1 for p in self.pools):
            return "per-type"
        return "shared" if len(self.pools) == 1 else "custom"

    @property
    def manager_keys(self) -> tuple[str, ...]:
        """Manager keys in manager order."""
        return tuple(g.key for g in self.groups)

    def group(self, key: str) -> GroupState:
        """The group of ``key``; unknown keys raise :class:`~kvfunc.UnknownRequestError`."""
        return find_group(self.groups, key)

    def pool_of(self, key: str) -> PoolState:
        """The pool the group of ``key`` draws from."""
        return self.pools[find_group(self.groups, key).pool]

    def request_ids(self) -> tuple[RequestId, ...]:
        """Every request registered in any group, in registration order."""
        seen: dict[RequestId, int] = {}
        for g in self.groups:
            for rid, row in g.rows.items():
                if rid not in seen or row.seq < seen[rid]:
                    seen[rid] = row.seq
        return tuple(sorted(seen, key=seen.__getitem__))

    def __reduce__(self) -> tuple[Any, ...]:
        # the value's fields only: the derived shape and the working copy are not copied
        return (KVState, (self.max_model_len, self.pools, self.groups, self.seq))

    def identity(self) -> tuple[Any, ...]:
        """What equality compares."""
        return (self.max_model_len, tuple(p.identity() for p in self.pools),
                tuple(g.identity() for g in self.groups))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, KVState):
            return NotImplemented
        return self is other or self.identity() == other.identity()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        usage = usage_string((g.key, self.pools[g.pool].num_blocks, self.pools[g.pool].num_free)
                             for g in self.groups)
        return (f"KVState(max_model_len={self.max_model_len}, "
                f"groups={self.manager_keys!r}, usage={usage!r})")


def pool_plan(items: tuple[tuple[str, Any], ...], layout: object
              ) -> list[tuple[str, tuple[str, ...], int]]:
    """``(pool name, member keys, num_blocks)`` per pool of a layout, checked."""
    keys = [k for k, _ in items]
    if layout == "per-type":
        groups: list[tuple[str, tuple[str, ...]]] = [(k, (k,)) for k in keys]
    elif layout == "shared":
        groups = [("shared", tuple(keys))] if keys else []
    elif isinstance(layout, Mapping):
        groups = _named_pools(layout, keys)
    else:
        msg = (f"layout must be one of {list(LAYOUTS)} or a mapping of pool names to manager "
               f"keys, but got {excerpt(layout)}")
        raise InvalidArgumentError(msg)
    sizes = dict(items)
    plan = []
    for name, members in groups:
        counts = {sizes[k].num_blocks for k in members}
        if len(counts) != 1:
            msg = (f"the groups of pool {name!r} must state one num_blocks (the pool's), "
                   f"got {sorted(counts)}")
            raise InvalidArgumentError(msg)
        if len(members) > 255:
            raise InvalidArgumentError(f"pool {name!r} has more than 255 groups")
        plan.append((name, members, counts.pop()))
    return plan


def _named_pools(layout: Mapping[Any, Any], keys: list[str]) -> list[tuple[str, tuple[str, ...]]]:
    out: list[tuple[str, tuple[str, ...]]] = []
    seen: list[str] = []
    for name, members in layout.items():
        if type(name) is not str or not name or isinstance(members, str | bytes) or not (
                isinstance(members, Iterable)):
            raise InvalidArgumentError(f"layout: pool {excerpt(name)} must name its manager keys")
        members = tuple(members)
        if not members or any(m not in keys for m in members):
            raise InvalidArgumentError(f"layout: pool {name!r} names unknown or no manager keys "
                                       f"{excerpt(members)}; known keys: {keys}")
        seen.extend(members)
        out.append((name, tuple(k for k in keys if k in members)))
    if sorted(seen) != sorted(keys):
        msg = f"layout must place every manager key in exactly one pool, got {excerpt(layout)}"
        raise InvalidArgumentError(msg)
    return out


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
        n = block_num_by_type[key]
        if type(n) is not int or not 0 < n <= MAX_NUM_BLOCKS:
            msg = f"block_num_by_type[{key!r}] must be an int in 1..{MAX_NUM_BLOCKS}, got {n!r}"
            raise InvalidArgumentError(msg)
        policy: Policy = cls(num_blocks=n, block_size=block_size,
                             **cls.kwargs_from_entries(entries))
        yield key, policy
