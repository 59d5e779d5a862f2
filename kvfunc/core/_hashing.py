"""Block hashes: chained digests of full blocks of token ids, computed incrementally.

Theory of operation
-------------------
A request's prefix is identified block by block.  Block ``i`` (tokens
``i*bs .. (i+1)*bs - 1``) gets the digest of the previous block's digest and
its own token ids, so a block's hash names the *whole* prefix up to its end::

    root = H("kvfunc.prefix/1" | cache_salt | extra_keys)
    h0   = H(root | tokens[0:bs])
    h1   = H(h0   | tokens[bs:2bs])        h1 == h1' only if both prefixes are equal
    ...

Two requests share block ``i`` exactly when their first ``(i+1)*bs`` tokens,
their extra keys (a LoRA id, a multimodal hash) and their cache salt (a
tenant) are equal.  Token ids are packed as little-endian signed 64-bit
integers, so the digests are the same on every machine and process (never
Python's ``hash``).

Digest functions, by measurement (``benchmarks/bench_prefix.py``): hashlib's
``sha256`` (the default; collision-resistant, so one tenant cannot forge a
block that another tenant's request would read) costs 1-2 us per 16-token
block on a 2-core machine, packing included; ``xxh3_128`` (PyPI ``xxhash``,
the ``fast-hash`` extra) costs about half; its 128 bits make an accidental
collision negligible (~2^-64 after 2^32 blocks) but it is not
collision-resistant against a chosen input, so use it only where every
prompt comes from one trusted tenant.  ``blake2b`` (256-bit,
hashlib) is the cryptographic alternative.

A :class:`BlockHashes` is a value: :meth:`BlockHashes.update` returns a new
one with the blocks that became full, and returns ``self`` when none did,
so it can be called after every token at the cost of one comparison; an
engine that calls it only when a block fills (``len(tokens) % block_size``)
hashes each block once and does nothing per token otherwise.
Successive values of one request share two append-only lists (digests and
tokens; digests alone without tokens); a value owns their first ``num_blocks``
entries and never reads past them, and ``update`` appends in place only when
nothing was appended after its own (else copies them), so extending a
request by one block costs O(1), not a copy of every earlier digest.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Sequence
from typing import Any

import attrs

from kvfunc.core._checks import excerpt
from kvfunc.core._digests import (
    _CONSTRUCTORS,
    _PACKERS,
    _TAG,
    EXTERNAL,
    HASH_FUNCTIONS,
    BlockHash,
    _chain,
    _checked,
    _digest_list,
    _encode_key,
    _index,
    _pack,
    _packer,
    _positive_size,
    _token_list,
    checked_blocks,
    hash_function,
    kept_tokens,
    no_tokens,
    only_ints,
    token_slice,
)
from kvfunc.core._errors import InvalidArgumentError, InvalidTypeError, NotSupportedError

__all__ = ["HASH_FUNCTIONS", "BlockHash", "BlockHashes", "hash_function"]

_APPEND = threading.Lock()  # guards the check-then-append on a shared lineage
_set = object.__setattr__
_new_hashes = object.__new__


class BlockHashes:
    """The chained hashes of a request's full blocks (see the module docstring).

    Attributes:
        block_size: tokens per hashed block.  Every caching group's block
            size must be a multiple of it (a group block of ``m`` hashed
            blocks is named by the hash of its last one).
        hash_fn: a name from :data:`HASH_FUNCTIONS`.
        root: the digest the first block chains from (salt and extra keys).
        num_blocks: full blocks hashed.
        num_tokens: tokens covered by the hashed full blocks.
        hashes: one digest per full block, in order (a tuple, built on access).
        blocks: the token ids of each of those blocks (built on access;
            refused for hashes kept without tokens).

    >>> h = BlockHashes.of(range(40), block_size=16)
    >>> len(h.hashes), h.num_tokens
    (2, 32)
    >>> h.update(range(47)) is h      # no new full block: the same value
    True
    >>> len(h.update(range(48)).hashes)
    3
    >>> BlockHashes.of(range(32), 16).hashes == h.hashes
    True
    >>> BlockHashes.of(range(32), 16, cache_salt="tenant-b").hashes == h.hashes
    False
    """

    # ``_digests`` / ``_tokens``: the lineage's shared lists (this value's entries first);
    # ``_end``: the sequence length at which the next block is full.
    __slots__ = ("_digests", "_end", "_tokens", "block_size", "hash_fn", "num_blocks",
                 "num_tokens", "root")

    block_size: int
    hash_fn: str
    root: bytes
    num_blocks: int
    num_tokens: int  # a field, not a property: the fold's lane reads it on every decode
    _digests: list[BlockHash]
    _tokens: list[int] | None  # None: hashes computed elsewhere, kept without tokens
    _end: int

    def __init__(self, block_size: int, hash_fn: str, root: bytes,
                 hashes: Sequence[BlockHash] = (),
                 blocks: Sequence[Sequence[int]] = ()) -> None:
        digests, tokens = checked_blocks(block_size, hash_fn, root, hashes, blocks)
        self._fill(block_size, hash_fn, root, digests, tokens, len(digests))

    def _fill(self, block_size: int, hash_fn: str, root: bytes, digests: list[BlockHash],
              tokens: list[int] | None, num_blocks: int) -> None:
        _set(self, "block_size", block_size)
        _set(self, "hash_fn", hash_fn)
        _set(self, "root", root)
        _set(self, "num_blocks", num_blocks)
        _set(self, "_digests", digests)
        _set(self, "_tokens", tokens)
        _set(self, "num_tokens", num_blocks * block_size)
        _set(self, "_end", (num_blocks + 1) * block_size)

    @classmethod
    def _make(cls, block_size: int, hash_fn: str, root: bytes, digests: list[BlockHash],
              tokens: list[int], num_blocks: int) -> BlockHashes:
        """A value owning the first ``num_blocks`` entries of the shared lists."""
        value = cls.__new__(cls)
        value._fill(block_size, hash_fn, root, digests, tokens, num_blocks)
        return value

    def __setattr__(self, name: str, value: object) -> None:
        raise attrs.exceptions.FrozenInstanceError

    def __delattr__(self, name: str) -> None:
        raise attrs.exceptions.FrozenInstanceError

    def __eq__(self, other: object) -> bool:
        if type(other) is not BlockHashes:
            return NotImplemented
        n = self.num_blocks
        return ((self.block_size, self.hash_fn, self.root, n)
                == (other.block_size, other.hash_fn, other.root, other.num_blocks)
                and self._digests[:n] == other._digests[:n])

    def __hash__(self) -> int:
        return hash((self.block_size, self.hash_fn, self.root, self.hashes))

    def __repr__(self) -> str:
        return (f"BlockHashes(block_size={self.block_size}, hash_fn={self.hash_fn!r}, "
                f"num_blocks={self.num_blocks})")

    def __reduce__(self) -> tuple[Any, ...]:
        if self._tokens is None:
            return (BlockHashes.of_digests, (self.hashes, None, self.block_size))
        return (BlockHashes, (self.block_size, self.hash_fn, self.root, self.hashes,
                              self.blocks))

    @classmethod
    def of(cls, token_ids: Sequence[int], block_size: int, *, hash_fn: str = "sha256",
           extra_keys: Sequence[str | bytes | int] = (),
           cache_salt: str | bytes | None = None) -> BlockHashes:
        """Hash the full blocks of ``token_ids``.

        ``extra_keys`` (a LoRA name, multimodal hashes) and ``cache_salt`` (a
        tenant) enter every block's hash through the root, so requests that
        differ in them never share blocks.

        Raises:
            InvalidArgumentError: ``block_size`` is not a positive int, or an
                unknown ``hash_fn``.
            InvalidTypeError: token ids, extra keys or salt of a wrong type.

        >>> BlockHashes.of([1, 2, 3], 2).hashes[0].hex()[:8]
        '23d3d67d'
        """
        fn = _checked(block_size, hash_fn)
        _token_list(token_ids)
        if isinstance(extra_keys, str | bytes) or not isinstance(extra_keys, Sequence):
            msg = f"extra_keys must be a sequence of keys, got {excerpt(extra_keys)}"
            raise InvalidTypeError(msg)
        seed = [_TAG]
        seed.append(b"-" if cache_salt is None else _encode_key(cache_salt))
        seed.extend(_encode_key(k) for k in extra_keys)
        value = cls._make(block_size, hash_fn, fn(b"".join(seed)), [], [], 0).update(token_ids)
        tail = token_ids[value.num_tokens:]  # the partial last block: checked, hashed later
        if tail:
            _pack(tail)
        return value

    @property
    def hashes(self) -> tuple[BlockHash, ...]:
        """One digest per full block, in order."""
        return tuple(self._digests[:self.num_blocks])

    @property
    def blocks(self) -> tuple[tuple[int, ...], ...]:
        """The token ids of each hashed block."""
        return tuple(self.token_ids_by_block(0, self.num_blocks, self.block_size))

    def update(self, token_ids: Sequence[int]) -> BlockHashes:
        """Hash the blocks that became full; ``token_ids`` is the request's whole sequence.

        The sequence must extend the one hashed so far (prompt, then the
        generated tokens); only the tokens after :attr:`num_tokens` are read.

        >>> h = BlockHashes.of([], 2)
        >>> h.update([5, 6, 7, 8, 9]).blocks
        ((5, 6), (7, 8))
        >>> h.update([5, "x"])
        Traceback (most recent call last):
        ...
        kvfunc.core._errors.InvalidTypeError: token ids must be ints in the int64 range, got 'x'
        """
        try:
            if len(token_ids) < self._end:  # no new full block: the common decode step
                return self
        except TypeError:  # no len(): not a sequence (None, an int, an iterator)
            _token_list(token_ids)
            raise
        bs, n, hash_fn = self.block_size, self.num_blocks, self.hash_fn
        if hash_fn == EXTERNAL:
            msg = "these hashes were computed elsewhere: extend them with extended()"
            raise NotSupportedError(msg)
        _token_list(token_ids)
        full = len(token_ids) // bs
        fresh = token_ids[n * bs:full * bs]
        parent = self._digests[n - 1] if n else self.root
        ctor = _CONSTRUCTORS.get(hash_fn)
        if full == n + 1 and ctor is not None:  # one block filled: the decode step
            packer = _PACKERS.get(bs) or _packer(bs)
            try:
                out = [ctor(parent + packer(*fresh)).digest()]
            except struct.error:
                _pack(fresh)  # raises the precise error
                raise
            if not only_ints(fresh):
                _pack(fresh)  # refuses the bool or int subclass
        else:
            out = _chain(hash_fn, ctor, parent, _pack(fresh), 8 * bs)
        digests, tokens = self._digests, self._tokens  # hashed here: tokens are kept
        with _APPEND:
            if len(digests) == n:  # nothing appended after our entries: extend in place
                digests.extend(out)
                tokens.extend(fresh)  # type: ignore[union-attr]
                out = None  # type: ignore[assignment]
        if out is not None:  # another value of the lineage went on: copy our entries
            digests, tokens = digests[:n] + out, tokens[:n * bs]  # type: ignore[index]
            tokens.extend(fresh)
        value = _new_hashes(BlockHashes)
        value._fill(bs, hash_fn, self.root, digests, tokens, full)
        return value

    @classmethod
    def of_digests(cls, digests: Sequence[BlockHash], token_ids: Sequence[int] | None,
                   block_size: int) -> BlockHashes:
        """Hashes computed elsewhere (an engine's own block hasher), with or without tokens.

        ``digests[i]`` names the prefix that ends with block ``i`` of
        ``token_ids``; every digest needs its full block of tokens.  The
        value's ``hash_fn`` is ``"external"``: :meth:`extended` adds later
        blocks' digests, :meth:`update` (which would hash) is refused.

        With ``token_ids=None`` the value keeps no tokens (kvfunc never reads
        them to look a block up or cache it; an engine that reports them in
        its own KV events passes none, and nothing is checked or copied per
        token); it refuses the token reads, and extends with ``None``.

        >>> h = BlockHashes.of_digests([b"d0", b"d1"], list(range(9)), 4)
        >>> h.num_tokens, h.hash_fn, h.blocks[1]
        (8, 'external', (4, 5, 6, 7))
        >>> BlockHashes.of_digests([b"d0", b"d1"], None, 4) == h
        True
        """
        _positive_size(block_size)
        empty = _new_hashes(BlockHashes)  # what ``cls(block_size, "external", b"")`` makes
        empty._fill(block_size, EXTERNAL, b"", [], None if token_ids is None else [], 0)
        return empty.extended(digests, token_ids)

    def extended(self, digests: Sequence[BlockHash],
                 token_ids: Sequence[int] | None) -> BlockHashes:
        """These hashes with ``digests`` appended for the next full blocks of ``token_ids``.

        ``token_ids`` is the request's whole sequence; it must hold a full
        block for each new digest (``None`` for hashes that keep no tokens).
        Only values made by :meth:`of_digests` are extended this way.

        >>> h = BlockHashes.of_digests([b"d0"], [1, 2, 3, 4], 4)
        >>> h.extended([b"d1"], [1, 2, 3, 4, 5, 6, 7, 8]).hashes
        (b'd0', b'd1')
        >>> BlockHashes.of_digests([b"d0"], None, 4).extended([b"d1"], None).num_tokens
        8
        """
        if self.hash_fn != EXTERNAL:
            raise NotSupportedError("only hashes computed elsewhere are extended; use update()")
        new = _digest_list(digests)
        tokens = kept_tokens(self._tokens, token_ids)
        k = len(new)
        if not k:
            if tokens is not None:
                _token_list(token_ids)
            return self
        bs, n = self.block_size, self.num_blocks
        if tokens is not None:
            fresh = token_slice(token_ids, n * bs, k * bs)
            _pack(fresh)  # ints in the int64 range, no bools
        digests_ = self._digests
        with _APPEND:
            if len(digests_) == n:
                digests_.extend(new)
                if tokens is not None:
                    tokens.extend(fresh)
                new = []
        if new:
            digests_ = digests_[:n] + new
            if tokens is not None:
                tokens = tokens[:n * bs] + fresh
        value = _new_hashes(BlockHashes)
        value._fill(bs, EXTERNAL, self.root, digests_, tokens, n + k)
        return value

    def parent_hash(self, index: int) -> BlockHash | None:
        """The hash block ``index`` chains from (``None`` for the first block).

        >>> h = BlockHashes.of(range(4), 2)
        >>> h.parent_hash(0), h.parent_hash(1) == h.hashes[0]
        (None, True)
        """
        if type(index) is int and 0 < index <= self.num_blocks:
            return self._digests[index - 1]
        if index == 0 and type(index) is int:
            return None
        _index(index)
        return self.hashes[_index(index - 1, self.num_blocks - 1)]  # tuple indexing (negative)

    def token_ids_by_block(self, first: int, last: int, size: int) -> list[tuple[int, ...]]:
        """The token ids of blocks ``first .. last-1`` of ``size`` tokens, a tuple each.

        ``size`` is a multiple of :attr:`block_size` (a group's block size)
        and the blocks must be hashed.

        >>> BlockHashes.of(range(12), 2).token_ids_by_block(1, 3, 4)
        [(4, 5, 6, 7), (8, 9, 10, 11)]
        """
        if self._tokens is None:
            raise no_tokens()
        if not (_index(first) >= 0 and _index(last) >= first and _index(size) > 0
                and size % self.block_size == 0 and last * size <= self.num_tokens):
            msg = (f"blocks {excerpt(first)}..{excerpt(last)} of {excerpt(size)} tokens are not "
                   f"hashed ({excerpt(self.num_tokens)} tokens in blocks of "
                   f"{excerpt(self.block_size)})")
            raise InvalidArgumentError(msg)
        run = iter(self._tokens[first * size:last * size])  # our entries only
        return list(zip(*[run] * size, strict=True))  # ``size`` tokens at a time

    def block_token_ids(self, index: int, count: int = 1) -> tuple[int, ...]:
        """The token ids of ``count`` hashed blocks from block ``index`` on.

        >>> BlockHashes.of(range(6), 2).block_token_ids(1, 2)
        (2, 3, 4, 5)
        """
        if type(index) is not int or type(count) is not int:
            _index(index)
            _index(count)
        if self._tokens is None:
            raise no_tokens()
        if 0 <= index and index + count <= self.num_blocks:
            bs = self.block_size
            return tuple(self._tokens[index * bs:(index + count) * bs])
        if count == 1:  # tuple indexing and slicing, as a tuple of blocks gives
            return self.blocks[_index(index, self.num_blocks - 1)]
        return tuple(t for block in self.blocks[index:index + count] for t in block)


def check_block_hashes(value: Any) -> BlockHashes:
    """``value`` if it is a :class:`BlockHashes`, else a typed error."""
    if not isinstance(value, BlockHashes):
        msg = f"block_hashes must be a BlockHashes, got {type(value).__name__}"
        raise InvalidTypeError(msg)
    return value
