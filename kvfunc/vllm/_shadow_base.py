"""Shadow mode's two managers, its comparisons and its report of the first divergence.

:class:`ShadowBase` builds vLLM's ``KVCacheManager`` (the primary: every
answer the scheduler gets is its answer) and kvfunc's
:class:`~kvfunc.vllm.KVCacheManager` (the mirror) from the same arguments.
The mirrored calls (``_shadow``) run on both and compare through
:meth:`ShadowBase._check`.  The first difference, or any error of the
mirror, stops the mirror and is kept as a
:class:`~kvfunc.vllm.Divergence`; serving goes on with the primary.
Anything else the scheduler or a test reads (the block pool's and the
coordinator's internals) is the primary's.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from kvfunc.vllm._base import logger
from kvfunc.vllm._layout import NotModelledError
from kvfunc.vllm._manager import KVCacheManager
from kvfunc.vllm._shadow_log import Divergence, DivergenceError, Recorder

__all__ = ["ShadowBase", "ShadowPool"]


class ShadowBase:
    """The primary, the mirror and how they are compared (see the module docstring).

    Takes vLLM's ``KVCacheManager`` arguments, plus ``strict`` (raise
    :class:`~kvfunc.vllm.DivergenceError` at the first divergence).  For a
    configuration kvfunc does not model nothing is mirrored (vLLM's manager
    serves alone) and :attr:`not_mirrored` says why.
    """

    def __init__(self, *args: Any, strict: bool = False, **kwargs: Any) -> None:
        from kvfunc.vllm._plugin import vllm_manager_class

        self._primary = vllm_manager_class()(*args, **kwargs)
        self._strict = strict
        self.divergence: Divergence | None = None
        self.block_pool = ShadowPool(self, self._primary.block_pool)
        self._mirror: KVCacheManager | None = None
        #: why nothing is mirrored (a configuration kvfunc does not model), or None
        self.not_mirrored: str | None = None
        try:
            mirror = KVCacheManager(*args, **kwargs)
        except NotModelledError as exc:
            self.not_mirrored = str(exc)
            logger.warning("kvfunc shadow mode mirrors nothing: %s", exc)
            return
        self._mirror = mirror
        self._recorder = Recorder(mirror.snapshot())
        mirror._journal = self._recorder.transition

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_primary", "_mirror"):
            raise AttributeError(name)
        return getattr(self._primary, name)

    @property
    def primary(self) -> Any:
        """vLLM's own manager (it answers every call)."""
        return self._primary

    @property
    def mirror(self) -> KVCacheManager | None:
        """kvfunc's manager, or None once it diverged."""
        return self._mirror

    @property
    def usage(self) -> float:
        """vLLM's usage."""
        return float(self._primary.usage)

    def _mirrored(self, call: str, fn: Callable[[KVCacheManager], Any]) -> Any:
        """``fn(mirror)`` unless the mirror stopped; an error of kvfunc's is a divergence."""
        mirror = self._mirror
        if mirror is None:
            return None
        self._recorder.call(call)
        try:
            out = fn(mirror)
        except Exception as exc:  # any failure of the mirror is a finding, never fatal
            self._diverged(call, f"kvfunc raised {type(exc).__name__}: {exc}")
            return None
        self._recorder.boundary(mirror.snapshot())
        return out

    def _check(self, call: str, what: str, ours: Any, theirs: Any) -> bool:
        """Compare one answer; a difference is the divergence."""
        if self._mirror is None or ours == theirs:
            return True
        self._diverged(call, f"{what}: vLLM {theirs!r}, kvfunc {ours!r}")
        return False

    def _check_counts(self, call: str) -> None:
        """Free blocks and usage agree after a call that changed the cache."""
        mirror = self._mirror
        if mirror is not None and self._check(
                call, "free blocks", mirror.num_free_blocks,
                self._primary.block_pool.get_num_free_blocks()):
            self._check(call, "usage", mirror.usage, self._primary.usage)

    def _diverged(self, call: str, what: str) -> None:
        mirror = self._mirror
        if mirror is None:
            return
        self._mirror = None
        found = self.divergence = self._recorder.divergence(call, what, mirror.snapshot())
        logger.warning("kvfunc shadow mode: %s", found)
        folder = os.environ.get("KVFUNC_VLLM_SHADOW_LOG")
        if folder:
            path = found.write(Path(folder) / f"kvfunc-shadow-{os.getpid()}-{id(self):x}.jsonl")
            logger.warning("kvfunc shadow mode: delta log written to %s", path)
        if self._strict:
            raise DivergenceError(str(found))

    def _to_mirror(self, blocks: Any) -> Any:
        """The mirror's ``KVCacheBlocks`` holding the block ids of the primary's."""
        mirror = self._mirror
        if blocks is None or mirror is None:
            return blocks
        handles = mirror._handles.blocks
        return mirror.create_kv_cache_blocks(tuple(
            handles([b.block_id for b in g]) for g in blocks.blocks))

    def free_blocks(self, ordered_blocks: Iterable[Any]) -> None:
        """``block_pool.free_blocks``: vLLM's deferred free, and kvfunc's ``free_detached``."""
        blocks = list(ordered_blocks)
        self._primary.block_pool.free_blocks(blocks)
        call = f"block_pool.free_blocks({[b.block_id for b in blocks]})"
        self._mirrored(call, lambda m: m.free_detached_blocks(
            m._handles.blocks([b.block_id for b in blocks])))
        self._check_counts(call)

    def evict_blocks(self, block_ids: set[int]) -> None:
        """Evict on both."""
        ids = list(block_ids)
        self._primary.evict_blocks(block_ids)
        call = f"evict_blocks({ids})"
        self._mirrored(call, lambda m: m.evict_blocks(set(ids)))
        self._check_counts(call)


class ShadowPool:
    """The primary's block pool, with the calls that change it mirrored."""

    def __init__(self, shadow: ShadowBase, pool: Any) -> None:
        self._shadow = shadow
        self._pool = pool

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_shadow", "_pool"):
            raise AttributeError(name)
        return getattr(self._pool, name)

    def free_blocks(self, ordered_blocks: Iterable[Any]) -> None:
        """vLLM's deferred free, mirrored as kvfunc's ``free_detached``."""
        self._shadow.free_blocks(ordered_blocks)

    def evict_blocks(self, block_ids: set[int]) -> None:
        """vLLM's eviction, mirrored."""
        self._shadow.evict_blocks(block_ids)
