"""KV events: what a transition did to the prefix cache, as vLLM-style event records.

Theory of operation
-------------------
A caching transition's delta lists the blocks it cached (``stored_*``), the
cached blocks it forgot because the pool handed them out again
(``evicted_*``) and the groups whose cache was reset (``cleared_keys``).
:func:`events_from_delta` turns those columns into the events a KV-aware
router subscribes to, with vLLM's field names::

    cleared_keys            -> AllBlocksCleared(groups)
    evicted rows of a group -> BlockRemoved(block_hashes, medium, group, block_ids)
    stored rows of a group  -> BlockStored(block_hashes, parent_block_hash, token_ids,
                                           block_size, lora_id, medium, group, block_ids)

Order matters: inside one transition a block can be evicted and cached again
under another hash (or a saved state cached and evicted again), so the events
follow the delta's operations in order (:meth:`~kvfunc.BlocksChanged.operations`).
Consecutive removals of one group become one ``BlockRemoved``, and consecutive
stored rows of one group that chain (each row's parent is the previous row's
hash) one ``BlockStored``, as vLLM emits a request's new blocks.

``group`` (the manager key) and ``block_ids`` extend vLLM's records: kvfunc
has several groups, and the block ids let a subscriber rebuild exactly the
``{hash: block ids}`` index of every group (:class:`CachedBlocksView`).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any, TypeAlias

import attrs

from kvfunc.core import (
    BlocksChanged,
    Cleared,
    Evicted,
    InvalidArgumentError,
    InvalidTypeError,
    KVState,
    MissingKeyError,
    Stored,
)
from kvfunc.core._internal import excerpt

__all__ = ["MEDIUM_GPU", "AllBlocksCleared", "BlockRemoved", "BlockStored", "KVCacheEvent",
           "KVEventBatch", "events_from_delta"]

MEDIUM_GPU = "GPU"
"""The ``medium`` of events about device blocks (vLLM's value)."""

# -- field checks: an event holds only what the codec writes and reads back ----------------
# Each record checks its fields when it is made, so that nothing downstream (the encoder,
# a CachedBlocksView, a subscriber) meets a field of a wrong type: what kvfunc's decoder
# refuses cannot be built, and an event that is built encodes and decodes to itself.

_INT64 = (-(1 << 63), (1 << 64) - 1)  # what msgpack can carry: int64 and uint64


def _tuple(value: Any) -> Any:
    """A list (msgspec's and vLLM's field type) as a tuple; anything else as it is."""
    return tuple(value) if type(value) is list else value


def _fail(owner: str, name: str, what: str, value: object) -> InvalidTypeError:
    return InvalidTypeError(f"{owner}.{name} must be {what}, got {excerpt(value)}")


def _hashes(inst: Any, attribute: Any, value: Any) -> None:
    owner = type(inst).__name__
    if type(value) is not tuple or not all(type(h) is bytes for h in value):
        raise _fail(owner, attribute.name, "a tuple of bytes", value)


def _ints(inst: Any, attribute: Any, value: Any) -> None:
    owner = type(inst).__name__
    low, high = _INT64
    if type(value) is not tuple or not all(type(t) is int and low <= t <= high for t in value):
        raise _fail(owner, attribute.name, "a tuple of ints", value)


def _block_ids(inst: Any, attribute: Any, value: Any) -> None:
    if value is None:
        return
    owner = type(inst).__name__
    if type(value) is not tuple or not all(type(b) is int and 0 <= b <= _INT64[1]
                                           for b in value):
        raise _fail(owner, attribute.name, "None or a tuple of non-negative ints", value)
    if len(value) != len(inst.block_hashes):
        msg = (f"{owner} has {len(value)} block ids for {len(inst.block_hashes)} hashes")
        raise InvalidArgumentError(msg)


def _optional(kind: type) -> Any:
    def check(inst: Any, attribute: Any, value: Any) -> None:
        if value is not None and type(value) is not kind:
            raise _fail(type(inst).__name__, attribute.name, f"None or a {kind.__name__}", value)
    return check


def _str(inst: Any, attribute: Any, value: Any) -> None:
    if type(value) is not str:
        raise _fail(type(inst).__name__, attribute.name, "a str", value)


def _lora_id(inst: Any, attribute: Any, value: Any) -> None:
    if value is not None and (type(value) is not int or not _INT64[0] <= value <= _INT64[1]):
        raise _fail(type(inst).__name__, attribute.name, "None or an int", value)


def _positive(inst: Any, attribute: Any, value: Any) -> None:
    if type(value) is not int or not 1 <= value <= _INT64[1]:
        raise _fail(type(inst).__name__, attribute.name, "a positive int", value)


def _groups(inst: Any, attribute: Any, value: Any) -> None:
    if type(value) is not tuple or not all(type(g) is str for g in value):
        raise _fail(type(inst).__name__, attribute.name, "a tuple of str", value)


@attrs.frozen(slots=True)
class BlockStored:
    """Blocks that were cached: a chain of full blocks of one group.

    Attributes:
        block_hashes: the blocks' hashes, in chain order.
        parent_block_hash: the hash the first block chains from (``None``
            for a prompt's first block).
        token_ids: the blocks' token ids, concatenated (``block_size`` per
            block); empty for saved states (Mamba), which hold no tokens, and
            for blocks cached with hashes that keep no tokens.
        block_size: tokens per block of the group.
        lora_id: vLLM's LoRA id; kvfunc folds adapters into the hashes
            (``extra_keys``) and leaves it ``None``.
        medium: where the blocks live (:data:`MEDIUM_GPU`), or ``None``.
        group: the manager key of the group (a kvfunc extension).
        block_ids: the block ids, one per hash (a kvfunc extension), or
            ``None`` in events that do not carry them.

    >>> e = BlockStored((b"h0", b"h1"), None, (1, 2, 3, 4), 2, group="full", block_ids=(1, 2))
    >>> len(e.block_hashes), e.medium
    (2, None)
    """

    block_hashes: tuple[bytes, ...] = attrs.field(converter=_tuple, validator=_hashes)
    parent_block_hash: bytes | None = attrs.field(validator=_optional(bytes))
    token_ids: tuple[int, ...] = attrs.field(converter=_tuple, validator=_ints)
    block_size: int = attrs.field(validator=_positive)
    lora_id: int | None = attrs.field(default=None, validator=_lora_id)
    medium: str | None = attrs.field(default=None, validator=_optional(str))
    group: str = attrs.field(default="", validator=_str)
    block_ids: tuple[int, ...] | None = attrs.field(default=None, converter=_tuple,
                                                    validator=_block_ids)


@attrs.frozen(slots=True)
class BlockRemoved:
    """Cached blocks of one group that were forgotten (evicted).

    Attributes:
        block_hashes: the hashes the blocks were cached under.
        medium: where the blocks live (:data:`MEDIUM_GPU`), or ``None``.
        group: the manager key of the group (a kvfunc extension).
        block_ids: the block ids, one per hash (a kvfunc extension), or
            ``None`` in events that do not carry them.

    >>> BlockRemoved((b"h1",), "GPU", "full", (2,)).block_ids
    (2,)
    """

    block_hashes: tuple[bytes, ...] = attrs.field(converter=_tuple, validator=_hashes)
    medium: str | None = attrs.field(default=None, validator=_optional(str))
    group: str = attrs.field(default="", validator=_str)
    block_ids: tuple[int, ...] | None = attrs.field(default=None, converter=_tuple,
                                                    validator=_block_ids)


@attrs.frozen(slots=True)
class AllBlocksCleared:
    """Every cached block was forgotten (:func:`kvfunc.reset_prefix_cache`).

    Attributes:
        groups: the groups whose cache was reset (a kvfunc extension); empty
            means every group, as in vLLM's event, which has no fields.

    >>> AllBlocksCleared().groups, AllBlocksCleared(("full",)).groups
    ((), ('full',))
    """

    groups: tuple[str, ...] = attrs.field(default=(), converter=_tuple, validator=_groups)


KVCacheEvent: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared
"""Any KV event: ``BlockStored | BlockRemoved | AllBlocksCleared``."""

_EVENT_TYPES = frozenset({BlockStored, BlockRemoved, AllBlocksCleared})


def _as_float(value: Any) -> Any:
    """An int time in a float's range as the float the wire carries (so a batch round-trips)."""
    if type(value) is int and -_FLOAT_MAX <= value <= _FLOAT_MAX:
        return float(value)
    return value


def _ts(inst: Any, attribute: Any, value: Any) -> None:
    if type(value) is not float:
        raise _fail("KVEventBatch", "ts", "a float", value)


_FLOAT_MAX = int(sys.float_info.max)


def _events(inst: Any, attribute: Any, value: Any) -> None:
    if type(value) is not tuple or not all(type(e) in _EVENT_TYPES for e in value):
        raise _fail("KVEventBatch", "events", "a tuple of KV events", value)


@attrs.frozen(slots=True)
class KVEventBatch:
    """The events one publisher sends at once (usually one scheduler step's).

    Attributes:
        ts: when the batch was made, in seconds (``time.time()``).
        events: the events, in the order they happened.
        data_parallel_rank: the engine's data-parallel rank, or ``None``.

    >>> KVEventBatch(0.0, (AllBlocksCleared(),)).events
    (AllBlocksCleared(groups=()),)
    """

    ts: float = attrs.field(converter=_as_float, validator=_ts)
    events: tuple[KVCacheEvent, ...] = attrs.field(converter=_tuple, validator=_events)
    data_parallel_rank: int | None = attrs.field(default=None, validator=_lora_id)


def _block_sizes(layout: Mapping[str, int] | KVState) -> Mapping[str, int]:
    if isinstance(layout, KVState):
        return {g.key: g.policy.block_size for g in layout.groups}
    if not isinstance(layout, Mapping):
        msg = f"block_sizes must be a KVState or a mapping of block sizes, got {excerpt(layout)}"
        raise InvalidTypeError(msg)
    return layout


def _block_size(sizes: Mapping[str, int], key: str) -> int:
    try:
        size = sizes[key]
    except KeyError:
        raise MissingKeyError(f"no block size for group {excerpt(key)}") from None
    if type(size) is not int or size <= 0:
        msg = f"block size of {excerpt(key)} must be a positive int, got {excerpt(size)}"
        raise InvalidArgumentError(msg)
    return size


class _Runs:
    """Consecutive removals of one group, and chaining stores of one group, merged in order."""

    def __init__(self, sizes: Mapping[str, int], medium: str | None) -> None:
        self.sizes, self.medium = sizes, medium
        self.events: list[KVCacheEvent] = []
        self.removed: list[Evicted] = []
        self.stored: list[Stored] = []

    def flush(self) -> None:
        if self.removed:
            rows = self.removed
            self.events.append(BlockRemoved(tuple(r.block_hash for r in rows), self.medium,
                                            rows[0].key, tuple(r.block_id for r in rows)))
            self.removed = []
        if self.stored:
            stored = self.stored
            key = stored[0].key
            self.events.append(BlockStored(
                tuple(r.block_hash for r in stored), stored[0].parent_hash,
                tuple(t for r in stored for t in r.token_ids or ()), _block_size(self.sizes, key),
                None, self.medium, key, tuple(r.block_id for r in stored)))
            self.stored = []

    def remove(self, op: Evicted) -> None:
        if self.stored or (self.removed and self.removed[-1].key != op.key):
            self.flush()
        self.removed.append(op)

    def store(self, op: Stored) -> None:
        last = self.stored[-1] if self.stored else None
        if self.removed or not (last is not None and last.key == op.key
                                and op.parent_hash == last.block_hash
                                and bool(op.token_ids) == bool(last.token_ids)):
            self.flush()
        self.stored.append(op)

    def clear(self, op: Cleared) -> None:
        self.flush()
        last = self.events[-1] if self.events else None
        if isinstance(last, AllBlocksCleared):  # one reset clears every group at once
            self.events[-1] = AllBlocksCleared((*last.groups, op.key))
        else:
            self.events.append(AllBlocksCleared((op.key,)))


def events_from_delta(delta: BlocksChanged, block_sizes: Mapping[str, int] | KVState, *,
                      medium: str | None = MEDIUM_GPU) -> tuple[KVCacheEvent, ...]:
    """The KV events of one transition's delta, in the order of its operations.

    Args:
        delta: the transition's delta.
        block_sizes: ``{manager key: block size}``, or any state of the run
            (a state's groups and block sizes never change), which gives them.
        medium: the ``medium`` field of the events.

    Returns:
        The events, ``()`` for a delta that cached and forgot nothing (every
        delta of a state without prefix caching).

    Raises:
        InvalidTypeError: ``delta`` is not a :class:`~kvfunc.BlocksChanged`,
            ``block_sizes`` is neither a state nor a mapping, or ``medium``
            is neither None nor a str.
        MissingKeyError: a stored row's group has no block size.
        InvalidArgumentError: a block size is not a positive int.
        ReplayMismatchError: ``delta`` is malformed (a cell of a wrong type,
            columns that are not parallel; see :meth:`~kvfunc.BlocksChanged.operations`).

    >>> import kvfunc as kf
    >>> s = kf.KVState.create({"full": kf.FullAttention(num_blocks=8, block_size=4)}, 64,
    ...                       enable_prefix_caching=True)
    >>> r = kf.allocate_slots(s, "a", 0, 9, block_hashes=kf.BlockHashes.of(range(9), 4))
    >>> (e,) = events_from_delta(r.delta, s)
    >>> e.token_ids, e.block_size, e.group, e.block_ids, e.parent_block_hash
    ((0, 1, 2, 3, 4, 5, 6, 7), 4, 'full', (1, 2), None)
    >>> events_from_delta(kf.reset_prefix_cache(r.state)[1], {"full": 4})
    (AllBlocksCleared(groups=('full',)),)
    """
    if not isinstance(delta, BlocksChanged):
        raise InvalidTypeError(f"delta must be a BlocksChanged, got {type(delta).__name__}")
    if medium is not None and type(medium) is not str:
        raise InvalidTypeError(f"medium must be None or a str, got {excerpt(medium)}")
    sizes = _block_sizes(block_sizes)
    if not (delta.cleared_keys or delta.evicted_keys or delta.stored_keys):
        return ()
    runs = _Runs(sizes, medium)
    for op in delta.operations():
        if type(op) is Evicted:
            runs.remove(op)
        elif type(op) is Stored:
            runs.store(op)
        elif type(op) is Cleared:
            runs.clear(op)
    runs.flush()
    return tuple(runs.events)
