"""Each request's own vLLM block hashes as a kvfunc :class:`~kvfunc.BlockHashes`.

vLLM hashes a request's full blocks itself (``request.block_hashes``, bytes
digests of its request block hasher, extra keys included).  kvfunc uses them
as they are (:meth:`~kvfunc.BlockHashes.of_digests`, no second hashing) and
extends the value as the list grows, so a decode step costs one length check
(and a block that fills, a check that the request's tokens cover it).
The value keeps no tokens (``token_ids=None``): vLLM's KV events take a
block's tokens from the request, so no prompt token is checked or copied.
A list that was rebuilt (a resumed streaming request clears it) is noticed by
its last digest and converted again.
"""

from __future__ import annotations

from typing import Any

from kvfunc.core import BlockHashes, InvalidArgumentError
from kvfunc.core._checks import excerpt

__all__ = ["RequestHashes"]


class RequestHashes:
    """The converted hashes of the requests the manager holds blocks for.

    >>> from types import SimpleNamespace
    >>> r = SimpleNamespace(request_id="a", block_hashes=[b"h0"], all_token_ids=[1, 2, 3])
    >>> cache = RequestHashes(2)
    >>> cache.of(r).hashes
    (b'h0',)
    >>> r.block_hashes.append(b"h1"); r.all_token_ids.append(4)
    >>> cache.of(r).num_blocks, len(cache)
    (2, 1)
    >>> r.block_hashes.append(b"h2"); cache.of(r)      # a digest of tokens the request lacks
    Traceback (most recent call last):
    ...
    kvfunc.core._errors.InvalidArgumentError: 3 block hashes cover 6 tokens; request 'a' has 4
    """

    __slots__ = ("_block_size", "_by_request", "_seen")

    def __init__(self, block_size: int) -> None:
        self._block_size = block_size
        self._by_request: dict[Any, tuple[int, BlockHashes]] = {}
        #: request id -> (digests, full blocks written) at its last step that had news
        self._seen: dict[Any, tuple[int, int]] = {}

    def __len__(self) -> int:
        return len(self._by_request)

    def of(self, request: Any) -> BlockHashes:
        """``request.block_hashes`` as a :class:`~kvfunc.BlockHashes` (cached per request)."""
        digests = request.block_hashes
        n = len(digests)
        got = self._by_request.get(request.request_id)
        if got is not None:
            m, value = got
            last = value._digests[m - 1] if m else None  # the value's own last digest
            if m == n and (not n or last == digests[n - 1]):
                return value
            if m < n and (not m or last == digests[m - 1]):
                self._covered(request, n)
                value = value.extended(digests[m:], None)
                self._by_request[request.request_id] = (n, value)
                return value
        self._covered(request, n)
        value = BlockHashes.of_digests(digests, None, self._block_size)
        self._by_request[request.request_id] = (n, value)
        return value

    def _covered(self, request: Any, n: int) -> None:
        """A typed error unless the request's tokens fill the blocks its ``n`` digests name."""
        if n * self._block_size > len(request.all_token_ids):
            msg = (f"{n} block hashes cover {n * self._block_size} tokens; request "
                   f"{excerpt(request.request_id)} has {len(request.all_token_ids)}")
            raise InvalidArgumentError(msg)

    def for_step(self, request: Any, written: int) -> BlockHashes | None:
        """The hashes a step that writes up to ``written`` tokens may cache with, or None.

        A step can cache a block only when a block filled or a digest arrived
        since the request's last step that had either: other steps need no
        hashes (kvfunc then caches nothing, exactly as it would with them).

        >>> from types import SimpleNamespace
        >>> r = SimpleNamespace(request_id="a", block_hashes=[b"h0"], all_token_ids=[1, 2, 3])
        >>> cache = RequestHashes(2)
        >>> cache.for_step(r, 3) is not None, cache.for_step(r, 3)
        (True, None)
        """
        news = (len(request.block_hashes), written // self._block_size)
        if self._seen.get(request.request_id) == news:
            return None
        value = self.of(request)  # a refused conversion leaves nothing seen
        self._seen[request.request_id] = news
        return value

    def note(self, request: Any, written: int) -> None:
        """A step that writes up to ``written`` tokens and cannot cache (no block fills):
        its news counts as seen, as :meth:`for_step` would count them, without the hashes
        it would not use.

        >>> from types import SimpleNamespace
        >>> r = SimpleNamespace(request_id="a", block_hashes=[b"h0"], all_token_ids=[1, 2, 3])
        >>> cache = RequestHashes(2)
        >>> cache.note(r, 3)
        >>> cache.for_step(r, 3)
        """
        self._seen[request.request_id] = (len(request.block_hashes), written // self._block_size)

    def unsee(self, request_id: Any) -> None:
        """The step that :meth:`for_step` answered did not happen (it was refused)."""
        self._seen.pop(request_id, None)

    def drop(self, request_id: Any) -> None:
        """Forget a request's converted hashes (it holds no blocks any more)."""
        self._by_request.pop(request_id, None)
        self._seen.pop(request_id, None)

    def clear(self) -> None:
        """Forget every request's converted hashes (a restored state, a reset)."""
        self._by_request.clear()
        self._seen.clear()
