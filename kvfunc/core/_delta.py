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
                       (or evicted on request)
    Z     cleared      the group's prefix cache was reset    Cleared(key)
    H     hit          an admission asked the prefix cache   LookedUp(request_id, tokens,
                                                                      query_tokens)
    D     detached     the request's table was dropped, its  Detached(key, request_id)
                       blocks kept by a holder outside the
                       tables (a deferred free)
    X     dropped      a detached holder let a block go      Dropped(key, block_id)
    Y     retained     the next Freed run's cached blocks    Retained(key, priority)
                       wait at a retention priority (not 0)

A copy's ``position`` says what it is: a table position (copy-on-write: the
destination came from the free queue and replaces the source there),
:data:`COPY_INTO_NEW` (a saved state seeds the block the request was just
given) or :data:`COPY_SAVED` (the destination came from the free queue only
to hold a saved state: it is cached, then freed).  Copies run in row order:
a copy may read a block an earlier copy wrote.  An eviction comes before the
append or copy that took its block.  Only states with prefix caching produce
the S, C, T, E, Z, H and Y families.

A delta read from outside is checked by :meth:`BlocksChanged.operations` before
any reader sees a row: parallel columns of the right cell types (manager keys
``str``, request ids ``str`` or ``int``, block ids, positions and token counts
``int``, hashes non-empty ``bytes``, a block's token ids a tuple of ``int``;
never a ``bool``), and an ``order`` that names each row exactly once.
Whether the rows fit a state is replay's question.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import chain
from typing import Any, ClassVar, Generic, TypeVar, overload

import attrs

from kvfunc.core._checks import excerpt
from kvfunc.core._errors import InvalidTypeError, ReplayMismatchError
from kvfunc.core._ops import COLUMNS, RECORDS, Operation

__all__ = ["COLUMN_NAMES", "COPY_INTO_NEW", "COPY_SAVED", "DELTA_VERSION", "EMPTY_DELTA", "FIELDS",
           "BlocksChanged", "Run", "family_rows"]

DELTA_VERSION = 3
COPY_INTO_NEW = -1
COPY_SAVED = -2

_EMPTY: tuple[Any, ...] = ()


def _codes(value: Any) -> Any:
    """``order`` as a str; a sequence of one-letter codes (a JSON round trip) is joined."""
    if type(value) is str or not isinstance(value, list | tuple):
        return value
    return "".join(value) if all(type(c) is str for c in value) else value


_T = TypeVar("_T")


class _Column(Generic[_T]):
    """One column of a delta: a read-only attribute backed by the record's column tuple."""

    __slots__ = ("index", "name")
    count = 0

    def __init__(self) -> None:
        self.index = _Column.count
        _Column.count += 1
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type) -> _Column[_T]: ...

    @overload
    def __get__(self, obj: BlocksChanged, owner: type) -> _T: ...

    def __get__(self, obj: BlocksChanged | None, owner: type) -> Any:
        return self if obj is None else obj.columns()[self.index]


class BlocksChanged:
    """The delta of one transition (see the module docstring for the families).

    A value: immutable, hashable, equal when its version, order and columns
    are.  Build one by keyword (``BlocksChanged(order="A", appended_keys=...)``;
    a column left out is empty).  Its ``repr`` is valid Python that rebuilds
    an equal record:

    >>> d = BlocksChanged(order="RA", registered_keys=("full",), registered_request_ids=("r1",),
    ...                   appended_keys=("full",), appended_request_ids=("r1",),
    ...                   appended_block_ids=(1,))
    >>> eval(repr(d)) == d, d.is_empty, BlocksChanged().is_empty
    (True, False, True)
    >>> list(d.operations())
    [Registered(key='full', request_id='r1'), Appended(key='full', request_id='r1', block_id=1)]
    """

    __slots__ = ("_columns", "_rows", "order", "version")

    #: Every field, in order: the constructor's keywords and what a log records.
    FIELDS: ClassVar[tuple[str, ...]]
    version: int
    order: str
    _columns: tuple[tuple[Any, ...], ...] | None
    _rows: list[tuple[Any, ...]] | None  # a builder's rows in ``order``, trusted

    registered_keys: _Column[tuple[str, ...]] = _Column()
    registered_request_ids: _Column[tuple[int | str, ...]] = _Column()
    released_keys: _Column[tuple[str, ...]] = _Column()
    released_request_ids: _Column[tuple[int | str, ...]] = _Column()
    nulled_keys: _Column[tuple[str, ...]] = _Column()
    nulled_request_ids: _Column[tuple[int | str, ...]] = _Column()
    nulled_positions: _Column[tuple[int, ...]] = _Column()
    freed_keys: _Column[tuple[str, ...]] = _Column()
    freed_block_ids: _Column[tuple[int, ...]] = _Column()
    appended_keys: _Column[tuple[str, ...]] = _Column()
    appended_request_ids: _Column[tuple[int | str, ...]] = _Column()
    appended_block_ids: _Column[tuple[int, ...]] = _Column()
    shared_keys: _Column[tuple[str, ...]] = _Column()
    shared_request_ids: _Column[tuple[int | str, ...]] = _Column()
    shared_block_ids: _Column[tuple[int, ...]] = _Column()
    copied_keys: _Column[tuple[str, ...]] = _Column()
    copied_request_ids: _Column[tuple[int | str, ...]] = _Column()
    copied_positions: _Column[tuple[int, ...]] = _Column()
    copied_src_block_ids: _Column[tuple[int, ...]] = _Column()
    copied_dst_block_ids: _Column[tuple[int, ...]] = _Column()
    stored_keys: _Column[tuple[str, ...]] = _Column()
    stored_request_ids: _Column[tuple[int | str, ...]] = _Column()
    stored_positions: _Column[tuple[int, ...]] = _Column()
    stored_block_ids: _Column[tuple[int, ...]] = _Column()
    stored_hashes: _Column[tuple[bytes, ...]] = _Column()
    stored_parent_hashes: _Column[tuple[bytes | None, ...]] = _Column()
    stored_token_ids: _Column[tuple[tuple[int, ...] | None, ...]] = _Column()
    evicted_keys: _Column[tuple[str, ...]] = _Column()
    evicted_block_ids: _Column[tuple[int, ...]] = _Column()
    evicted_hashes: _Column[tuple[bytes, ...]] = _Column()
    cleared_keys: _Column[tuple[str, ...]] = _Column()
    hit_request_ids: _Column[tuple[int | str, ...]] = _Column()
    hit_tokens: _Column[tuple[int, ...]] = _Column()
    hit_query_tokens: _Column[tuple[int, ...]] = _Column()
    detached_keys: _Column[tuple[str, ...]] = _Column()
    detached_request_ids: _Column[tuple[int | str, ...]] = _Column()
    dropped_keys: _Column[tuple[str, ...]] = _Column()
    dropped_block_ids: _Column[tuple[int, ...]] = _Column()
    retained_keys: _Column[tuple[str, ...]] = _Column()
    retained_priorities: _Column[tuple[int, ...]] = _Column()

    def __init__(self, version: int = DELTA_VERSION, order: str = "", **columns: Any) -> None:
        cols = [_EMPTY] * len(COLUMN_NAMES)
        for name, value in columns.items():
            i = _COLUMN_INDEX.get(name)
            if i is None:
                msg = f"BlocksChanged has no column {excerpt(name)}"
                raise InvalidTypeError(msg)
            cols[i] = value
        _set(self, "version", version)
        _set(self, "order", _codes(order))
        _set(self, "_columns", tuple(cols))
        _set(self, "_rows", None)

    @classmethod
    def _of(cls, order: str, rows: list[tuple[Any, ...]], runs: bool) -> BlocksChanged:
        """A delta from a builder's rows; its columns, and ``runs``' rows, are built when read."""
        d = object.__new__(cls)
        _set(d, "version", DELTA_VERSION)
        _set(d, "order", order)
        _set(d, "_columns", _RUNS if runs else None)
        _set(d, "_rows", rows)
        return d

    def _spelled(self) -> list[tuple[Any, ...]] | None:
        """The builder's rows (None if built by keyword), every run spelled out once."""
        rows = self._rows
        if self._columns is not _RUNS:
            return rows
        out: list[tuple[Any, ...]] = []
        for row in rows:  # type: ignore[union-attr]
            if type(row) is Run:  # ``(fn, args)``: the rows ``fn(*args)`` gives
                out.extend(row[0](*row[1]))
            else:
                out.append(row)
        _set(self, "_rows", out)  # first: a reader between the two sets spells ``out`` again
        _set(self, "_columns", None)
        return out

    def columns(self) -> tuple[tuple[Any, ...], ...]:
        """Every column, in :data:`COLUMN_NAMES` order."""
        cols = self._columns
        if cols is None or cols is _RUNS:
            families: dict[str, list[tuple[Any, ...]]] = {}
            for code, row in zip(self.order, self._spelled() or (), strict=True):
                families.setdefault(code, []).append(row)
            out: list[tuple[Any, ...]] = []
            for code in COLUMNS:
                family = families.get(code)
                out.extend(zip(*family, strict=True) if family else _NONE[code])
            cols = tuple(out)
            _set(self, "_columns", cols)
        return cols

    def __setattr__(self, name: str, value: object = None) -> None:
        raise attrs.exceptions.FrozenInstanceError

    __delattr__ = __setattr__

    def __eq__(self, other: object) -> bool:
        if type(other) is not BlocksChanged:
            return NotImplemented
        return (self.version, self.order, self.columns()) == (other.version, other.order,
                                                                other.columns())

    def __hash__(self) -> int:
        return hash((self.version, self.order, self.columns()))

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (self.version, self.order, self.columns()))

    def __repr__(self) -> str:
        shown = [f"version={self.version!r}"]
        shown += [f"order={self.order!r}"] * bool(self.order) + [
            f"{n}={col!r}" for n, col in zip(COLUMN_NAMES, self.columns(), strict=True) if col]
        return f"BlocksChanged({', '.join(shown)})"

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
        new, built = tuple.__new__, self._spelled()
        if built is not None:
            for code, row in zip(self.order, built, strict=True):
                yield new(RECORDS[code], row)
            return
        rows = family_rows(self)
        cursor = dict.fromkeys(rows, 0)
        for code in self.order:
            i = cursor[code]
            cursor[code] = i + 1
            yield new(RECORDS[code], rows[code][i])

    def new_block_ids(self, key: str) -> tuple[int, ...]:
        """Blocks taken from ``key``'s free queue for table entries, in order (for zeroing).

        >>> BlocksChanged(order="AA", appended_keys=("a", "a"), appended_request_ids=(1, 1),
        ...               appended_block_ids=(0, 5)).new_block_ids("a")
        (5,)
        """
        return tuple(b for k, b in zip(self.appended_keys, self.appended_block_ids, strict=True)
                     if k == key and b)


_set = object.__setattr__
COLUMN_NAMES: tuple[str, ...] = tuple(
    name for name, v in vars(BlocksChanged).items() if isinstance(v, _Column))
_COLUMN_INDEX = {name: i for i, name in enumerate(COLUMN_NAMES)}
FIELDS: tuple[str, ...] = ("version", "order", *COLUMN_NAMES)
BlocksChanged.FIELDS = FIELDS
assert [name for names in COLUMNS.values() for name in names] == list(COLUMN_NAMES)
assert all(getattr(BlocksChanged, n).index == i for i, n in enumerate(COLUMN_NAMES))


def _rebuild(version: int, order: str, columns: tuple[tuple[Any, ...], ...]) -> BlocksChanged:
    d = object.__new__(BlocksChanged)
    _set(d, "version", version)
    _set(d, "order", order)
    _set(d, "_columns", columns)
    _set(d, "_rows", None)
    return d


EMPTY_DELTA = BlocksChanged()


def _bad(msg: str) -> ReplayMismatchError:
    return ReplayMismatchError(f"malformed delta: {msg}")


def family_rows(d: BlocksChanged) -> dict[str, list[tuple[Any, ...]]]:
    """Each family's rows as tuples, after checking the shape of the delta and its cells."""
    if type(d) is not BlocksChanged:
        raise _bad(f"expected a BlocksChanged, got {type(d).__name__}")
    if type(d.version) is not int or d.version != DELTA_VERSION:
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
        if n:
            for name, col in zip(names, cols, strict=True):
                _check_cells(name, col)
        rows[code] = list(zip(*cols, strict=True)) if n else []
    if len(d.order) != sum(len(r) for r in rows.values()):
        unknown = sorted(set(d.order) - set(COLUMNS))
        raise _bad(f"order holds unknown codes {excerpt(''.join(unknown))}")
    return rows


_INT, _STR, _BYTES = (frozenset({t}) for t in (int, str, bytes))
_NONE_TYPE = type(None)
_TOKENS: frozenset[type] = frozenset({tuple, _NONE_TYPE})  # None: hashes kept no tokens


def _cell_kind(name: str) -> tuple[frozenset[type], str]:
    """The types a column's cells may have, and how a message names them."""
    if name.endswith("_keys"):
        return _STR, "a manager key (a str)"
    if name.endswith("_request_ids"):
        return frozenset({str, int}), "a request id (a str or an int)"
    if name == "stored_parent_hashes":
        return frozenset({bytes, _NONE_TYPE}), "a parent hash (non-empty bytes or None)"
    if name.endswith("_hashes"):
        return _BYTES, "a block hash (non-empty bytes)"
    if name == "stored_token_ids":
        return _TOKENS, "a block's token ids (a tuple of ints, or None)"
    return _INT, "an int"


_CELLS = {name: _cell_kind(name) for names in COLUMNS.values() for name in names}


def _check_cells(name: str, col: tuple[Any, ...]) -> None:
    """Every cell of column ``name`` has its type (``bool`` is never an ``int`` here)."""
    allowed, what = _CELLS[name]
    if set(map(type, col)) <= allowed:  # one pass in C for the common, well-formed column
        if allowed is _TOKENS:
            ok = set(map(type, chain.from_iterable(filter(None, col)))) <= _INT
        else:  # a digest is never empty
            ok = bytes not in allowed or all(h is None or h for h in col)
        if ok:
            return
    bad = next((v for v in col if not _cell_ok(allowed, v)), None)
    raise _bad(f"{name} holds {excerpt(bad)}, not {what}")


def _cell_ok(allowed: frozenset[type], value: Any) -> bool:
    if type(value) not in allowed:
        return False
    if allowed is _TOKENS:
        return value is None or all(type(t) is int for t in value)
    return value is None or type(value) is not bytes or bool(value)


class Run(tuple):  # type: ignore[type-arg]
    """``(fn, args)`` among a builder's rows: the rows ``fn(*args)`` gives, spelled out when
    the delta is read (:meth:`~kvfunc.core._builder.DeltaBuilder.run` and ``spell``)."""

    __slots__ = ()


_RUNS: Any = (_EMPTY,)  # ``_columns`` of a delta whose builder's rows hold a :class:`Run`
_NONE = {code: (_EMPTY,) * len(names) for code, names in COLUMNS.items()}
