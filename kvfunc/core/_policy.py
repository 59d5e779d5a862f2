"""What the allocator asks of a policy: the protocol, and one function per question.

A policy (one small pure unit per attention type: ``_policies``) answers,
for one request in one group, given only how many table entries the request
holds and token counts:

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
frozen class with these methods, registered with ``register_policy``;
:func:`check_hints` holds its hints to its methods when a state takes it.
A policy never sees the pool or other requests: the step in ``_step`` does
the two-phase check over all groups, like ``optax.chain`` composes
transformations.

Two class-level hints let the step skip method calls:
``grows_with_tokens`` (a request that already holds entries needs
``ceil(num_tokens / block_size) - held`` more blocks) and ``window`` (when not
``None``, ``num_skipped_tokens(c) == max(0, c - window + 1)``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any, ClassVar, Protocol, runtime_checkable

from kvfunc.core._errors import InvalidArgumentError

__all__ = [
    "BY_METHOD",
    "BY_WINDOW",
    "KEEPS_ALL",
    "NEVER",
    "Policy",
    "blocks_needed",
    "check_hints",
    "hit_span",
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


# How a policy drops tokens, decided once per group (see ``skip_mode``).
KEEPS_ALL, BY_WINDOW, BY_METHOD = 0, 1, 2


def skip_mode(policy: Policy) -> int:
    """How ``policy`` drops leading tokens: ``KEEPS_ALL``, ``BY_WINDOW`` or ``BY_METHOD``.

    The one answer to "does this policy keep every token?" (the step, replay,
    prefix lookups and the invariants ask it).

    >>> from kvfunc.core import FullAttention, Mamba, SlidingWindow
    >>> skip_mode(FullAttention(1, 1)), skip_mode(SlidingWindow(1, 1, 4))
    (0, 1)
    """
    if policy.window is not None:
        return BY_WINDOW
    return BY_METHOD if policy.may_skip else KEEPS_ALL


def slid_out(policy: Policy, mode: int, computed: int, held: int) -> int:
    """Table positions before the returned one have slid out of the window (0: none).

    The one answer to "did a block slide out?": the step, recycling
    (``_transitions.recycle_into``, which compat's ``remove_skipped_blocks``
    calls), prefix hits (:func:`hit_span`) and ``kvfunc.vllm``'s in-flight
    split call it.  At most ``held``.

    >>> from kvfunc.core import SlidingWindow
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

    >>> from kvfunc.core import FullAttention, SlidingWindow
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

    >>> from kvfunc.core import FullAttention, Mamba, SlidingWindow
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
    that send every step to the policy.  ``tests/test_lane.py``
    checks them against the answers they stand for.

    >>> from kvfunc.core import SlidingWindow
    >>> row_limits(SlidingWindow(9, 4, 8), (4, True, BY_WINDOW, 8), False, 3, 0, 0, 0)
    (12, 11, 4611686018427387904, 0)
    """
    bs, grows, mode, window = traits
    if not grows or not held or mode == BY_METHOD:
        return -1, -1, -1, NEVER
    room = held * bs
    slide = NEVER if mode == KEEPS_ALL or held == nulls else (nulls + 1) * bs + window - 1  # type: ignore[operator]
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
