"""What an attacker passes where kvfunc expects something else: Hypothesis strategies of junk.

``junk()`` draws values of many types, small and huge (a 1 MiB string, a
100,000-item list, an int of thousands of digits, a ``bool`` where an int
belongs, an ``int`` subclass, an object whose ``repr`` raises), so that a
reader's check meets every shape of wrong input.  Tests filter it with
their own notion of "valid" for the field under attack.
"""

from __future__ import annotations

from decimal import Decimal
from fractions import Fraction
from typing import Any

from hypothesis import strategies as st

__all__ = ["HUGE", "SHORT", "IntSubclass", "ReprRaises", "junk", "short"]

#: The longest message an error may carry: one line a person reads.
SHORT = 300


class IntSubclass(int):
    """An int that is not an ``int``: its comparisons could lie, so it is refused."""

    def __lt__(self, other: object) -> bool:
        return False


class ReprRaises:
    """An object whose ``repr`` raises: a message that shows it must not crash."""

    def __repr__(self) -> str:
        raise RuntimeError("no repr for you")


#: Values large enough that rendering them whole, or copying them, would show.
HUGE: tuple[Any, ...] = ("x" * (1 << 20), b"y" * (1 << 20), list(range(100_000)),
                         10 ** 5000, -(10 ** 5000), tuple(range(100_000)))

_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-(2 ** 70), 2 ** 70), st.floats(),
    st.text(max_size=8), st.binary(max_size=8), st.complex_numbers(max_magnitude=10),
    st.sampled_from([Decimal(1), Fraction(1, 2), IntSubclass(3), range(3), object(), Ellipsis,
                     NotImplemented, float("inf"), 1.0, 0.0]),
    st.builds(ReprRaises))


def junk() -> st.SearchStrategy[Any]:
    """Any value: scalars of every type, containers of them (nested), and huge values."""
    containers = st.recursive(
        _SCALARS,
        lambda inner: st.one_of(st.lists(inner, max_size=4), st.tuples(inner, inner),
                                st.dictionaries(st.text(max_size=3), inner, max_size=3),
                                st.frozensets(st.integers(), max_size=3)),
        max_leaves=6)
    return st.one_of(containers, st.sampled_from(HUGE))


def short(message: str) -> bool:
    """A message a person can read in one line (the bad value shown as an excerpt)."""
    return len(message) <= SHORT and "\n" not in message
