"""One error hierarchy for the whole library.

Every class derives from :class:`KVFuncError` *and* from the builtin that the
seed module raises in the same situation, so code written against the seed
(``except ValueError``) keeps working unchanged.
"""

from __future__ import annotations

__all__ = [
    "BlockIndexError",
    "DoubleFreeError",
    "InsufficientMemoryError",
    "InvalidArgumentError",
    "InvalidCacheInfo",
    "InvalidTypeError",
    "KVFuncError",
    "MissingKeyError",
    "MissingTensorError",
    "NotSupportedError",
    "OutOfBlocksError",
    "ReplayMismatchError",
    "UnknownAttentionTypeError",
    "UnknownRequestError",
]


class KVFuncError(Exception):
    """Root of every error raised on purpose by kvfunc."""


class InvalidArgumentError(KVFuncError, ValueError):
    """An argument has the right type but a value the operation cannot accept."""


class InvalidTypeError(KVFuncError, TypeError):
    """An argument has the wrong type (for example a float token count)."""


class InvalidCacheInfo(KVFuncError, ValueError):
    """A cache description (``ModelCacheInfo`` and its entries) is inconsistent."""


class UnknownAttentionTypeError(KVFuncError, ValueError):
    """An attention type has no registered policy."""


class BlockIndexError(KVFuncError, IndexError):
    """A block id lies outside ``[0, num_blocks)``."""


class DoubleFreeError(KVFuncError, ValueError):
    """A block is freed while it is already free."""


class OutOfBlocksError(KVFuncError, ValueError):
    """More blocks were taken from a pool than it holds free (seed: ``ValueError``)."""


class UnknownRequestError(KVFuncError, KeyError):
    """An operation needs a request that is not registered."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else ""


class MissingKeyError(KVFuncError, KeyError):
    """A mapping lacks a required manager key (seed: ``KeyError``)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class InsufficientMemoryError(KVFuncError, MemoryError):
    """The memory budget cannot hold what sizing was asked for."""


class NotSupportedError(KVFuncError, NotImplementedError):
    """The operation is not supported for this configuration."""


class MissingTensorError(KVFuncError, RuntimeError):
    """A cache entry has no tensor yet (seed: ``RuntimeError``)."""


class ReplayMismatchError(KVFuncError, ValueError):
    """A delta does not apply to the state it is replayed on."""
