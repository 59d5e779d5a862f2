"""DataDist errors: one class per status code, each also a builtin.

Every class derives from :class:`kvfunc.LLMError` (so it carries a
``status_code``) and, where one fits, from the builtin an ordinary Python
caller would catch (``ValueError`` for bad arguments, ``MemoryError`` for an
exhausted pool, ``TimeoutError`` for a transfer that did not finish).
:func:`error_for` rebuilds the right class from a status code, which is how
an error the peer reports over the control channel reaches the caller.

Pure: no torch.
"""

from __future__ import annotations

from kvfunc.core import LLMError, LLMStatusCode

__all__ = [
    "AlreadyLinkedError",
    "CacheNotExistError",
    "ClusterNumExceedError",
    "CodedError",
    "DataDistFailedError",
    "FeatureNotEnabledError",
    "InvalidParamError",
    "LinkFailedError",
    "NotLinkedError",
    "PeerProtocolError",
    "PoolOutOfMemoryError",
    "TransferTimeoutError",
    "error_for",
]


class CodedError(LLMError):
    """An :class:`LLMError` whose status code is fixed by its class (overridable)."""

    code = LLMStatusCode.LLM_FAILED

    def __init__(self, message: str, *, status_code: LLMStatusCode | None = None) -> None:
        super().__init__(status_code or self.code, message)

    def __str__(self) -> str:  # KeyError would quote the message; keep it readable
        return str(self.args[0]) if self.args else ""


class InvalidParamError(CodedError, ValueError):
    """A bad argument: wrong type or value, mismatched descs, wrong role (LLM_PARAM_INVALID)."""

    code = LLMStatusCode.LLM_PARAM_INVALID


class PoolOutOfMemoryError(CodedError, MemoryError):
    """The memory pool cannot hold the cache (LLM_DEVICE_OUT_OF_MEMORY)."""

    code = LLMStatusCode.LLM_DEVICE_OUT_OF_MEMORY


class CacheNotExistError(CodedError, KeyError):
    """No cache under that key or id: never made, already pulled or removed."""

    code = LLMStatusCode.LLM_KV_CACHE_NOT_EXIST


class TransferTimeoutError(CodedError, TimeoutError):
    """A transfer did not finish in time; the link is broken (LLM_WAIT_PROCESS_TIMEOUT)."""

    code = LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT


class NotLinkedError(CodedError, ConnectionError):
    """The cluster is not linked (LLM_NOT_YET_LINK)."""

    code = LLMStatusCode.LLM_NOT_YET_LINK


class AlreadyLinkedError(CodedError, ConnectionError):
    """The cluster is already linked (LLM_ALREADY_LINK)."""

    code = LLMStatusCode.LLM_ALREADY_LINK


class LinkFailedError(CodedError, ConnectionError):
    """A link could not be made, or an earlier failure broke it (LLM_LINK_FAILED)."""

    code = LLMStatusCode.LLM_LINK_FAILED


class PeerProtocolError(LinkFailedError):
    """The peer broke the link's protocol (a malformed, oversize or unexpected message);
    the link is broken (LLM_LINK_FAILED)."""


class ClusterNumExceedError(CodedError, ValueError):
    """More clusters in one link or unlink call than allowed (LLM_CLUSTER_NUM_EXCEED_LIMIT)."""

    code = LLMStatusCode.LLM_CLUSTER_NUM_EXCEED_LIMIT


class FeatureNotEnabledError(CodedError, NotImplementedError):
    """A feature this instance was not configured for (LLM_FEATURE_NOT_ENABLED)."""

    code = LLMStatusCode.LLM_FEATURE_NOT_ENABLED


class DataDistFailedError(CodedError, RuntimeError):
    """Any other failure (LLM_FAILED, LLM_UNKNOWN_ERROR, ...)."""

    code = LLMStatusCode.LLM_FAILED


_BY_CODE: dict[LLMStatusCode, type[CodedError]] = {
    LLMStatusCode.LLM_PARAM_INVALID: InvalidParamError,
    LLMStatusCode.LLM_DEVICE_OUT_OF_MEMORY: PoolOutOfMemoryError,
    LLMStatusCode.LLM_OUT_OF_MEMORY: PoolOutOfMemoryError,
    LLMStatusCode.LLM_KV_CACHE_NOT_EXIST: CacheNotExistError,
    LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT: TransferTimeoutError,
    LLMStatusCode.LLM_TIMEOUT: TransferTimeoutError,
    LLMStatusCode.LLM_NOT_YET_LINK: NotLinkedError,
    LLMStatusCode.LLM_ALREADY_LINK: AlreadyLinkedError,
    LLMStatusCode.LLM_LINK_FAILED: LinkFailedError,
    LLMStatusCode.LLM_LINK_BUSY: LinkFailedError,
    LLMStatusCode.LLM_CLUSTER_NUM_EXCEED_LIMIT: ClusterNumExceedError,
    LLMStatusCode.LLM_FEATURE_NOT_ENABLED: FeatureNotEnabledError,
}


def error_for(status_code: LLMStatusCode, message: str) -> LLMError:
    """The error class that stands for ``status_code``, carrying that code.

    >>> e = error_for(LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, "no key 7")
    >>> type(e).__name__, e.status_code.name, isinstance(e, KeyError)
    ('CacheNotExistError', 'LLM_KV_CACHE_NOT_EXIST', True)
    """
    cls = _BY_CODE.get(status_code, DataDistFailedError)
    return cls(message, status_code=status_code)
