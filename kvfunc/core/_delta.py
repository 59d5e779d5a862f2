"""Deltas: what one transition did to the cache, as plain columnar data.

Theory of operation
-------------------
One :class:`BlocksChanged` record per transition.  Each kind of operation is
a *family* of parallel tuples, one row per operation, never one object per
block; ``order`` is a string with one code letter per row of every family,
in the order the transition performed them.  :meth:`BlocksChanged.operations`
walks ``order`` and yields each row as a named record, so every reader
(replay, the shell's block-table buffer and block copies, KV events) folds
over the operations in the one order that reproduces the transition::

    code  family       one row means                         record
    R     registered   the request got an empty table        Registered(key, request_id)
    L     released     the request's table was dropped       Released(key, request_id)
    N     nulled       a position slid out of the window     Nulled(key, request_id, position)
    F     freed        a block went back to the free queue   Freed(key, block_id)
    A     appended     a table entry was added: block 0 is   Appended(key, request_id, block_id)
                       a null entry, any other block came
                       from the head of the free queue
    S     shared       a table entry referencing a block     Shared(key, request_id, block_id)
                       held or cached already (a prefix hit,
                       a fork): nothing taken, never zeroed
    C     copied       the shell copies a block's contents   Copied(key, request_id, position,
                       (see below)                                  src_block_id, dst_block_id)
    T     stored       a full block was cached               Stored(key, request_id, position,
                                                                    block_id, block_hash,
                                                                    parent_hash, token_ids)
    E     evicted      a cached block was handed out again   Evicted(key, block_id, block_hash)
    Z     cleared      the group's prefix cache was reset    Cleared(key)
    H     hit          an admission asked the prefix cache   LookedUp(request_id, tokens,
                                                                      query_tokens)

A copy's ``position`` says what it is: a table position (copy-on-write: the
destination came from the free queue and replaces the source there),
:data:`COPY_INTO_NEW` (a saved state seeds the block the request was just
given) or :data:`COPY_SAVED` (the destination came from the free queue only
to hold a saved state: it is cached, then freed).  Copies run in row order:
a copy may read a block an earlier copy wrote.  An eviction comes before the
append or copy that took its block.  Only states with prefix caching produce
the S, C, T, E, Z and H families.

A delta read from outside is checked by :meth:`BlocksChanged.operations`:
parallel columns, and an ``order`` that names each row exactly once.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

import attrs

from kvfunc.core._checks import excerpt
from kvfunc.core._errors import ReplayMismatchError

__all__ = [
    "COPY_INTO_NEW", "COPY_SAVED", "DELTA_VERSION", "EMPTY_DELTA", "FAMILIES", "Appended",
    "BlocksChanged", "Cleared", "Copied", "DeltaBuilder", "Evicted", "Freed", "LookedUp",
    "Nulled", "Operation", "Registered", "Released", "Shared", "Stored",
]

DELTA_VERSION = 2
COPY_INTO_NEW = -1
COPY_SAVED = -2

_EMPTY: tuple[Any, ...] = ()


class Registered(NamedTuple):
    """The request got an empty table in the group."""

    key: str
    request_id: int | str


class Released(NamedTuple):
    """The request's table was dropped (its blocks are freed by the Freed rows after it)."""

    key: str
    request_id: int | str


class Nulled(NamedTuple):
    """A table position slid out of the window and became a null entry."""

    key: str
    request_id: int | str
    position: int


class Freed(NamedTuple):
    """A block nobody holds any more went back to the free queue."""

    key: str
    block_id: int


class Appended(NamedTuple):
    """A table entry was added: 0 is a null entry, any other block came from the free queue."""

    key: str
    request_id: int | str
    block_id: int


class Shared(NamedTuple):
    """A table entry referencing a block already held or cached (a prefix hit, a fork)."""

    key: str
    request_id: int | str
    block_id: int


class Copied(NamedTuple):
    """The shell copies ``src_block_id`` into ``dst_block_id`` (see the module docstring)."""

    key: str
    request_id: int | str
    position: int
    src_block_id: int
    dst_block_id: int


class Stored(NamedTuple):
    """A full block was cached under ``block_hash`` (``position`` -2: a saved state)."""

    key: str
    request_id: int | str
    position: int
    block_id: int
    block_hash: bytes
    parent_hash: bytes | None
    token_ids: tuple[int, ...]


class Evicted(NamedTuple):
    """A cached free block was handed out again: its hash is forgotten."""

    key: str
    block_id: int
    block_hash: bytes


class Cleared(NamedTuple):
    """The group's whole prefix cache was reset."""

    key: str


class LookedUp(NamedTuple):
    """An admission asked the prefix cache: tokens hit and tokens looked up."""

    request_id: int | str
    tokens: int
    query_tokens: int


Operation = (Registered | Released | Nulled | Freed | Appended | Shared | Copied | Stored
             | Evicted | Cleared | LookedUp)

#: ``(code, family prefix, record type)`` in field order; the columns of a family are
#: ``f"{prefix}_{name}"`` for the record's fields, pluralised.
FAMILIES: tuple[tuple[str, str, type[Any]], ...] = (
    ("R", "registered", Registered), ("L", "released", Released), ("N", "nulled", Nulled),
    ("F", "freed", Freed), ("A", "appended", Appended), ("S", "shared", Shared),
    ("C", "copied", Copied), ("T", "stored", Stored), ("E", "evicted", Evicted),
    ("Z", "cleared", Cleared), ("H", "hit", LookedUp),
)

_PLURAL = {"key": "keys", "request_id": "request_ids", "position": "positions",
           "block_id": "block_ids", "src_block_id": "src_block_ids",
           "dst_block_id": "dst_block_ids", "block_hash": "hashes", "parent_hash": "parent_hashes",
           "token_ids": "token_ids", "tokens": "tokens", "query_tokens": "query_tokens"}


def _columns(prefix: str, record: type[Any]) -> tuple[str, ...]:
    return tuple(f"{prefix}_{_PLURAL[f]}" for f in record._fields)


COLUMNS: dict[str, tuple[str, ...]] = {c: _columns(prefix, rec) for c, prefix, rec in FAMILIES}
_RECORDS = {code: rec for code, _, rec in FAMILIES}


def _field(**kw: Any) -> Any:
    return attrs.field(default=_EMPTY, **kw)


def _codes(value: Any) -> Any:
    """``order`` as a str; a sequence of one-letter codes (a JSON round trip) is joined."""
    if type(value) is str or not isinstance(value, list | tuple):
        return value
    return "".join(value) if all(type(c) is str for c in value) else value


@attrs.frozen(slots=True)
class BlocksChanged:
    """The delta of one transition (see the module docstring for the families).

    Its ``repr`` is valid Python that rebuilds an equal record:

    >>> d = BlocksChanged(order="RA", registered_keys=("full",), registered_request_ids=("r1",),
    ...                   appended_keys=("full",), appended_request_ids=("r1",),
    ...                   appended_block_ids=(1,))
    >>> eval(repr(d)) == d, d.is_empty, BlocksChanged().is_empty
    (True, False, True)
    >>> list(d.operations())
    [Registered(key='full', request_id='r1'), Appended(key='full', request_id='r1', block_id=1)]
    """

    version: int = DELTA_VERSION
    order: str = attrs.field(default="", converter=_codes)
    registered_keys: tuple[str, ...] = _field()
    registered_request_ids: tuple[int | str, ...] = _field()
    released_keys: tuple[str, ...] = _field()
    released_request_ids: tuple[int | str, ...] = _field()
    nulled_keys: tuple[str, ...] = _field()
    nulled_request_ids: tuple[int | str, ...] = _field()
    nulled_positions: tuple[int, ...] = _field()
    freed_keys: tuple[str, ...] = _field()
    freed_block_ids: tuple[int, ...] = _field()
    appended_keys: tuple[str, ...] = _field()
    appended_request_ids: tuple[int | str, ...] = _field()
    appended_block_ids: tuple[int, ...] = _field()
    shared_keys: tuple[str, ...] = _field()
    shared_request_ids: tuple[int | str, ...] = _field()
    shared_block_ids: tuple[int, ...] = _field()
    copied_keys: tuple[str, ...] = _field()
    copied_request_ids: tuple[int | str, ...] = _field()
    copied_positions: tuple[int, ...] = _field()
    copied_src_block_ids: tuple[int, ...] = _field()
    copied_dst_block_ids: tuple[int, ...] = _field()
    stored_keys: tuple[str, ...] = _field()
    stored_request_ids: tuple[int | str, ...] = _field()
    stored_positions: tuple[int, ...] = _field()
    stored_block_ids: tuple[int, ...] = _field()
    stored_hashes: tuple[bytes, ...] = _field()
    stored_parent_hashes: tuple[bytes | None, ...] = _field()
    stored_token_ids: tuple[tuple[int, ...], ...] = _field()
    evicted_keys: tuple[str, ...] = _field()
    evicted_block_ids: tuple[int, ...] = _field()
    evicted_hashes: tuple[bytes, ...] = _field()
    cleared_keys: tuple[str, ...] = _field()
    hit_request_ids: tuple[int | str, ...] = _field()
    hit_tokens: tuple[int, ...] = _field()
    hit_query_tokens: tuple[int, ...] = _field()

    @property
    def is_empty(self) -> bool:
        """True when the transition changed nothing."""
        return not self.order

    def operations(self) -> Iterator[Operation]:
        """Every operation as a named record, in the order the transition performed them.

        Raises:
            ReplayMismatchError: the delta is malformed (a wrong version, columns
                of different lengths, an ``order`` that does not name every row
                exactly once).
        """
        rows = family_rows(self)
        cursor = dict.fromkeys(rows, 0)
        new = tuple.__new__
        for code in self.order:
            i = cursor[code]
            cursor[code] = i + 1
            yield new(_RECORDS[code], rows[code][i])

    def new_block_ids(self, key: str) -> tuple[int, ...]:
        """Blocks taken from ``key``'s free queue for table entries, in order (for zeroing).

        >>> BlocksChanged(order="AA", appended_keys=("a", "a"), appended_request_ids=(1, 1),
        ...               appended_block_ids=(0, 5)).new_block_ids("a")
        (5,)
        """
        return tuple(b for k, b in zip(self.appended_keys, self.appended_block_ids, strict=True)
                     if k == key and b)


EMPTY_DELTA = BlocksChanged()


def _bad(msg: str) -> ReplayMismatchError:
    return ReplayMismatchError(f"malformed delta: {msg}")


def family_rows(d: BlocksChanged) -> dict[str, list[tuple[Any, ...]]]:
    """Each family's rows as tuples, after checking the shape of the delta."""
    if type(d) is not BlocksChanged:
        raise _bad(f"expected a BlocksChanged, got {type(d).__name__}")
    if d.version != DELTA_VERSION:
        raise _bad(f"version {excerpt(d.version)} is not {DELTA_VERSION}")
    if type(d.order) is not str:
        raise _bad(f"order must be a str, got {type(d.order).__name__}")
    rows: dict[str, list[tuple[Any, ...]]] = {}
    for code, names in COLUMNS.items():
        cols = [getattr(d, name) for name in names]
        if not all(type(c) is tuple for c in cols):
            raise _bad(f"the {names[0].rsplit('_', 1)[0]} columns must be tuples")
        n = len(cols[0])
        if any(len(c) != n for c in cols):
            raise _bad(f"the columns {names} are not parallel")
        if d.order.count(code) != n:
            raise _bad(f"order names {d.order.count(code)} {code!r} rows, the columns hold {n}")
        rows[code] = list(zip(*cols, strict=True)) if n else []
    if len(d.order) != sum(len(r) for r in rows.values()):
        unknown = sorted(set(d.order) - set(COLUMNS))
        raise _bad(f"order holds unknown codes {excerpt(''.join(unknown))}")
    return rows


class DeltaBuilder:
    """Collects one transition's rows (in order), then freezes them into one delta."""

    __slots__ = ("appended", "cleared", "copied", "evicted", "freed", "hit", "nulled", "order",
                 "registered", "released", "shared", "stored")

    def __init__(self) -> None:
        self.order: list[str] = []
        self.registered: list[tuple[Any, ...]] = []
        self.released: list[tuple[Any, ...]] = []
        self.nulled: list[tuple[Any, ...]] = []
        self.freed: list[tuple[Any, ...]] = []
        self.appended: list[tuple[Any, ...]] = []
        self.shared: list[tuple[Any, ...]] = []
        self.copied: list[tuple[Any, ...]] = []
        self.stored: list[tuple[Any, ...]] = []
        self.evicted: list[tuple[Any, ...]] = []
        self.cleared: list[tuple[Any, ...]] = []
        self.hit: list[tuple[Any, ...]] = []

    def build(self) -> BlocksChanged:
        """Freeze the collected rows into one columnar record."""
        if not self.order:
            return EMPTY_DELTA
        fields: dict[str, Any] = {"order": "".join(self.order)}
        for code, prefix, _ in FAMILIES:
            rows = getattr(self, prefix)
            if rows:
                fields.update(zip(COLUMNS[code], zip(*rows, strict=True), strict=True))
        return BlocksChanged(**fields)
