"""The seed's ``KVCacheManager``: a thin stateful facade over the pure core.

It keeps one transient over the current :class:`~kvfunc.KVState` and runs
the core's per-request step on it, so a call costs what mutable code costs;
:attr:`KVCacheManager.state` materialises the current immutable state, and
:meth:`snapshot` / :meth:`restore` are O(number of groups).  The one
deliberate difference from the seed: a refused ``allocate_slots`` changes
nothing at all (the seed recycled sliding-window blocks before refusing).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any

from kvfunc.compat._managers import SingleTypeKVCacheManager
from kvfunc.compat._store import Store
from kvfunc.core import (
    InvalidArgumentError,
    InvalidTypeError,
    KVState,
    MissingTensorError,
    NotSupportedError,
)
from kvfunc.core._internal import (
    check_manager_keys,
    check_request_id,
    excerpt,
    fold,
    free_into,
    quiet,
    row_table,
    slot_entry,
    usage_string,
)

__all__ = ["KVCacheManager"]


class KVCacheManager:
    """All single-type managers of a model behind the seed's API.

    >>> from kvfunc.compat import FullAttentionManager, SlidingWindowManager
    >>> mgr = KVCacheManager(1024, [
    ...     FullAttentionManager("FullAttention", 12, 16),
    ...     SlidingWindowManager("SlidingWindow", 10, 16, sliding_window=32)], None)
    >>> mgr.allocate_slots("r1", 0, 70)
    True
    >>> mgr.get_block_ids("r1")
    {'FullAttention': [1, 2, 3, 4, 5], 'SlidingWindow': [0, 0, 1, 2, 3]}
    >>> mgr.format_usage()
    'FullAttention:6/12,SlidingWindow:4/10'
    """

    def __init__(self, max_model_len: int, single_type_managers: Iterable[SingleTypeKVCacheManager],
                 cache_info: Any) -> None:
        if type(max_model_len) is not int or max_model_len < 0:
            msg = f"max_model_len must be a non-negative int, but got {excerpt(max_model_len)}"
            raise InvalidArgumentError(msg)
        if isinstance(single_type_managers, str | bytes) or not isinstance(
                single_type_managers, Iterable):
            msg = (f"single_type_managers must be an iterable of SingleTypeKVCacheManager, but "
                   f"got {excerpt(single_type_managers)}")
            raise InvalidTypeError(msg)
        managers = tuple(single_type_managers)
        for m in managers:
            if not isinstance(m, SingleTypeKVCacheManager):
                msg = f"expected SingleTypeKVCacheManager instances, got {type(m).__name__}"
                raise InvalidTypeError(msg)
        keys = [m.manager_key for m in managers]
        if len(set(keys)) != len(keys):
            msg = f"manager keys must be unique, got {excerpt(keys)}"
            raise InvalidArgumentError(msg)
        self.max_model_len = max_model_len
        self.single_type_managers = managers
        self.num_attn_types = len({m.attn_type for m in managers})
        self.num_managers = len(managers)
        self.cache_info = cache_info
        self.is_mla_backend = bool(getattr(cache_info, "is_mla_backend", False))
        self._store = Store(_compose(max_model_len, managers))
        for i, m in enumerate(managers):
            m._bind(self._store, i)
        self._abstract = tuple(m.manager_key for m in managers if type(m)._abstract)

    # -- state ----------------------------------------------------------------
    @property
    def state(self) -> KVState:
        """The current state as an immutable :class:`~kvfunc.KVState`."""
        return self._store.state

    def snapshot(self) -> KVState:
        """The current state; keep it to :meth:`restore` later (O(1) per group)."""
        return self._store.state

    def restore(self, state: KVState) -> None:
        """Make an earlier (or replayed) state current; its groups must match."""
        self._store.restore(state)

    # -- allocation -----------------------------------------------------------
    def allocate_slots(self, request_id: Any, computed_tokens: int, num_new_tokens: int,
                       lookahead_tokens: int = 0, reserved_tokens: int = 0,
                       manager_keys: Collection[str] | None = None) -> bool:
        """The seed's two-phase allocation; a refusal (``False``) changes nothing.

        Counts must be non-negative ints (not bools, not None); a bad argument
        raises a typed error and changes nothing.
        """
        if (manager_keys is None and type(lookahead_tokens) is int
                and type(reserved_tokens) is int and not reserved_tokens and not self._abstract):
            # the plain form, with the step's lookahead: the fold checks the rest
            tr = self._store.tr
            if quiet(tr.views, tr.max_model_len, tr.checked, request_id, computed_tokens,
                     num_new_tokens, lookahead_tokens, None):
                return True  # the lane, without a fold
            return not fold(tr, ((request_id, computed_tokens, num_new_tokens),), None,
                            lookahead_tokens)
        if self._abstract:
            keys = check_manager_keys(manager_keys)
            if any(keys is None or k in keys for k in self._abstract):
                raise NotSupportedError("Subclasses must implement get_num_skipped_tokens")
        entry = slot_entry(request_id, computed_tokens, num_new_tokens, lookahead_tokens,
                           reserved_tokens, manager_keys)  # checked by the fold
        return not fold(self._store.tr, (entry,))

    def free(self, request_id: Any) -> None:
        """Release a request in every manager; unknown or freed ids are a no-op."""
        check_request_id(request_id)
        free_into(self._store.tr, request_id, None)

    # -- queries --------------------------------------------------------------
    def get_block_ids(self, request_id: Any) -> dict[str, list[int]]:
        """``{manager_key: block ids}`` in manager order (snapshot lists)."""
        check_request_id(request_id)
        out = {}
        for view in self._store.tr.views:
            row = view.rows.get(request_id)
            out[view.key] = [] if row is None else list(row_table(row))
        return out

    def get_request_owner_manager_keys(self, is_owner: bool) -> set[str]:
        """Every key for the owner, else only the Mamba keys."""
        return {m.manager_key for m in self.single_type_managers
                if is_owner or m.attn_type == "Mamba"}

    def get_block_sizes(self) -> dict[str, int]:
        """``{manager_key: block_size}``."""
        return {m.manager_key: m.block_size for m in self.single_type_managers}

    def get_block_table_max_lens(self, max_model_len: int) -> dict[str, int]:
        """``{manager_key: ceil(max_model_len / block_size)}`` (compression ignored)."""
        if type(max_model_len) is not int:
            msg = f"max_model_len must be an int, but got {excerpt(max_model_len)}"
            raise InvalidTypeError(msg)
        if max_model_len < 0:
            msg = f"max_model_len must be non-negative, but got {excerpt(max_model_len)}"
            raise InvalidArgumentError(msg)
        return {m.manager_key: -(-max_model_len // m.block_size)
                for m in self.single_type_managers}

    def format_usage(self) -> str:
        """``"key:used/num_blocks,..."``; the null block counts as used."""
        tr = self._store.tr
        return usage_string((g.key, g.policy.num_blocks, tr.free_count(tr.group_pool[i]))
                            for i, g in enumerate(tr.views))

    def get_contiguous_buf_infos(self) -> tuple[list[int], list[int], list[int], list[str],
                                                list[int]]:
        """``(data_ptrs, data_lens, item_lens, attn_types, block_sizes)`` of every paged tensor.

        Ordered by layer index (stable), then cache definition order: both
        sides of a prefill/decode pair compute it independently and pair the
        entries by position.

        Raises:
            NotSupportedError: a Mamba cache, or a tensor that is not contiguous
                (caches made with ``layout="block"`` or a shared pool's views).
            MissingTensorError: a paged cache has no tensor.
        """
        ptrs: list[int] = []
        lens: list[int] = []
        item_lens: list[int] = []
        keys: list[str] = []
        block_sizes: list[int] = []
        info = self.cache_info
        layers = sorted(info.layer_infos, key=lambda layer: layer.layer_idx) if info else []
        for layer in layers:
            for cache in layer.caches:
                if not cache.needs_block:
                    continue
                if cache.attn_type == "Mamba":
                    msg = ("PD disaggregation does not support Mamba state cache yet: cache "
                           f"{cache.cache_name} in layer {layer.layer_idx}.")
                    raise NotSupportedError(msg)
                tensor = cache.tensor
                if tensor is None:
                    msg = (f"CacheEntry {cache.cache_name} in layer {layer.layer_idx} has no "
                           "tensor \u2014 allocate_cache_tensors must run first.")
                    raise MissingTensorError(msg)
                if not tensor.is_contiguous():
                    msg = (f"cache {cache.cache_name} in layer {layer.layer_idx} is not one "
                           "contiguous tensor (a block-major or shared-pool view, blocks "
                           f"{tensor.stride(0) * tensor.element_size()} bytes apart): a "
                           "contiguous buffer description cannot address its blocks")
                    raise NotSupportedError(msg)
                bs = cache.storage_block_size
                size = tensor.element_size()
                ptrs.append(tensor.data_ptr())
                lens.append(tensor.numel() * size)
                item_lens.append(bs * cache.num_head * cache.cache_dim_numel() * size)
                keys.append(cache.group_key)
                block_sizes.append(bs)
        return ptrs, lens, item_lens, keys, block_sizes

    def __repr__(self) -> str:
        return f"KVCacheManager(max_model_len={self.max_model_len}, usage={self.format_usage()!r})"


def _compose(max_model_len: int, managers: tuple[SingleTypeKVCacheManager, ...]) -> KVState:
    """One state holding every manager's group and pool (a pool per manager, in order)."""
    parts = [m._parts() for m in managers]
    groups = tuple(g._replace(pool=i) for i, (g, _) in enumerate(parts))
    seq = max((m._store.tr.seq for m in managers), default=0)
    return KVState(max_model_len, tuple(p for _, p in parts), groups, seq)

