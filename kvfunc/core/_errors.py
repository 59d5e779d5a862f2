"""One error hierarchy for the whole library.

Every class derives from :class:`KVFuncError` *and* from the builtin that the
seed module raises in the same situation, so code written against the seed
(``except ValueError``) keeps working unchanged.
"""

from __future__ import annotations

import enum

__all__ = [
    "BlockIndexError",
    "DoubleFreeError",
    "InsufficientMemoryError",
    "InvalidArgumentError",
    "InvalidCacheInfo",
    "InvalidTypeError",
    "KVFuncError",
    "LLMError",
    "LLMStatusCode",
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


class LLMStatusCode(enum.Enum):
    """LLM-DataDist status codes; every DataDist error carries one.

    >>> LLMStatusCode.LLM_KV_CACHE_NOT_EXIST.name
    'LLM_KV_CACHE_NOT_EXIST'
    """

    LLM_SUCCESS = 0
    LLM_FAILED = 1
    LLM_WAIT_PROCESS_TIMEOUT = 2
    LLM_KV_CACHE_NOT_EXIST = 3
    LLM_PARAM_INVALID = 4
    LLM_DEVICE_OUT_OF_MEMORY = 5
    LLM_OUT_OF_MEMORY = 6
    LLM_NOT_YET_LINK = 7
    LLM_ALREADY_LINK = 8
    LLM_LINK_FAILED = 9
    LLM_LINK_BUSY = 10
    LLM_CLUSTER_NUM_EXCEED_LIMIT = 11
    LLM_FEATURE_NOT_ENABLED = 12
    LLM_TIMEOUT = 13
    LLM_UNKNOWN_ERROR = 14


class LLMError(KVFuncError):
    """A DataDist operation failed; ``status_code`` says how (``LLMStatusCode``).

    >>> e = LLMError(LLMStatusCode.LLM_NOT_YET_LINK, "cluster 2 is not linked")
    >>> e.status_code, str(e)
    (<LLMStatusCode.LLM_NOT_YET_LINK: 7>, 'LLM_NOT_YET_LINK: cluster 2 is not linked')
    """

    def __init__(self, status_code: LLMStatusCode, message: str) -> None:
        super().__init__(f"{status_code.name}: {message}")
        self.status_code = status_code
