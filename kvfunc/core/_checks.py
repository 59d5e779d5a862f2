"""Argument checks: one per kind, run once at each public entry.

Every public transition normalises and checks its arguments here before it
touches anything, so a bad argument is a typed error and the input state is
untouched.  Messages show the bad value through :func:`excerpt`, which never
renders more than a short prefix of it (a 100 MB payload must not become a
400 MB message).
"""

from __future__ import annotations

from collections.abc import Collection

from kvfunc.core._errors import InvalidArgumentError, InvalidTypeError

__all__ = [
    "MAX_NUM_BLOCKS",
    "MAX_PRIORITY",
    "check_count",
    "check_int",
    "check_manager_keys",
    "check_priority",
    "check_request_id",
    "excerpt",
    "is_priority",
    "is_request_id",
]

#: The largest pool a group may have: 2**24 blocks (16.7 M).  A state keeps a few
#: per-block vectors, so a pool this size costs a few hundred MiB; a larger one is
#: a typed error rather than a ``MemoryError`` halfway through building it.
MAX_NUM_BLOCKS = 1 << 24

_EXCERPT = 60


def excerpt(value: object, limit: int = _EXCERPT, depth: int = 2) -> str:
    """A short ``repr`` of ``value``: about ``limit`` characters at most, built cheaply.

    Strings and bytes are cut before they are rendered; containers show
    their first items, themselves shortened (nested ``depth`` levels deep at
    most); anything else is rendered and cut.

    >>> excerpt("x" * 1000)
    "'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx'... (1000 chars)"
    >>> excerpt(list(range(100)))
    '[0, 1, 2, 3, 4, 5, 6, 7, ...] (100 items)'
    >>> excerpt([["y" * 500]]), excerpt(3.5), excerpt(-10**5000)
    ("[['yyyyyyyyyyyyyyyyyyyy'... (500 chars)]]", '3.5', '<an int of 16610 bits>')
    """
    if isinstance(value, str | bytes | bytearray | memoryview):
        if len(value) <= limit:
            return repr(value)
        unit = "chars" if isinstance(value, str) else "bytes"
        return f"{value[:limit]!r}... ({len(value)} {unit})"
    if type(value) in _BRACKETS:
        return _container(value, depth)  # type: ignore[arg-type]
    if isinstance(value, int) and value.bit_length() > 4 * limit:  # str() is slow, then refused
        return f"<an int of {value.bit_length()} bits>"
    try:
        text = repr(value)
    except Exception:  # a hostile __repr__: say what it is instead
        return f"<{type(value).__name__}>"
    return text if len(text) <= limit else f"{text[:limit]}... ({type(value).__name__})"


_BRACKETS: dict[type, tuple[str, str]] = {
    list: ("[", "]"), tuple: ("(", ")"), set: ("{", "}"), frozenset: ("{", "}"), dict: ("{", "}")}


def _container(value: list[object] | tuple[object, ...] | set[object] | dict[object, object],
               depth: int) -> str:
    left, right = _BRACKETS[type(value)]
    if depth <= 0:
        return f"{left}...{right} ({len(value)} items)"
    head: list[object] = []
    for item in value:  # the first few only: a huge container is never copied
        if len(head) == 8:
            break
        head.append(item)
    if isinstance(value, dict):
        inner = ", ".join(f"{excerpt(k, 20, depth - 1)}: {excerpt(value[k], 20, depth - 1)}"
                          for k in head)
    else:
        inner = ", ".join(excerpt(v, 20, depth - 1) for v in head)
    if len(inner) > _EXCERPT:  # nested items add up: the whole stays about one excerpt long
        inner = f"{inner[:_EXCERPT]}..."
    if len(value) > 8:
        return f"{left}{inner}, ...{right} ({len(value)} items)"
    return f"{left}{inner}{right}"


def is_request_id(value: object) -> bool:
    """Request ids are ``str`` or ``int``, never ``bool`` (``True`` would alias request 1).

    >>> is_request_id("a"), is_request_id(-1), is_request_id(True), is_request_id(1.0)
    (True, True, False, False)
    """
    t = type(value)
    return t is str or t is int


def check_request_id(value: object) -> None:
    """Raise :class:`~kvfunc.InvalidTypeError` unless ``value`` is a request id.

    >>> check_request_id(False)
    Traceback (most recent call last):
    ...
    kvfunc.core._errors.InvalidTypeError: request_id must be a str or an int (not a bool), ...
    """
    if not is_request_id(value):
        msg = f"request_id must be a str or an int (not a bool), but got {excerpt(value)}"
        raise InvalidTypeError(msg)


def check_count(name: str, value: object) -> int:
    """``value`` if it is a non-negative ``int`` (never a bool); else a typed error.

    >>> check_count("num_new_tokens", 3)
    3
    >>> check_count("computed_tokens", -3)
    Traceback (most recent call last):
    ...
    kvfunc.core._errors.InvalidArgumentError: computed_tokens must be non-negative, but got -3
    """
    if type(value) is not int:
        msg = f"{name} must be an int, but got {excerpt(value)}"
        raise InvalidTypeError(msg)
    if value < 0:
        msg = f"{name} must be non-negative, but got {excerpt(value)}"
        raise InvalidArgumentError(msg)
    return value


def check_int(owner: str, name: str, value: object, minimum: int) -> int:
    """``value`` if it is an ``int`` (never a bool) of at least ``minimum``; else a typed error.

    >>> check_int("SizingConfig", "next_n", 2, 0)
    2
    >>> check_int("SizingConfig", "batch_size_per_dp_rank", 0, 1)
    Traceback (most recent call last):
    ...
    kvfunc.core._errors.InvalidArgumentError: SizingConfig batch_size_per_dp_rank must be >= 1, \
but got 0
    """
    if type(value) is not int:
        msg = f"{owner} {name} must be an int, but got {excerpt(value)}"
        raise InvalidTypeError(msg)
    if value < minimum:
        msg = f"{owner} {name} must be >= {minimum}, but got {excerpt(value)}"
        raise InvalidArgumentError(msg)
    return value


#: Retention priorities run from ``-MAX_PRIORITY`` to ``MAX_PRIORITY`` (0 is the default).
MAX_PRIORITY = 1000


def is_priority(value: object) -> bool:
    """Whether ``value`` is a retention priority: an ``int`` (not a bool) within ``±MAX_PRIORITY``.

    >>> is_priority(-3), is_priority(1001), is_priority(True)
    (True, False, False)
    """
    return type(value) is int and -MAX_PRIORITY <= value <= MAX_PRIORITY


def check_priority(value: object) -> int:
    """``value`` if it is a retention priority: an ``int`` within ``±MAX_PRIORITY``.

    A free queue keeps one marker per priority in use, so the range bounds it.

    >>> check_priority(-3)
    -3
    >>> check_priority(10**6)
    Traceback (most recent call last):
    ...
    kvfunc.core._errors.InvalidArgumentError: a priority must be within -1000..1000, but got 1000000
    """
    if type(value) is not int:
        raise InvalidTypeError(f"a priority must be an int, but got {excerpt(value)}")
    if not is_priority(value):
        msg = f"a priority must be within {-MAX_PRIORITY}..{MAX_PRIORITY}, but got {excerpt(value)}"
        raise InvalidArgumentError(msg)
    return value


def check_manager_keys(value: object) -> frozenset[str] | None:
    """``None``, or a collection of ``str`` as a frozenset (a bare str would match substrings).

    >>> sorted(check_manager_keys(["a", "b"]))
    ['a', 'b']
    >>> check_manager_keys("full")
    Traceback (most recent call last):
    ...
    kvfunc.core._errors.InvalidTypeError: manager_keys must be None or a collection of str, ...
    """
    if value is None:
        return None
    if isinstance(value, str | bytes) or not isinstance(value, Collection):
        msg = f"manager_keys must be None or a collection of str, but got {excerpt(value)}"
        raise InvalidTypeError(msg)
    try:
        keys = frozenset(value)
    except TypeError:
        msg = f"manager_keys must hold str, but got {excerpt(value)}"
        raise InvalidTypeError(msg) from None
    if not all(type(k) is str for k in keys):
        msg = f"manager_keys must hold str, but got {excerpt(value)}"
        raise InvalidTypeError(msg)
    return keys
