"""Allocation policies: one small pure unit per attention type.

A policy answers, for one request in one group, given only how many table
entries the request holds and token counts:

* how many of its leading tokens are dead (``num_skipped_tokens``), so that
  their blocks can be recycled;
* how many null entries and new blocks a table of ``num_tokens`` tokens needs
  (``plan_blocks``);
* how many blocks must stay free for other registered requests
  (``num_reserved_blocks``).

Each question the allocator asks of a policy has one function here:
:func:`skip_mode` (does it keep every token?), :func:`slid_out` (what slid
out of the window?), :func:`blocks_needed` (what does a table need?) and
:func:`hit_span` (which hit is acceptable?), so a new attention type is one
frozen class with these methods, registered with :func:`register_policy`;
:func:`check_hints` holds its hints to its methods when a state takes it.  A policy never sees the
pool or other requests: the step in ``_step`` does the two-phase check over
all groups, like ``optax.chain`` composes transformations.

Two class-level hints let the step skip method calls:
``grows_with_tokens`` (a request that already holds entries needs
``ceil(num_tokens / block_size) - held`` more blocks) and ``window`` (when not
``None``, ``num_skipped_tokens(c) == max(0, c - window + 1)``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar, Protocol, runtime_checkable

import attrs

from kvfunc.core._checks import MAX_NUM_BLOCKS, excerpt
from kvfunc.core._errors import InvalidArgumentError, UnknownAttentionTypeError

__all__ = [
    "BY_METHOD",
    "BY_WINDOW",
    "KEEPS_ALL",
    "NEVER",
    "FullAttention",
    "Mamba",
    "Policy",
    "SlidingWindow",
    "blocks_needed",
    "check_hints",
    "hit_span",
    "policy_class",
    "register_policy",
    "registered_attn_types",
    "row_limits",
    "skip_mode",
    "slid_out",
]


@runtime_checkable
class Policy(Protocol):
    """What the allocator needs from an attention type's policy."""

    attn_type: ClassVar[str]
    grows_with_tokens: ClassVar[bool]
    may_skip: ClassVar[bool]

    @property
    def num_blocks(self) -> int: ...

    @property
    def block_size(self) -> int: ...

    @property
    def window(self) -> int | None: ...

    def num_skipped_tokens(self, computed_tokens: int) -> int: ...

    def plan_blocks(self, num_held: int, num_tokens: int) -> tuple[int, int]: ...

    def num_reserved_blocks(self, reserved_tokens: int, num_registered: int) -> int: ...

    @classmethod
    def kwargs_from_entries(cls, entries: Iterable[Any]) -> dict[str, Any]: ...


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


# How a policy drops tokens, decided once per group (see ``skip_mode``).
KEEPS_ALL, BY_WINDOW, BY_METHOD = 0, 1, 2


def skip_mode(policy: Policy) -> int:
    """How ``policy`` drops leading tokens: ``KEEPS_ALL``, ``BY_WINDOW`` or ``BY_METHOD``.

    The one answer to "does this policy keep every token?" (the step, replay,
    prefix lookups and the invariants ask it).

    >>> skip_mode(FullAttention(1, 1)), skip_mode(SlidingWindow(1, 1, 4))
    (0, 1)
    """
    if policy.window is not None:
        return BY_WINDOW
    return BY_METHOD if policy.may_skip else KEEPS_ALL


def slid_out(policy: Policy, mode: int, computed: int, held: int) -> int:
    """Table positions before the returned one have slid out of the window (0: none).

    The one answer to "did a block slide out?": the step, recycling, compat
    and replay call it.  At most ``held``.

    >>> slid_out(SlidingWindow(num_blocks=9, block_size=4, sliding_window=8), 1, 12, 3)
    1
    """
    if mode == KEEPS_ALL or not held:
        return 0
    if mode == BY_WINDOW:
        skipped = computed - policy.window + 1  # type: ignore[operator]
    else:
        skipped = policy.num_skipped_tokens(computed)
    if skipped <= 0:
        return 0
    upto = skipped // policy.block_size
    return upto if upto < held else held


def blocks_needed(policy: Policy, grows: bool, held: int, total: int, keep: bool = False
                  ) -> tuple[int, int]:
    """``(null entries, new blocks)`` a table of ``held`` entries needs to cover ``total`` tokens.

    With ``keep`` (prefix caching) a new table of a policy that grows with
    tokens gets a block for every token, null entries none: the blocks a
    prefill computes can then be cached, and those that slid out of a window
    leave at the next step (:func:`slid_out`), cached, as vLLM keeps them.

    >>> blocks_needed(FullAttention(num_blocks=9, block_size=4), True, 2, 9)
    (0, 1)
    >>> swa = SlidingWindow(num_blocks=9, block_size=4, sliding_window=4)
    >>> blocks_needed(swa, True, 0, 12), blocks_needed(swa, True, 0, 12, keep=True)
    ((1, 2), (0, 3))
    """
    if grows and (held or keep):
        need = -(-total // policy.block_size) - held
        return 0, need if need > 0 else 0
    return policy.plan_blocks(held, total)


def hit_span(policy: Policy, num_tokens: int) -> tuple[int, int]:
    """Table positions ``first .. last - 1`` that must be cached for a hit of ``num_tokens``.

    The one answer to "which hit is acceptable?": a policy that grows with
    tokens needs the blocks its window still reads (every block for full
    attention, the last window's blocks for a sliding window, as vLLM's
    hybrid coordinator decides); a state (``grows_with_tokens`` False) needs
    the state saved at exactly ``num_tokens``, the one block
    ``num_tokens // block_size - 1``.

    >>> hit_span(SlidingWindow(num_blocks=9, block_size=4, sliding_window=8), 16)
    (2, 4)
    >>> hit_span(FullAttention(num_blocks=9, block_size=4), 16), hit_span(Mamba(9, 4), 16)
    ((0, 4), (3, 4))
    """
    bs = policy.block_size
    last = num_tokens // bs
    if not policy.grows_with_tokens:
        return last - 1, last
    return min(policy.num_skipped_tokens(num_tokens) // bs, last), last


#: A limit no token count reaches.
NEVER = 1 << 62


def row_limits(policy: Policy, traits: tuple[int, bool, int, int | None], caching: bool,
               held: int, nulls: int, stored: int, shared: int) -> tuple[int, int, int, int]:
    """A table's quiet limits ``(room, slide, fill, cow_from)`` (see ``_rows``).

    A step of ``(computed, written, total)`` tokens with ``total <= room``,
    ``computed < slide`` and ``computed >= cow_from`` gets nothing from the
    policy's answers: :func:`blocks_needed` needs no block (``room``: the
    tokens ``held`` entries cover), :func:`slid_out` recycles nothing
    (``slide``: where the window next leaves a block behind) and no write
    lands in a block another table holds (``cow_from``); no block completes
    for the cache either while ``written < fill`` or the step's hashes cover
    fewer than ``fill`` tokens.  They follow from the
    hints that :func:`check_hints` holds to the methods; a policy the hints
    cannot describe (no growth with tokens, skipping by method) gets limits
    that send every step to the policy.  ``tests/test_policy_limits.py``
    checks them against the answers they stand for.

    >>> row_limits(SlidingWindow(9, 4, 8), (4, True, BY_WINDOW, 8), False, 3, 0, 0, 0)
    (12, 11, 4611686018427387904, 0)
    """
    bs, grows, mode, window = traits
    held_real = held - nulls
    if not grows or not held or mode == BY_METHOD:
        return -1, -1, -1, NEVER
    room = held * bs
    slide = NEVER if mode == KEEPS_ALL or not held_real else (nulls + 1) * bs + window - 1  # type: ignore[operator]
    if not caching:
        return room, slide, NEVER, 0
    done = stored if stored > nulls else nulls
    return room, slide, (done + 1) * bs if done < held else NEVER, shared * bs


_PROBES = (0, 1, 2, 3, 7, 15, 16, 17, 31, 64, 100, 1023, 1024, 1025, 4096, 65537)
_CHECKED: dict[Any, None] = {}


def check_hints(key: str, policy: Policy) -> None:
    """The policy's hints agree with its methods (checked when a state registers it).

    ``window`` not None promises ``num_skipped_tokens(c) == max(0, c - window + 1)``;
    ``may_skip`` False with no window promises nothing is ever skipped;
    ``grows_with_tokens`` promises that a table of ``h > 0`` entries needs
    ``ceil(n / block_size) - h`` more blocks and no null entries.  The step
    trusts the hints, so a policy that breaks one is refused here.
    """
    try:
        if policy in _CHECKED:
            return
    except TypeError:  # an unhashable policy is checked every time
        pass
    window, bs = policy.window, policy.block_size
    for c in _PROBES:
        skipped = policy.num_skipped_tokens(c)
        want = max(0, c - window + 1) if window is not None else None if policy.may_skip else 0
        if want is not None and skipped != want:
            _broken(key, policy, f"num_skipped_tokens({c}) is {skipped!r}, its hints say {want}")
        if policy.grows_with_tokens:
            for held in (1, 2, 5):
                got, expect = policy.plan_blocks(held, c), (0, max(0, -(-c // bs) - held))
                if tuple(got) != expect:
                    _broken(key, policy, f"plan_blocks({held}, {c}) is {got!r}, "
                                         f"grows_with_tokens says {expect}")
    with contextlib.suppress(TypeError):  # an unhashable policy is checked every time
        _CHECKED[policy] = None


def _broken(key: str, policy: Policy, what: str) -> None:
    msg = f"group {key!r}: policy {type(policy).__name__} breaks its hints: {what}"
    raise InvalidArgumentError(msg)


for _cls in (FullAttention, SlidingWindow, Mamba):
    register_policy(_cls)
