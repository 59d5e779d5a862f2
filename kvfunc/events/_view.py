"""The subscriber's side: the cached blocks of every group, rebuilt from events alone.

Theory of operation
-------------------
A router that routes requests to the engine holding their prefix needs each
engine's cached blocks, without access to the engine's state.  A
:class:`CachedBlocksView` is that knowledge as a value: per group, the same
``{hash: block ids}`` index as ``state.pool_of(key).cached(key)``, block ids
ascending.  :meth:`CachedBlocksView.apply` returns the
view after a batch of events::

    AllBlocksCleared(groups)   forget the groups (every group when empty)
    BlockRemoved               remove each (hash, block id) of the group
    BlockStored                add each (hash, block id) of the group

Events of another medium than the device's (``"GPU"``, or ``None``) are
passed over: they name blocks of the tiers below it
(:func:`~kvfunc.events.events_from_tier_delta`).

Applying a store of a block already there, or a removal of a block that is
not, changes nothing, so a batch delivered twice in a row (at-least-once
delivery) leaves the same blocks cached.  The index is a persistent map (pyrsistent): an
event costs O(log n) per block, and old views stay valid.

Replaying every event of a run from the start rebuilds the state's cache
exactly, which :meth:`CachedBlocksView.matches` checks against a state.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import attrs
from pyrsistent import PMap, pmap

from kvfunc.core import InvalidArgumentError, InvalidTypeError, KVState
from kvfunc.core._internal import excerpt
from kvfunc.events._events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventBatch,
)

__all__ = ["CachedBlocksView"]

_Index = PMap[bytes, tuple[int, ...]]
_EMPTY: PMap[str, _Index] = pmap()


def _ids(event: BlockStored | BlockRemoved) -> tuple[int, ...]:
    ids = event.block_ids
    if ids is None:
        msg = (f"{type(event).__name__} of group {excerpt(event.group)} carries no block ids; "
               "a CachedBlocksView needs kvfunc's events")
        raise InvalidArgumentError(msg)
    if len(ids) != len(event.block_hashes):
        msg = (f"{type(event).__name__} has {len(ids)} block ids for "
               f"{len(event.block_hashes)} hashes")
        raise InvalidArgumentError(msg)
    return ids


def _change(groups: dict[str, _Index], key: str, hashes: tuple[bytes, ...],
            ids: tuple[int, ...], *, store: bool) -> None:
    """Add (``store``) or remove each ``(hash, block id)`` in ``groups[key]``."""
    base = groups.get(key, pmap())
    index = base.evolver()
    now: dict[bytes, tuple[int, ...]] = {}  # the hashes this event changed
    for h, b in zip(hashes, ids, strict=True):
        have = now[h] if h in now else base.get(h, ())
        if store and b not in have:
            index[h] = now[h] = tuple(sorted((*have, b)))
        elif not store and b in have:
            rest = now[h] = tuple(x for x in have if x != b)
            if rest:
                index[h] = rest
            else:
                del index[h]
    new = index.persistent()
    if new:
        groups[key] = new
    else:
        groups.pop(key, None)


def _check_groups(inst: Any, attribute: Any, value: Any) -> None:
    """``{group: {hash: ids}}`` as persistent maps (the entries are the view's own making)."""
    if type(value) is not PMap or not all(type(k) is str and type(v) is PMap
                                          for k, v in value.items()):
        msg = f"groups must be a pmap of str to pmaps, got {excerpt(value)}"
        raise InvalidTypeError(msg)


def _group_name(group: object) -> str:
    if type(group) is not str:
        raise InvalidTypeError(f"group must be a str (a manager key), got {excerpt(group)}")
    return group


@attrs.frozen(slots=True)
class CachedBlocksView:
    """Per group, the cached blocks that a stream of KV events describes (a value).

    Attributes:
        groups: ``{group: {hash: block ids}}``, groups without a cached block
            left out.

    >>> import kvfunc as kf
    >>> from kvfunc.events import KVEventBatch, events_from_delta
    >>> s = kf.KVState.create({"full": kf.FullAttention(num_blocks=8, block_size=4)}, 64,
    ...                       enable_prefix_caching=True)
    >>> h = kf.BlockHashes.of(range(9), 4)
    >>> r = kf.allocate_slots(s, "a", 0, 9, block_hashes=h)
    >>> view = CachedBlocksView().apply(KVEventBatch(0.0, events_from_delta(r.delta, s)))
    >>> view.num_cached_blocks("full"), view.cached_prefix_blocks("full", h.hashes)
    (2, 2)
    >>> view.matches(r.state), view == CachedBlocksView.of_state(r.state)
    (True, True)
    """

    groups: PMap[str, _Index] = attrs.field(default=_EMPTY, validator=_check_groups)

    @classmethod
    def of_state(cls, state: KVState) -> CachedBlocksView:
        """The view of ``state``'s cache (what replaying its events from the start gives).

        >>> import kvfunc as kf
        >>> s = kf.KVState.create({"f": kf.FullAttention(num_blocks=4, block_size=4)}, 16)
        >>> CachedBlocksView.of_state(s) == CachedBlocksView()
        True
        """
        if not isinstance(state, KVState):
            raise InvalidTypeError(f"state must be a KVState, got {type(state).__name__}")
        groups = {}
        for g in state.groups:
            cached = state.pools[g.pool].cached(g.key)
            if cached:
                groups[g.key] = pmap(cached)
        return cls(pmap(groups))

    def apply(self, events: KVEventBatch | Iterable[KVCacheEvent]) -> CachedBlocksView:
        """The view after ``events`` (a batch, or events in order).

        Raises:
            InvalidTypeError: something that is not an event.
            InvalidArgumentError: a store or removal without block ids (an
                event from a publisher other than kvfunc).

        >>> from kvfunc.events import AllBlocksCleared, BlockStored
        >>> v = CachedBlocksView().apply([BlockStored((b"h",), None, (), 4, group="g",
        ...                                           block_ids=(3,))])
        >>> v.cached("g"), v.apply([AllBlocksCleared()]).cached("g")
        ({b'h': (3,)}, {})
        """
        items = events.events if isinstance(events, KVEventBatch) else events
        if not isinstance(items, Iterable) or isinstance(items, str | bytes):
            msg = f"events must be a KVEventBatch or an iterable of events, got {excerpt(items)}"
            raise InvalidTypeError(msg)
        groups = dict(self.groups)
        for e in items:
            if type(e) is BlockStored or type(e) is BlockRemoved:
                if e.medium is not None and e.medium != MEDIUM_GPU:
                    continue  # a tier below the device (host memory, a remote store)
                _change(groups, e.group, e.block_hashes, _ids(e), store=type(e) is BlockStored)
            elif type(e) is AllBlocksCleared:
                for key in e.groups or tuple(groups):
                    groups.pop(key, None)
            else:
                raise InvalidTypeError(f"not a KV event: {type(e).__name__}")
        return CachedBlocksView(pmap(groups))

    def cached(self, group: str) -> dict[bytes, tuple[int, ...]]:
        """``{hash: block ids}`` of ``group``, as ``state.pool_of(group).cached(group)``."""
        return dict(self.groups.get(_group_name(group), pmap()))

    def num_cached_blocks(self, group: str) -> int:
        """Blocks of ``group`` that hold a cached full block."""
        return sum(len(ids) for ids in self.groups.get(_group_name(group), pmap()).values())

    def cached_prefix_blocks(self, group: str, block_hashes: Sequence[bytes]) -> int:
        """How many leading blocks of ``block_hashes`` ``group`` has cached (a router's score).

        ``block_hashes`` are hashes of the group's block size (for a group
        whose blocks hold ``m`` hashed blocks, pass every ``m``-th hash).
        """
        index = self.groups.get(_group_name(group), pmap())
        if isinstance(block_hashes, str | bytes) or not isinstance(block_hashes, Iterable):
            msg = f"block_hashes must be a sequence of bytes, got {excerpt(block_hashes)}"
            raise InvalidTypeError(msg)
        n = 0
        for h in block_hashes:
            if type(h) is not bytes:
                raise InvalidTypeError(f"a block hash must be bytes, got {excerpt(h)}")
            if h not in index:
                break
            n += 1
        return n

    def matches(self, state: KVState) -> bool:
        """True when this view holds exactly ``state``'s cached blocks (hashes, ids, order)."""
        return self == CachedBlocksView.of_state(state)
