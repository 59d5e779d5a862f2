"""The allocator's state: immutable values, cheap to keep.

Theory of operation
-------------------
A :class:`KVState` is a tuple of :class:`GroupState`, one per manager key in
manager order, plus ``max_model_len``.  A group holds

* its policy (a frozen record: pool size, block size, type parameters);
* ``tables``: request id -> tuple of block ids in logical order (null entries
  are block 0), a :class:`FrozenDict` that a transition copies once;
* the free queue as a ring (``free_ring``, ``free_head``, ``num_free``):
  blocks are handed out at the head, freed ones re-enter at the tail, exactly
  the seed's FIFO.  The ring is a persistent vector of fixed-size tuples
  (``FREE_CHUNK`` ids each): popping only moves the head, and pushing a run
  of ids rewrites one or two chunks, so a transition shares every other chunk
  with the state it came from and pays one vector update per touched chunk
  rather than one per block (a pyrsistent update costs ~0.5 us);
* ``num_detached``: blocks taken straight from the pool (the seed's
  ``BlockPool.get_new_blocks``) that no request holds.

Conservation: ``num_free + held + num_detached == num_blocks - 1`` where
``held`` counts the non-null entries of all tables; the null block 0 is never
free and never held.  :func:`check_invariants` checks it and more.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, NoReturn, TypeVar

import attrs
from pyrsistent import PVector, pvector

from kvfunc.core._cache_state import GroupCache
from kvfunc.core._errors import InvalidArgumentError, UnknownRequestError
from kvfunc.core._policy import Policy, policies_by_key, policy_class

__all__ = [
    "FREE_CHUNK",
    "NULL_BLOCK",
    "BlockId",
    "FrozenDict",
    "GroupState",
    "KVState",
    "RequestId",
    "check_invariants",
]

BlockId = int
RequestId = str | int
NULL_BLOCK: BlockId = 0
FREE_CHUNK = 64

_K = TypeVar("_K")
_V = TypeVar("_V")


class FrozenDict(dict[_K, _V]):
    """A ``dict`` whose mutating methods raise: reads at dict speed.

    Transitions build a new one (one copy per transition) and never change a
    published one.

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


EMPTY_TABLES: FrozenDict[Any, tuple[int, ...]] = FrozenDict()


@attrs.frozen(slots=True, eq=False, repr=False)
class GroupState:
    """One manager key's pool and block tables (see the module docstring)."""

    key: str
    policy: Policy
    tables: FrozenDict[RequestId, tuple[BlockId, ...]]
    free_ring: PVector[tuple[BlockId, ...]]
    free_head: int
    num_free: int
    num_detached: int = 0
    cache: GroupCache | None = None

    @classmethod
    def create(cls, key: str, policy: Policy, *, caching: bool = False) -> GroupState:
        """A fresh group: ids ``1 .. num_blocks - 1`` free in order, null block 0.

        With ``caching`` the group also counts references and keeps a
        prefix cache (see :class:`GroupCache`).

        >>> from kvfunc.core._policy import FullAttention
        >>> GroupState.create("full", FullAttention(num_blocks=4, block_size=16)).free_block_ids()
        (1, 2, 3)
        """
        n = policy.num_blocks
        # A caching group's ring also holds stale entries (see GroupCache): twice the room
        # makes compacting it rare.
        chunks = max(1, -(-(n - 1) // FREE_CHUNK)) * (2 if caching else 1)
        ids = list(range(1, n)) + [NULL_BLOCK] * (chunks * FREE_CHUNK - (n - 1))
        ring = pvector(tuple(ids[i:i + FREE_CHUNK]) for i in range(0, len(ids), FREE_CHUNK))
        cache = GroupCache.create(n) if caching else None
        return cls(key, policy, EMPTY_TABLES, ring, 0, n - 1, 0, cache)

    def free_block_ids(self) -> tuple[BlockId, ...]:
        """Free block ids in hand-out order (head first)."""
        ring, head = self.free_ring, self.free_head
        cap = len(ring) * FREE_CHUNK
        cache = self.cache
        if cache is not None:
            return tuple(cache.live_entries(ring, head, cap))
        out = []
        for i in range(self.num_free):
            p = (head + i) % cap
            out.append(ring[p // FREE_CHUNK][p % FREE_CHUNK])
        return tuple(out)

    def num_held(self) -> int:
        """Non-null table entries over all requests."""
        return sum(len(t) - t.count(NULL_BLOCK) for t in self.tables.values())

    def _identity(self) -> tuple[Any, ...]:
        cache = None if self.cache is None else self.cache.identity()
        return (self.key, self.policy, dict(self.tables), self.free_block_ids(), self.num_detached,
                cache)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, GroupState):
            return NotImplemented
        return self is other or self._identity() == other._identity()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (
            f"GroupState(key={self.key!r}, policy={self.policy!r}, "
            f"tables={dict(self.tables)!r}, free={self.num_free}, "
            f"detached={self.num_detached})"
        )


@attrs.frozen(slots=True, repr=False)
class KVState:
    """The whole allocator state: one :class:`GroupState` per manager key.

    States are values: equal when their groups are equal, never mutated.
    Keeping an old state costs only what later states changed (structural
    sharing of the ring; block tuples are shared by reference).

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

    @classmethod
    def create(cls, groups: Mapping[str, Policy], max_model_len: int, *,
               enable_prefix_caching: bool = False) -> KVState:
        """A fresh state from ``{manager_key: policy}`` in manager order.

        ``enable_prefix_caching`` turns on reference counts, the prefix cache
        and forks in every group (see :mod:`kvfunc.core._prefix`); without
        it the state hands out exactly the seed's block ids.

        >>> from kvfunc.core._policy import FullAttention
        >>> KVState.create({"full": FullAttention(num_blocks=3, block_size=4)}, 64)
        KVState(max_model_len=64, groups=('full',), usage='full:1/3')
        """
        if type(max_model_len) is not int or max_model_len < 0:
            msg = f"max_model_len must be a non-negative int, but got {max_model_len!r}"
            raise InvalidArgumentError(msg)
        if type(enable_prefix_caching) is not bool:
            msg = f"enable_prefix_caching must be a bool, but got {enable_prefix_caching!r}"
            raise InvalidArgumentError(msg)
        items = policies_by_key(groups)
        if enable_prefix_caching:
            for k, p in items:
                if p.window is not None and p.window < 1:
                    msg = (f"group {k!r}: prefix caching needs a window of at least one token, "
                           f"got {p.window}")
                    raise InvalidArgumentError(msg)
        return cls(max_model_len, tuple(GroupState.create(k, p, caching=enable_prefix_caching)
                                        for k, p in items))

    @property
    def prefix_caching(self) -> bool:
        """True when the state was created with ``enable_prefix_caching``."""
        groups = self.groups
        return bool(groups) and groups[0].cache is not None  # all groups cache, or none

    @classmethod
    def from_cache_info(
        cls, info: Any, block_num_by_type: Mapping[str, int], max_model_len: int, *,
        enable_prefix_caching: bool = False,
    ) -> KVState:
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
        """The group of ``key``; unknown keys raise :class:`UnknownRequestError`."""
        return find_group(self.groups, key)

    def request_ids(self) -> tuple[RequestId, ...]:
        """Every request registered in any group, in first-registration order."""
        seen: dict[RequestId, None] = {}
        for g in self.groups:
            seen.update(dict.fromkeys(g.tables))
        return tuple(seen)

    def __repr__(self) -> str:
        usage = usage_string((g.key, g.policy.num_blocks, g.num_free) for g in self.groups)
        return (f"KVState(max_model_len={self.max_model_len}, "
                f"groups={self.manager_keys!r}, usage={usage!r})")


_G = TypeVar("_G")


def usage_string(groups: Iterable[tuple[str, int, int]]) -> str:
    """``"key:used/num_blocks,..."`` from ``(key, num_blocks, num_free)``; ``"0/0"`` for none."""
    text = ",".join(f"{key}:{total - free}/{total}" for key, total, free in groups)
    return text or "0/0"


def find_group(groups: Iterable[_G], key: str) -> _G:
    """The group whose ``key`` is ``key`` (states and transients alike)."""
    groups = tuple(groups)
    for g in groups:
        if g.key == key:  # type: ignore[attr-defined]
            return g
    known = [g.key for g in groups]  # type: ignore[attr-defined]
    msg = f"unknown manager_key {key!r}; known keys: {known}"
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


def _policies_from_cache_info(
    info: Any, block_num_by_type: Mapping[str, int]
) -> Iterator[tuple[str, Policy]]:
    for key, cls, block_size, entries in group_cache_entries(info, block_num_by_type,
                                                              policy_class):
        policy: Policy = cls(num_blocks=block_num_by_type[key], block_size=block_size,
                             **cls.kwargs_from_entries(entries))
        yield key, policy


def check_invariants(state: KVState) -> None:
    """Assert everything a reachable state satisfies (tests call it every step).

    * the null block is never free; every other id is free, held by exactly
      one table entry, or detached: ``free + held + detached == num_blocks - 1``;
    * a table never holds an id twice or out of range;
    * null entries only in tables of policies that skip tokens, as a prefix.

    >>> from kvfunc.core._policy import FullAttention
    >>> check_invariants(KVState.create({"f": FullAttention(num_blocks=5, block_size=4)}, 64))
    """
    keys = state.manager_keys
    assert len(set(keys)) == len(keys), f"duplicate manager keys {keys}"
    for g in state.groups:
        n = g.policy.num_blocks
        free = g.free_block_ids()
        assert g.num_free >= 0, f"{g.key}: negative free count {g.num_free}"
        assert len(free) == g.num_free, f"{g.key}: {len(free)} free ids, count {g.num_free}"
        assert NULL_BLOCK not in free, f"{g.key}: null block in the free queue"
        held = [b for t in g.tables.values() for b in t if b != NULL_BLOCK]
        if g.cache is not None:
            _check_cache(g, free, held)
            held = list(set(held))
        together = list(free) + held
        assert len(together) == len(set(together)), f"{g.key}: a block is free and held, or twice"
        assert all(0 < b < n for b in together), f"{g.key}: block id out of range"
        total = len(free) + len(held) + g.num_detached
        assert total == n - 1, (
            f"{g.key}: conservation broken: free {len(free)} + held {len(held)} "
            f"+ detached {g.num_detached} != {n - 1}"
        )
        if g.policy.window is not None or g.policy.may_skip:
            for rid, t in g.tables.items():
                nulls = t.count(NULL_BLOCK)
                assert t[:nulls] == (NULL_BLOCK,) * nulls, f"{g.key}: {rid!r} nulls not a prefix"
        else:
            for rid, t in g.tables.items():
                assert NULL_BLOCK not in t, f"{g.key}: {rid!r} holds the null block"


def _check_cache(g: GroupState, free: tuple[BlockId, ...], held: list[BlockId]) -> None:
    """Reference counts equal table membership; the hash index matches the blocks."""
    cache = g.cache
    assert cache is not None
    counts = [0] * g.policy.num_blocks
    for b in held:
        counts[b] += 1
    assert list(cache.refs) == counts, f"{g.key}: reference counts differ from the tables"
    hashes = {b: h for b, h in enumerate(cache.hash_of) if h is not None}
    assert cache.num_cached_blocks == len(hashes), f"{g.key}: cached block count differs"
    missing = [b for b, h in hashes.items() if b not in cache.by_hash.get(h, ())]
    assert not missing, f"{g.key}: cached blocks {missing} missing from the hash index"
