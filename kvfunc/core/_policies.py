"""The built-in policies, one per attention type, and the registry of policy classes.

Each policy is a frozen record of its parameters with the methods of
:class:`~kvfunc.core._policy.Policy`: :class:`FullAttention`,
:class:`SlidingWindow` and :class:`Mamba`.  A new attention type is one more
such class, registered with :func:`register_policy`; the allocator asks it
its questions through the functions of ``_policy``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import attrs

from kvfunc.core._checks import MAX_NUM_BLOCKS, excerpt
from kvfunc.core._errors import InvalidArgumentError, UnknownAttentionTypeError
from kvfunc.core._policy import Policy

__all__ = [
    "FullAttention",
    "Mamba",
    "SlidingWindow",
    "policies_by_key",
    "policy_class",
    "register_policy",
    "registered_attn_types",
]


def _check_positive_int(owner: str, name: str, value: object) -> None:
    if type(value) is not int or value <= 0:
        msg = f"{owner} {name} must be a positive int, but got {excerpt(value)}"
        raise InvalidArgumentError(msg)


def _check_num_blocks(owner: str, value: object) -> None:
    _check_positive_int(owner, "num_blocks", value)
    if value > MAX_NUM_BLOCKS:  # type: ignore[operator]
        msg = f"{owner} num_blocks must be at most {MAX_NUM_BLOCKS}, but got {value}"
        raise InvalidArgumentError(msg)


def _check_non_negative_int(owner: str, name: str, value: object) -> None:
    if type(value) is not int or value < 0:
        msg = f"{owner} {name} must be a non-negative int, but got {excerpt(value)}"
        raise InvalidArgumentError(msg)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _single_value(attn_type: str, what: str, values: set[Any]) -> Any:
    if len(values) != 1:
        shown = sorted(values)
        msg = (
            f"All {attn_type} caches grouped into one manager must share the same "
            f"{what}, but got {shown}."
        )
        raise InvalidArgumentError(msg)
    return next(iter(values))


class _KeepsEveryToken:
    """Shared by policies that never drop tokens (no window, nothing skipped)."""

    __slots__ = ()

    @property
    def window(self) -> int | None:
        """No window: nothing is ever skipped."""
        return None

    def num_skipped_tokens(self, computed_tokens: int) -> int:
        """Every token stays needed: always 0."""
        return 0


@attrs.frozen(slots=True)
class FullAttention(_KeepsEveryToken):
    """Full attention: one block per ``block_size`` tokens, kept to the end.

    ``compress_ratio`` only matters for sizing and slot mapping; block counts
    are in logical (uncompressed) tokens.  Only this policy honours
    ``reserved_tokens`` (as the seed does).

    >>> FullAttention(num_blocks=8, block_size=16).plan_blocks(0, 33)
    (0, 3)
    >>> FullAttention(num_blocks=8, block_size=16).num_reserved_blocks(17, 3)
    6
    """

    attn_type: ClassVar[str] = "FullAttention"
    grows_with_tokens: ClassVar[bool] = True
    may_skip: ClassVar[bool] = False

    num_blocks: int
    block_size: int
    compress_ratio: int = 1

    def __attrs_post_init__(self) -> None:
        _check_num_blocks("FullAttention", self.num_blocks)
        _check_positive_int("FullAttention", "block_size", self.block_size)
        _check_positive_int("FullAttention", "compress_ratio", self.compress_ratio)

    def plan_blocks(self, num_held: int, num_tokens: int) -> tuple[int, int]:
        """``(null entries, new blocks)`` to cover ``num_tokens`` tokens."""
        return 0, max(0, _ceil_div(num_tokens, self.block_size) - num_held)

    def num_reserved_blocks(self, reserved_tokens: int, num_registered: int) -> int:
        """Blocks kept free: ``ceil(reserved/bs)`` per registered request."""
        return _ceil_div(reserved_tokens, self.block_size) * num_registered

    @classmethod
    def kwargs_from_entries(cls, entries: Iterable[Any]) -> dict[str, Any]:
        """Policy arguments shared by every cache entry of one group."""
        ratios = {e.compress_ratio for e in entries}
        return {"compress_ratio": _single_value(cls.attn_type, "compress_ratio", ratios)}


@attrs.frozen(slots=True)
class SlidingWindow:
    """Sliding-window attention over ``sliding_window`` tokens.

    A prefill of ``N`` tokens gets null entries for the blocks wholly before
    token ``N - 1 - W`` and real blocks from there on::

        N = 40, bs = 8, W = 16          tokens 23..39 are in the window
        logical block:  0     1     2     3     4
        entry:          null  null  real  real  real

    Once ``C`` tokens are computed, tokens ``0 .. C - W`` are dead and whole
    blocks among them are recycled (the table keeps its length).

    >>> SlidingWindow(num_blocks=8, block_size=8, sliding_window=16).plan_blocks(0, 40)
    (2, 3)
    >>> SlidingWindow(num_blocks=8, block_size=8, sliding_window=16).num_skipped_tokens(40)
    25
    """

    attn_type: ClassVar[str] = "SlidingWindow"
    grows_with_tokens: ClassVar[bool] = True
    may_skip: ClassVar[bool] = True

    num_blocks: int
    block_size: int
    sliding_window: int

    def __attrs_post_init__(self) -> None:
        _check_num_blocks("SlidingWindow", self.num_blocks)
        _check_positive_int("SlidingWindow", "block_size", self.block_size)
        _check_non_negative_int("SlidingWindow", "sliding_window", self.sliding_window)

    @property
    def window(self) -> int | None:
        """The window in tokens: ``num_skipped_tokens(c) == max(0, c - window + 1)``."""
        return self.sliding_window

    def num_skipped_tokens(self, computed_tokens: int) -> int:
        """Tokens ``0 .. C - W`` are dead once ``C`` tokens are computed."""
        return max(0, computed_tokens - self.sliding_window + 1)

    def plan_blocks(self, num_held: int, num_tokens: int) -> tuple[int, int]:
        """Prefill: null head + blocks of the window; decode: grow at the tail."""
        bs = self.block_size
        if num_held:
            return 0, max(0, _ceil_div(num_tokens, bs) - num_held)
        last_token = num_tokens - 1
        last_block = last_token // bs
        first_block = max(0, last_token - self.sliding_window) // bs
        return first_block, last_block - first_block + 1

    def num_reserved_blocks(self, reserved_tokens: int, num_registered: int) -> int:
        """The seed ignores reservations for sliding windows: always 0."""
        return 0

    @classmethod
    def kwargs_from_entries(cls, entries: Iterable[Any]) -> dict[str, Any]:
        """The one ``sliding_window`` shared by the group's entries."""
        windows = {e.sliding_window for e in entries}
        if None in windows:
            msg = "SlidingWindow cache must define sliding_window."
            raise InvalidArgumentError(msg)
        return {"sliding_window": _single_value(cls.attn_type, "sliding_window", windows)}


@attrs.frozen(slots=True)
class Mamba(_KeepsEveryToken):
    """A recurrent (Mamba-style) state: one block, topped up to ``1 + next_n``.

    The first allocation takes one state block whatever the token count; any
    later allocation tops the request up to ``1 + next_n`` blocks (MTP).

    >>> Mamba(num_blocks=8, next_n=2).plan_blocks(0, 100)
    (0, 1)
    >>> Mamba(num_blocks=8, next_n=2).plan_blocks(1, 101)
    (0, 2)
    """

    attn_type: ClassVar[str] = "Mamba"
    grows_with_tokens: ClassVar[bool] = False
    may_skip: ClassVar[bool] = False

    num_blocks: int
    block_size: int = 1
    next_n: int = 0

    def __attrs_post_init__(self) -> None:
        _check_num_blocks("Mamba", self.num_blocks)
        _check_positive_int("Mamba", "block_size", self.block_size)
        _check_non_negative_int("Mamba", "next_n", self.next_n)

    def plan_blocks(self, num_held: int, num_tokens: int) -> tuple[int, int]:
        """One block at first, then top up to ``1 + next_n``."""
        target = 1 + self.next_n if num_held else 1
        return 0, max(0, target - num_held)

    def num_reserved_blocks(self, reserved_tokens: int, num_registered: int) -> int:
        """The seed ignores reservations for Mamba: always 0."""
        return 0

    @classmethod
    def kwargs_from_entries(cls, entries: Iterable[Any]) -> dict[str, Any]:
        """The one ``next_n`` shared by the group's entries."""
        values = {e.next_n for e in entries}
        return {"next_n": _single_value(cls.attn_type, "next_n", values)}


_REGISTRY: dict[str, type[Any]] = {}


def register_policy(cls: type[Any]) -> type[Any]:
    """Register a policy class under its ``attn_type`` (usable as a decorator).

    >>> register_policy(FullAttention) is FullAttention
    True
    """
    name = getattr(cls, "attn_type", None)
    if not isinstance(name, str) or not name:
        msg = f"policy class {cls!r} must define a non-empty str attn_type, got {name!r}"
        raise InvalidArgumentError(msg)
    missing = [m for m in ("plan_blocks", "num_skipped_tokens", "num_reserved_blocks",
                           "kwargs_from_entries") if not hasattr(cls, m)]
    if missing:
        msg = f"policy class {cls.__name__} lacks {missing}"
        raise InvalidArgumentError(msg)
    _REGISTRY[name] = cls
    return cls


def registered_attn_types() -> list[str]:
    """Sorted names of the attention types that have a policy.

    >>> registered_attn_types()
    ['FullAttention', 'Mamba', 'SlidingWindow']
    """
    return sorted(_REGISTRY)


def policy_class(attn_type: str) -> type[Any]:
    """The policy class registered for ``attn_type``.

    >>> policy_class("SlidingWindow").__name__
    'SlidingWindow'
    >>> policy_class("Linear")
    Traceback (most recent call last):
    ...
    kvfunc.core._errors.UnknownAttentionTypeError: Unknown attn_type: Linear, ...
    """
    try:
        return _REGISTRY[attn_type]
    except (KeyError, TypeError):
        msg = (
            f"Unknown attn_type: {attn_type}, Please add a SingleTypeKVCacheManager "
            f"class corresponding to {attn_type}."
        )
        raise UnknownAttentionTypeError(msg) from None


def policies_by_key(groups: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    """Validate a ``{manager_key: policy}`` mapping and freeze its order."""
    if not isinstance(groups, Mapping):
        msg = f"groups must be a mapping of manager_key to policy, got {type(groups).__name__}"
        raise InvalidArgumentError(msg)
    items = tuple(groups.items())
    for key, policy in items:
        if not isinstance(key, str) or not key:
            msg = f"manager keys must be non-empty str, got {key!r}"
            raise InvalidArgumentError(msg)
        if not isinstance(policy, Policy):
            msg = f"group {key!r}: {policy!r} is not a policy"
            raise InvalidArgumentError(msg)
    return items


for _cls in (FullAttention, SlidingWindow, Mamba):
    register_policy(_cls)
