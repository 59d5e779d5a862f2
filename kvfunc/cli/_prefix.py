"""Prefix caching in the simulator: token ids made up from hash ids, hashed once per request.

Theory of operation
-------------------
A Mooncake trace names each prompt's blocks of 512 tokens by id, never by
content.  The simulator makes the content up, deterministically::

    prompt position p  ->  hash_ids[p // 512] * 512 + p % 512      (>= 0)
    generated token g  ->  -1 - g - request_index * 2**32           (< 0)

The same id always gives the same 512 tokens and different ids give
different ones, and a partial last block takes a prefix of its id's tokens.
So two prompts share exactly the tokens the trace says they share, and
kvfunc's chained block hashes (:class:`kvfunc.BlockHashes`) find that sharing
at any block size.  Generated tokens are the request's own: the next turn of
a conversation carries them under its own hash ids.

:class:`PrefixCacher` keeps each live request's :class:`kvfunc.BlockHashes`
from its first admission to its end: a prompt is hashed once, extended block
by block as the request decodes, and reused when a preempted request is
admitted again.  Token ids are never stored for a whole trace: a
:class:`SyntheticTokens` view computes the ones a hash needs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from math import gcd
from types import MappingProxyType
from typing import overload

from kvfunc.cli._mooncake import HASH_BLOCK_TOKENS
from kvfunc.cli._trace import TraceRequest
from kvfunc.core import BlockHashes, KVState, PrefixHit, RequestId, lookup_prefix

__all__ = ["PrefixCacher", "SyntheticTokens", "hash_block_size"]

_GENERATED_STRIDE = 2**32  # generated tokens of one request: fewer than this (max_model_len)


class SyntheticTokens(Sequence[int]):
    """The first ``length`` token ids of request ``index`` (see the module docstring).

    >>> t = SyntheticTokens((7, 9), 600, 3, 602)
    >>> t[0], t[511], t[512], t[599], t[600]
    (3584, 4095, 4608, 4695, -12884901889)
    >>> t[510:514]
    [4094, 4095, 4608, 4609]
    """

    __slots__ = ("_ids", "_index", "_length", "_prompt")

    def __init__(self, hash_ids: Sequence[int], prompt_tokens: int, index: int,
                 length: int) -> None:
        self._ids = hash_ids
        self._prompt = prompt_tokens
        self._index = index
        self._length = length

    def __len__(self) -> int:
        return self._length

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        if isinstance(index, slice):
            start, stop, stride = index.indices(self._length)
            if stride != 1:
                return [self[i] for i in range(start, stop, stride)]
            return self._run(start, max(start, stop))
        if index < 0:
            index += self._length
        if not 0 <= index < self._length:
            raise IndexError(index)
        return self._run(index, index + 1)[0]

    def _run(self, start: int, stop: int) -> list[int]:
        out: list[int] = []
        bs, ids = HASH_BLOCK_TOKENS, self._ids
        pos, end = start, min(stop, self._prompt)
        while pos < end:  # prompt tokens, one hash block at a time
            block, offset = divmod(pos, bs)
            upto = min(end, (block + 1) * bs)
            base = ids[block] * bs
            out.extend(range(base + offset, base + offset + upto - pos))
            pos = upto
        if stop > pos:  # generated tokens
            first = -1 - self._index * _GENERATED_STRIDE
            out.extend(range(first - (pos - self._prompt), first - (stop - self._prompt), -1))
        return out


def hash_block_size(state: KVState) -> int:
    """The block size to hash at: the gcd of the groups' block sizes (it divides each one).

    >>> from kvfunc.core import FullAttention, SlidingWindow
    >>> hash_block_size(KVState.create({"f": FullAttention(num_blocks=4, block_size=64),
    ...     "w": SlidingWindow(num_blocks=4, block_size=16, sliding_window=32)}, 64))
    16
    """
    size = 0
    for g in state.groups:
        size = gcd(size, g.policy.block_size)
    return size or 1


class PrefixCacher:
    """Each live request's block hashes, its lookups, and the hit counters.

    Attributes:
        prompt_tokens: prompt tokens of the requests admitted so far (first
            admissions only).
        hit_tokens: of those, the tokens found cached at first admission.
        recompute_hit_tokens: tokens found cached when a preempted request
            was admitted again (recomputation the cache saved).

    >>> from kvfunc.core import FullAttention, allocate_slots
    >>> s = KVState.create({"f": FullAttention(num_blocks=64, block_size=16)}, 4096,
    ...                    enable_prefix_caching=True)
    >>> reqs = [TraceRequest(0.0, 700, 2, (1, 2)), TraceRequest(0.0, 600, 2, (1, 3))]
    >>> cacher = PrefixCacher(reqs, 16)
    >>> s = allocate_slots(s, 0, 0, 700, block_hashes=cacher.hashes(0, 700)).state
    >>> cacher.lookup(s, 1, 600).num_tokens      # the shared first 512 tokens
    512
    """

    def __init__(self, requests: Sequence[TraceRequest], block_size: int, *,
                 hash_fn: str = "sha256") -> None:
        self._requests = requests
        self.block_size = block_size
        self.hash_fn = hash_fn
        self._hashes: dict[RequestId, BlockHashes] = {}  # keyed by the requests' indices
        self._live = MappingProxyType(self._hashes)
        self.prompt_tokens = self.hit_tokens = self.recompute_hit_tokens = 0

    @property
    def live(self) -> Mapping[RequestId, BlockHashes]:
        """Every live request's hashes, as far as :meth:`hashes` extended them (read-only).

        A step passes it as ``allocate_batch``'s ``block_hashes``: the core reads
        a request's hashes only where its step fills a block.
        """
        return self._live

    def hashes(self, rid: int, length: int) -> BlockHashes:
        """Request ``rid``'s hashes covering its first ``length`` tokens' full blocks."""
        h = self._hashes.get(rid)
        if h is None or length >= h.num_tokens + self.block_size:
            r = self._requests[rid]
            tokens = SyntheticTokens(r.hash_ids, r.prompt_tokens, rid, length)
            h = (BlockHashes.of(tokens, self.block_size, hash_fn=self.hash_fn) if h is None
                 else h.update(tokens))
            self._hashes[rid] = h
        return h

    def lookup(self, state: KVState, rid: int, length: int) -> PrefixHit:
        """The cached prefix of ``rid``'s first ``length`` tokens, leaving one to compute."""
        return lookup_prefix(state, self.hashes(rid, length), max_tokens=length - 1)

    def admitted(self, rid: int, hit: PrefixHit, *, again: bool) -> None:
        """Count an admission with ``hit``; ``again`` after a preemption."""
        if again:
            self.recompute_hit_tokens += hit.num_tokens
        else:
            self.prompt_tokens += self._requests[rid].prompt_tokens
            self.hit_tokens += hit.num_tokens

    def release(self, rid: int) -> None:
        """Forget a finished request's hashes."""
        self._hashes.pop(rid, None)
