"""A delta's operations: one named record per kind, and the families of a delta's columns.

:meth:`~kvfunc.BlocksChanged.operations` yields these records in the order
the transition performed them (see ``_delta`` for what each one means).
"""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = [
    "COLUMNS", "FAMILIES", "RECORDS", "Appended", "Cleared", "Copied", "Detached", "Dropped",
    "Evicted", "Freed", "LookedUp", "Nulled", "Operation", "Registered", "Released", "Retained",
    "Shared",
    "Stored",
]


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
    token_ids: tuple[int, ...] | None  # None: the hashes that cached it keep no tokens


class Evicted(NamedTuple):
    """A cached free block was handed out again: its hash is forgotten."""

    key: str
    block_id: int
    block_hash: bytes


class Cleared(NamedTuple):
    """The group's whole prefix cache was reset."""

    key: str


class Detached(NamedTuple):
    """The request's table was dropped; its blocks keep a holder outside the tables."""

    key: str
    request_id: int | str


class Dropped(NamedTuple):
    """One holder of a detached block let it go (a Freed row follows if it was the last)."""

    key: str
    block_id: int


class Retained(NamedTuple):
    """The cached blocks of the Freed run after it wait at retention ``priority`` (not 0)."""

    key: str
    priority: int


class LookedUp(NamedTuple):
    """An admission asked the prefix cache: tokens hit and tokens looked up."""

    request_id: int | str
    tokens: int
    query_tokens: int


Operation = (Registered | Released | Nulled | Freed | Appended | Shared | Copied | Stored
             | Evicted | Cleared | LookedUp | Detached | Dropped | Retained)

#: ``(code, family prefix, record type)`` in field order; the columns of a family are
#: ``f"{prefix}_{name}"`` for the record's fields, pluralised.
FAMILIES: tuple[tuple[str, str, type[Any]], ...] = (
    ("R", "registered", Registered), ("L", "released", Released), ("N", "nulled", Nulled),
    ("F", "freed", Freed), ("A", "appended", Appended), ("S", "shared", Shared),
    ("C", "copied", Copied), ("T", "stored", Stored), ("E", "evicted", Evicted),
    ("Z", "cleared", Cleared), ("H", "hit", LookedUp), ("D", "detached", Detached),
    ("X", "dropped", Dropped), ("Y", "retained", Retained),
)

_PLURAL = {"key": "keys", "request_id": "request_ids", "position": "positions",
           "block_id": "block_ids", "src_block_id": "src_block_ids",
           "dst_block_id": "dst_block_ids", "block_hash": "hashes", "parent_hash": "parent_hashes",
           "token_ids": "token_ids", "tokens": "tokens", "query_tokens": "query_tokens",
           "priority": "priorities"}


def _columns(prefix: str, record: type[Any]) -> tuple[str, ...]:
    return tuple(f"{prefix}_{_PLURAL[f]}" for f in record._fields)


COLUMNS: dict[str, tuple[str, ...]] = {c: _columns(prefix, rec) for c, prefix, rec in FAMILIES}
RECORDS = {code: rec for code, _, rec in FAMILIES}
