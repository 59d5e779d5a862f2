"""A pure range allocator: the byte layout of one pre-allocated memory pool.

The pool is ``size`` bytes carved into page-aligned ranges.  The state is
the sorted tuple of free ranges ``(offset, length)``; allocation is first
fit, release puts a range back and merges it with its free neighbours, so
the free list never holds two adjacent ranges::

    pages:   | A A | . . | B | . . . |      free = ((2, 2), (5, 3))   (in pages)
    release B       ->   | A A | . . . . . . |    free = ((2, 6),)

Every function returns a new state and leaves its input as it was.  Pool
sizes here are a few hundred ranges at most, so a tuple scanned linearly
beats any tree.
"""

from __future__ import annotations

import attrs

from kvfunc.datadist._errors import InvalidParamError

__all__ = ["RangeState", "allocate_range", "check_range_invariants", "page_round",
           "release_range"]


def page_round(nbytes: int, page_size: int) -> int:
    """``nbytes`` rounded up to a whole number of pages (at least one page).

    >>> page_round(1, 4096), page_round(4096, 4096), page_round(4097, 4096), page_round(0, 64)
    (4096, 4096, 8192, 64)
    """
    return max(1, -(-nbytes // page_size)) * page_size


@attrs.frozen
class RangeState:
    """A pool of ``size`` bytes in pages of ``page_size``; ``free`` is sorted and merged."""

    size: int
    page_size: int
    free: tuple[tuple[int, int], ...]

    @classmethod
    def create(cls, size: int, page_size: int) -> RangeState:
        """An empty pool of the whole pages that fit in ``size`` bytes.

        >>> RangeState.create(10_000, 4096)
        RangeState(size=8192, page_size=4096, free=((0, 8192),))
        """
        if type(page_size) is not int or page_size <= 0 or page_size & (page_size - 1):
            raise InvalidParamError(f"page_size must be a power of two, got {page_size!r}")
        if type(size) is not int or size < 0:
            raise InvalidParamError(f"pool size must be a non-negative int, got {size!r}")
        usable = size // page_size * page_size
        return cls(usable, page_size, ((0, usable),) if usable else ())

    @property
    def free_bytes(self) -> int:
        """Bytes not held by any range."""
        return sum(length for _, length in self.free)

    @property
    def used_bytes(self) -> int:
        """Bytes held by allocated ranges."""
        return self.size - self.free_bytes


def allocate_range(state: RangeState, nbytes: int) -> tuple[RangeState, int] | None:
    """First fit of ``nbytes`` (rounded up to pages): ``(new state, offset)``, or None.

    None means no free range is large enough; the caller decides what a
    refusal means.

    >>> s = RangeState.create(4 * 64, 64)
    >>> s, a = allocate_range(s, 100); s, b = allocate_range(s, 1); (a, b, s.free)
    (0, 128, ((192, 64),))
    >>> allocate_range(s, 65) is None
    True
    """
    if type(nbytes) is not int or nbytes < 0:
        raise InvalidParamError(f"nbytes must be a non-negative int, got {nbytes!r}")
    need = page_round(nbytes, state.page_size)
    for i, (offset, length) in enumerate(state.free):
        if length >= need:
            rest = ((offset + need, length - need),) if length > need else ()
            free = state.free[:i] + rest + state.free[i + 1:]
            return RangeState(state.size, state.page_size, free), offset
    return None


def release_range(state: RangeState, offset: int, nbytes: int) -> RangeState:
    """Give back the range ``allocate_range`` returned for ``nbytes``, merging neighbours.

    Raises:
        InvalidParamError: the range is not page aligned, lies outside the
            pool, or overlaps a free range (a double release).

    >>> s = RangeState.create(4 * 64, 64)
    >>> s, a = allocate_range(s, 64); s, b = allocate_range(s, 64)
    >>> release_range(release_range(s, a, 64), b, 64).free
    ((0, 256),)
    """
    length = page_round(nbytes, state.page_size)
    end = offset + length
    if offset % state.page_size or offset < 0 or end > state.size:
        msg = f"range [{offset}, {end}) is not an aligned range of a pool of {state.size} bytes"
        raise InvalidParamError(msg)
    free = list(state.free)
    i = 0
    while i < len(free) and free[i][0] < offset:
        i += 1
    before = free[i - 1] if i else None
    after = free[i] if i < len(free) else None
    if (before and before[0] + before[1] > offset) or (after and after[0] < end):
        raise InvalidParamError(f"range [{offset}, {end}) is already free (double release)")
    start = offset
    if before and before[0] + before[1] == offset:
        start = before[0]
        i -= 1
        del free[i]
    if after and after[0] == end:
        end = after[0] + after[1]
        del free[i]
    free.insert(i, (start, end - start))
    return RangeState(state.size, state.page_size, tuple(free))


def check_range_invariants(state: RangeState, held: list[tuple[int, int]]) -> None:
    """Assert free ranges are sorted, merged, aligned, and tile the pool with ``held``.

    ``held`` lists the allocated ``(offset, length)`` ranges (lengths page rounded).

    >>> s = RangeState.create(256, 64); s, a = allocate_range(s, 64)
    >>> check_range_invariants(s, [(a, 64)])
    """
    page = state.page_size
    for (o1, l1), (o2, _) in zip(state.free, state.free[1:], strict=False):
        assert o1 + l1 < o2, f"free ranges overlap or touch: {state.free}"
    for offset, length in state.free:
        assert length > 0 and offset % page == 0 and length % page == 0, state.free
    spans = sorted([*state.free, *held])
    position = 0
    for offset, length in spans:
        assert offset == position, f"gap or overlap at {position}: {spans}"
        position += length
    assert position == state.size, f"ranges cover {position} of {state.size} bytes"
