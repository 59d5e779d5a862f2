"""The delta of a tiered transition: the device's delta and the tiers' operations.

Theory of operation
-------------------
A :class:`TierDelta` carries the device transition's
:class:`~kvfunc.BlocksChanged` (``device``) and, like it, one family of
parallel tuples per kind of tier operation, with ``order`` naming one code
letter per row in the order the transition performed them::

    code  family         one row means                               columns
    P     prioritized    a request got a retention priority          request_id, priority
    G     forgotten      a request's priority was dropped (freed)    request_id
    M     moved          a move started and is pending               move_id, direction,
                                                                     hash, src_block_id,
                                                                     dst_block_id,
                                                                     request_id, priority,
                                                                     key
    K     settled        a pending move was reported                 move_id, outcome
                         (``"done"`` or ``"failed"``)
    V     host_evicted   the host tier evicted a block               block_id, hash
    W     remote_dropped the remote directory forgot a hash          hash

A ``hash`` here is a tier key (:meth:`~kvfunc.TieredState.tier_key`: the
block hash, followed by its group's byte when the device has several
groups); a move's ``key`` is its group's manager key.

The device operations happen first (the device delta), then the tier
operations in ``order``.  Moves of one delta run in row order: a move that
reads a block comes before a move that writes it, and the shell lets a
reading move finish reading before it starts the next one.
:func:`~kvfunc.core._tier_checks.replay_tiered` folds over both parts.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import attrs

from kvfunc.core._delta import EMPTY_DELTA, BlocksChanged

__all__ = ["TIER_DELTA_VERSION", "TIER_FAMILIES", "TierDelta", "TierDeltaBuilder"]

TIER_DELTA_VERSION = 2

#: code -> the column names of its family, in row order.
TIER_FAMILIES: dict[str, tuple[str, ...]] = {
    "P": ("prioritized_request_ids", "prioritized_priorities"),
    "G": ("forgotten_request_ids",),
    "M": ("moved_ids", "moved_directions", "moved_hashes", "moved_src_block_ids",
          "moved_dst_block_ids", "moved_request_ids", "moved_priorities", "moved_keys"),
    "K": ("settled_ids", "settled_outcomes"),
    "V": ("host_evicted_block_ids", "host_evicted_hashes"),
    "W": ("remote_dropped_hashes",),
}

_E: tuple[Any, ...] = ()


@attrs.frozen(slots=True)
class TierDelta:
    """What one tiered transition did (see the module docstring); ``repr`` is valid Python.

    >>> d = TierDelta(order="M", moved_ids=(0,), moved_directions=("host->device",),
    ...               moved_hashes=(b"h",), moved_src_block_ids=(3,), moved_dst_block_ids=(5,),
    ...               moved_request_ids=("a",), moved_priorities=(0,), moved_keys=("full",))
    >>> eval(repr(d)) == d, list(d.moves())
    (True, [(0, 'host->device', b'h', 3, 5, 'a', 0, 'full')])
    """

    version: int = TIER_DELTA_VERSION
    device: BlocksChanged = EMPTY_DELTA
    order: str = ""
    prioritized_request_ids: tuple[Any, ...] = _E
    prioritized_priorities: tuple[int, ...] = _E
    forgotten_request_ids: tuple[Any, ...] = _E
    moved_ids: tuple[int, ...] = _E
    moved_directions: tuple[str, ...] = _E
    moved_hashes: tuple[bytes, ...] = _E
    moved_src_block_ids: tuple[int, ...] = _E
    moved_dst_block_ids: tuple[int, ...] = _E
    moved_request_ids: tuple[Any, ...] = _E
    moved_priorities: tuple[int, ...] = _E
    moved_keys: tuple[str, ...] = _E
    settled_ids: tuple[int, ...] = _E
    settled_outcomes: tuple[str, ...] = _E
    host_evicted_block_ids: tuple[int, ...] = _E
    host_evicted_hashes: tuple[bytes, ...] = _E
    remote_dropped_hashes: tuple[bytes, ...] = _E

    @property
    def is_empty(self) -> bool:
        """True when the transition changed nothing in any tier."""
        return not self.order and self.device.is_empty

    def rows(self) -> Iterator[tuple[str, tuple[Any, ...]]]:
        """Every tier operation as ``(code, row)``, in the order performed."""
        families = {code: list(zip(*(getattr(self, n) for n in names), strict=True))
                    for code, names in TIER_FAMILIES.items()}
        cursor = dict.fromkeys(families, 0)
        for code in self.order:
            i = cursor[code]
            cursor[code] = i + 1
            yield code, families[code][i]

    def moves(self) -> Iterator[tuple[Any, ...]]:
        """The moves started: ``(move_id, direction, tier key, src, dst, request_id, priority,
        manager key)`` each."""
        return zip(*(getattr(self, n) for n in TIER_FAMILIES["M"]), strict=True)


class TierDeltaBuilder:
    """Rows of a :class:`TierDelta` as a transition performs them."""

    __slots__ = ("codes", "rows")

    def __init__(self) -> None:
        self.codes: list[str] = []
        self.rows: list[tuple[Any, ...]] = []

    def add(self, code: str, *row: Any) -> None:
        """One operation's row."""
        self.codes.append(code)
        self.rows.append(row)

    def build(self, device: BlocksChanged) -> TierDelta:
        """The delta of these rows after ``device``."""
        families: dict[str, list[tuple[Any, ...]]] = {}
        for code, row in zip(self.codes, self.rows, strict=True):
            families.setdefault(code, []).append(row)
        columns: dict[str, tuple[Any, ...]] = {}
        for code, rows in families.items():
            columns.update(zip(TIER_FAMILIES[code], zip(*rows, strict=True), strict=True))
        return TierDelta(TIER_DELTA_VERSION, device, "".join(self.codes), **columns)
