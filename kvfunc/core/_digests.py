"""Digest functions and the packing of token ids and extra keys into hashed bytes.

The pieces :class:`kvfunc.core.BlockHashes` chains: the named digest
functions, the little-endian int64 packing of token ids (a bool or an
out-of-range int is a typed error), the tagged encoding of extra keys and
cache salts, and the checks on block indices and given digest lists.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Callable, Sequence
from typing import Any

from kvfunc.core._checks import excerpt
from kvfunc.core._errors import (
    BlockIndexError,
    InvalidArgumentError,
    InvalidTypeError,
    NotSupportedError,
)

__all__ = ["EXTERNAL", "HASH_FUNCTIONS", "BlockHash", "hash_function"]

BlockHash = bytes
HASH_FUNCTIONS = ("sha256", "blake2b", "xxh3_128")
#: The ``hash_fn`` of hashes computed elsewhere (:meth:`BlockHashes.of_digests`).
EXTERNAL = "external"
_TAG = b"kvfunc.prefix/1"


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _blake2b(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=32).digest()


# hashlib constructors, called directly in the hashing loop (one call per block fewer)
_CONSTRUCTORS: dict[str, Callable[[bytes], Any]] = {
    "sha256": hashlib.sha256, "blake2b": functools.partial(hashlib.blake2b, digest_size=32)}


def hash_function(name: str) -> Callable[[bytes], bytes]:
    """The digest function called ``name`` (one of :data:`HASH_FUNCTIONS`).

    Raises:
        InvalidArgumentError: ``name`` is not a known function.
        NotSupportedError: ``xxh3_128`` without the ``xxhash`` package.

    >>> len(hash_function("sha256")(b"abc"))
    32
    >>> hash_function("md5")
    Traceback (most recent call last):
    ...
    kvfunc.core._errors.InvalidArgumentError: unknown hash function 'md5'; ...
    """
    if name == "sha256":
        return _sha256
    if name == "blake2b":
        return _blake2b
    if name == "xxh3_128":
        try:
            import xxhash
        except ImportError:
            msg = ("hash function 'xxh3_128' needs the xxhash package "
                   "(pip install kvfunc[fast-hash])")
            raise NotSupportedError(msg) from None
        fn: Callable[[bytes], bytes] = xxhash.xxh3_128_digest
        return fn
    msg = f"unknown hash function {excerpt(name)}; choose one of {list(HASH_FUNCTIONS)}"
    raise InvalidArgumentError(msg)


_KEY_TYPES = (str, bytes, int)


def _encode_key(key: object) -> bytes:
    """One extra key as tagged, length-prefixed bytes (so keys never run together)."""
    if type(key) not in _KEY_TYPES:  # not bool, nor a subclass whose str() could lie
        msg = f"extra keys and the cache salt must be str, bytes or int, got {excerpt(key)}"
        raise InvalidTypeError(msg)
    if type(key) is str:
        tag, raw = b"s", key.encode()
    elif type(key) is bytes:
        tag, raw = b"b", key
    else:
        tag, raw = b"i", str(key).encode()
    return tag + struct.pack("<I", len(raw)) + raw


def _pack(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian int64 bytes; anything else (a bool too) is a typed error."""
    n = len(token_ids)
    try:  # struct packs a list 2-3x faster than array("q") converts it
        data = (_PACKERS.get(n) or _packer(n))(*token_ids)
    except struct.error:
        bad = next((t for t in token_ids if not _is_int64(t)), None)
        msg = f"token ids must be ints in the int64 range, got {excerpt(bad)}"
        raise InvalidTypeError(msg) from None
    if not only_ints(token_ids):  # struct packs True as 1, and any int subclass: refuse them
        bad = next(t for t in token_ids if type(t) is not int)
        msg = f"token ids must be ints in the int64 range, got {excerpt(bad)}"
        raise InvalidTypeError(msg)
    return data


_INT = frozenset((int,))


def only_ints(token_ids: Sequence[int]) -> bool:
    """Whether every token is an ``int`` itself (no bool, no subclass whose value could lie)."""
    return set(map(type, token_ids)) <= _INT


def _token_list(token_ids: object) -> Sequence[int]:
    """``token_ids`` if it is a sequence (not text), else a typed error."""
    if type(token_ids) is list or type(token_ids) is tuple:  # the common case, without the ABC
        return token_ids
    if isinstance(token_ids, str | bytes) or not isinstance(token_ids, Sequence):
        msg = f"token_ids must be a sequence of ints, got {excerpt(token_ids)}"
        raise InvalidTypeError(msg)
    return token_ids


def token_slice(token_ids: object, start: int, count: int) -> list[int]:
    """``token_ids[start:start + count]`` as a new list, read as the slice says (not past it).

    Anything not sliceable, text, or a slice of another length is a typed
    error (the ints themselves are the caller's to check).

    >>> token_slice((1, 2, 3, 4), 1, 2)
    [2, 3]
    >>> token_slice([1, 2], 0, 4)
    Traceback (most recent call last):
    ...
    kvfunc.core._errors.InvalidArgumentError: 4 tokens from 0 needed, got 2
    """
    try:
        fresh = token_ids[start:start + count]  # type: ignore[index]
    except (TypeError, KeyError, IndexError, ValueError):  # no slices: not a sequence
        _token_list(token_ids)
        raise InvalidTypeError(f"token_ids must be a sequence of ints, got "
                               f"{excerpt(token_ids)}") from None
    if type(fresh) is not list:  # a tuple's slice, or another sequence's
        _token_list(token_ids)  # text is a typed error
        _token_list(fresh)
    if len(fresh) != count:
        raise InvalidArgumentError(f"{count} tokens from {start} needed, got {len(fresh)}")
    return fresh if type(fresh) is list else [fresh[i] for i in range(count)]  # no more reads


_PACKERS: dict[int, Callable[..., bytes]] = {}


def _packer(block_size: int) -> Callable[..., bytes]:
    """``struct.pack`` for ``block_size`` tokens (kept for at most 1,024 sizes)."""
    packer = struct.Struct(f"<{block_size}q").pack
    if len(_PACKERS) < 1024:
        _PACKERS[block_size] = packer
    return packer


def _chain(hash_fn: str, ctor: Callable[[bytes], Any] | None, parent: bytes, data: bytes,
           width: int) -> list[bytes]:
    """The chained digests of the ``width``-byte blocks of ``data``, from ``parent``."""
    out = []
    if ctor is not None:
        for i in range(0, len(data), width):
            parent = ctor(parent + data[i:i + width]).digest()
            out.append(parent)
    else:
        fn = hash_function(hash_fn)
        for i in range(0, len(data), width):
            parent = fn(parent + data[i:i + width])
            out.append(parent)
    return out


def _is_int64(value: object) -> bool:
    try:
        struct.pack("<q", value)
    except struct.error:
        return False
    return True


def _checked(block_size: int, hash_fn: str) -> Callable[[bytes], bytes]:
    """The hash function of a valid block size and name; a typed error otherwise."""
    _positive_size(block_size)
    return hash_function(hash_fn)  # a known name, or a typed error


def _positive_size(block_size: object) -> None:
    """A typed error unless ``block_size`` is a positive int (not a bool)."""
    if type(block_size) is not int or block_size <= 0:
        msg = f"block_size must be a positive int, got {excerpt(block_size)}"
        raise InvalidArgumentError(msg)



def _index(value: object, last: int | None = None) -> int:
    """``value`` if it is an int (not a bool) and, given ``last``, indexes ``0..last`` as a
    tuple of ``last + 1`` items does (negative from the end); else a typed error."""
    if type(value) is not int:
        raise InvalidTypeError(f"a block index must be an int, got {excerpt(value)}")
    if last is not None and not -last - 1 <= value <= last:
        raise BlockIndexError(f"block index {excerpt(value)} is out of range for {last + 1} blocks")
    return value


def _digest_list(hashes: object) -> list[BlockHash]:
    """``hashes`` as a list of non-empty ``bytes`` digests, else a typed error."""
    if type(hashes) is not list and (isinstance(hashes, str | bytes)
                                     or not isinstance(hashes, Sequence)):
        raise InvalidTypeError(f"hashes must be a sequence of bytes digests, got "
                               f"{excerpt(hashes)}")
    digests = list(hashes)
    for h in digests:
        if type(h) is not bytes or not h:
            raise InvalidTypeError(f"a block hash must be non-empty bytes, got {excerpt(h)}")
    return digests


def checked_blocks(block_size: int, hash_fn: str, root: bytes, hashes: object,
                   blocks: object) -> tuple[list[BlockHash], list[int]]:
    """The digests and the tokens, block after block, that ``BlockHashes(...)`` is given,
    checked: a typed error unless they are a valid value (a chain of ``hash_fn`` from ``root``,
    unless the hashes were computed elsewhere)."""
    if hash_fn != EXTERNAL:
        _checked(block_size, hash_fn)
    else:
        _positive_size(block_size)
    if type(root) is not bytes:
        raise InvalidTypeError(f"root must be bytes, got {excerpt(root)}")
    digests = _digest_list(hashes)
    if isinstance(blocks, str | bytes) or not isinstance(blocks, Sequence):
        raise InvalidTypeError(f"blocks must be a sequence of token blocks, got "
                               f"{excerpt(blocks)}")
    if len(blocks) != len(digests):
        msg = (f"{len(digests)} hashes need their {len(digests)} token blocks, got "
               f"{len(blocks)}")
        raise InvalidArgumentError(msg)
    tokens: list[int] = []
    for block in blocks:
        if len(_token_list(block)) != block_size:
            msg = f"a token block must hold {excerpt(block_size)} tokens, got {excerpt(block)}"
            raise InvalidArgumentError(msg)
        tokens.extend(block)
    data = _pack(tokens)  # ints in range, no bools
    if hash_fn != EXTERNAL and digests != _chain(hash_fn, _CONSTRUCTORS.get(hash_fn), root,
                                                 data, 8 * block_size):
        msg = (f"the {len(digests)} hashes are not the {hash_fn} chain of their token "
               "blocks from root")
        raise InvalidArgumentError(msg)
    return digests, tokens


def no_tokens() -> NotSupportedError:
    """The error of a token read from hashes that keep no tokens."""
    return NotSupportedError("these hashes keep no tokens (made with token_ids=None)")


def kept_tokens(tokens: list[int] | None, token_ids: object) -> list[int] | None:
    """``tokens`` (what hashes keep) when ``token_ids`` extends them as they are kept (None
    for hashes that keep none); a typed error otherwise."""
    if (token_ids is None) is (tokens is None):
        return tokens
    if tokens is not None:
        raise InvalidArgumentError("these hashes keep their tokens: extend them with the "
                                   "request's token ids, not None")
    raise InvalidArgumentError("these hashes keep no tokens: extend them with token_ids=None")
