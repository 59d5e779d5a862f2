"""vLLM's KV cache configuration as a kvfunc state, and what kvfunc does not model.

Theory of operation
-------------------
vLLM 0.33 gives its manager a ``KVCacheConfig``: ``num_blocks`` blocks in one
pool and one ``KVCacheGroupSpec`` per attention group.  kvfunc mirrors it as
one :class:`~kvfunc.KVState` with the shared layout: one pool of
``num_blocks`` blocks (block 0 is vLLM's null block as well as kvfunc's) and
one kvfunc group per vLLM group, in vLLM's order, keyed ``"group0"``,
``"group1"`` ...::

    vLLM                                   kvfunc
    FullAttentionSpec / MLAAttentionSpec   FullAttention(num_blocks, block_size)
    SlidingWindowSpec (+ MLA)              SlidingWindow(num_blocks, block_size, sliding_window)

The state always counts references and keeps vLLM's free queue (it is
created with ``enable_prefix_caching=True``).  With vLLM's prefix caching off
the manager never passes block hashes, so nothing is ever cached: freed
blocks go back to the front of the queue and are reused last in, first out,
and a sliding-window prefill holds a block for every token until the window
slides past it, as vLLM's own manager does.

Everything else vLLM's manager can do is refused here, when the manager is
built, with :class:`NotModelledError` naming the feature: a scheduler never
meets it in the middle of serving.
"""

from __future__ import annotations

from typing import Any

import attrs

from kvfunc.core import (
    MAX_NUM_BLOCKS,
    FullAttention,
    KVState,
    NotSupportedError,
    SlidingWindow,
)

__all__ = ["Layout", "NotModelledError", "plan_layout"]


class NotModelledError(NotSupportedError):
    """vLLM asked for a feature kvfunc's manager does not model (raised at construction).

    >>> issubclass(NotModelledError, NotImplementedError)
    True
    """


def refuse(feature: str, detail: str = "") -> NotModelledError:
    """The error for a feature kvfunc does not model (the message names it).

    >>> str(refuse("EAGLE", "use_eagle=True"))
    "kvfunc's vLLM KV cache manager does not model EAGLE (use_eagle=True); ..."
    """
    shown = f" ({detail})" if detail else ""
    return NotModelledError(
        f"kvfunc's vLLM KV cache manager does not model {feature}{shown}; run this "
        "configuration with vLLM's own manager (unset KVFUNC_VLLM)")


@attrs.frozen(slots=True)
class Layout:
    """How one vLLM ``KVCacheConfig`` maps onto kvfunc groups.

    Attributes:
        keys: the kvfunc manager key of each vLLM group, in vLLM's order.
        specs: each group's vLLM ``KVCacheSpec``.
        block_size: tokens per block (every group's, and the hashes').
        windows: each group's sliding window in tokens, ``None`` for full attention.
        caps: vLLM's admission cap in blocks per group (sliding windows), or ``None``.
        num_blocks: blocks in the one pool, the null block included.
        max_model_len: vLLM's ``max_model_len``.
    """

    keys: tuple[str, ...]
    specs: tuple[Any, ...]
    block_size: int
    windows: tuple[int | None, ...]
    caps: tuple[int | None, ...]
    num_blocks: int
    max_model_len: int

    def initial_state(self) -> KVState:
        """A fresh kvfunc state for this layout (every block free)."""
        groups: dict[str, Any] = {
            key: FullAttention(num_blocks=self.num_blocks, block_size=self.block_size)
            if window is None else
            SlidingWindow(num_blocks=self.num_blocks, block_size=self.block_size,
                          sliding_window=window)
            for key, window in zip(self.keys, self.windows, strict=True)}
        return KVState.create(groups, self.max_model_len, enable_prefix_caching=True,
                              layout="shared")


def _group_window(spec: Any) -> int | None:
    """A group's window (``None``: full attention), or a refusal naming its spec."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowMLASpec,
        SlidingWindowSpec,
    )

    name = type(spec).__name__
    if isinstance(spec, MambaSpec):
        mode = getattr(spec, "mamba_cache_mode", "none")
        raise refuse("Mamba 'align' mode" if mode == "align" else "Mamba state groups",
                     f"{name}, mamba_cache_mode={mode!r}")
    if type(spec) not in (FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec,
                          SlidingWindowMLASpec):
        raise refuse(f"the {name} KV cache spec",
                     "only full attention and sliding windows are modelled")
    if not spec.prefix_cacheable or spec.prefix_replay_tokens:
        raise refuse("bounded prefix replay", name)
    if spec.tokens_per_state != 1:
        raise refuse("compressed KV states", f"{name}, tokens_per_state={spec.tokens_per_state}")
    if isinstance(spec, SlidingWindowSpec):
        if spec.extra_retained_tokens:
            raise refuse("extra retained sliding-window tokens",
                         f"extra_retained_tokens={spec.extra_retained_tokens}")
        window: int = spec.sliding_window
        return window
    return None


def _check_config(config: Any) -> None:
    """Refuse what the ``KVCacheConfig`` asks for beyond plain groups of one pool."""
    if config.hisparse_host_num_blocks is not None:
        raise refuse("HiSparse", "hisparse_host_num_blocks is set")
    for i, group in enumerate(config.kv_cache_groups):
        if getattr(group.role, "value", group.role) != "default" or group.host_resident:
            raise refuse("HiSparse", f"group {i} has role {group.role!r}")
        if group.is_eagle_group:
            raise refuse("EAGLE", f"group {i} is an EAGLE draft group")
    n = config.num_blocks
    if type(n) is not int or not 2 <= n <= MAX_NUM_BLOCKS:
        raise refuse("a pool of this size", f"num_blocks={n!r}, kvfunc takes 2..{MAX_NUM_BLOCKS}")
    if not config.kv_cache_groups:
        raise refuse("a model without KV cache groups")


def _check_options(options: dict[str, Any]) -> None:
    """Refuse the constructor options that switch on what kvfunc does not model."""
    if options["use_eagle"]:
        raise refuse("EAGLE", "use_eagle=True: the last-block drop of prefix-cache hits")
    if options["num_hash_lookahead_tokens"]:
        raise refuse("lookahead block hashing",
                     f"num_hash_lookahead_tokens={options['num_hash_lookahead_tokens']}")
    if options["num_prefill_lookahead"] > 1:
        raise refuse("multi-module MTP",
                     f"num_prefill_lookahead={options['num_prefill_lookahead']}")
    if options["pcp_world_size"] != 1:
        raise refuse("prefill context parallelism",
                     f"pcp_world_size={options['pcp_world_size']}")


def _block_size(spec: Any, window: int | None, dcp: int) -> int:
    """A group's block size in tokens: decode context parallelism shards each block."""
    if dcp == 1 or not spec.dcp_sharded:
        size: int = spec.block_size
        return size
    if window is not None:
        raise refuse("decode context parallelism with sliding windows",
                     f"dcp_world_size={dcp}")
    return int(spec.block_size) * dcp


def plan_layout(config: Any, *, max_model_len: int, max_in_flight_tokens: int,
                scheduler_block_size: int, hash_block_size: int, **options: Any) -> Layout:
    """The :class:`Layout` of a vLLM ``KVCacheConfig``, or :class:`NotModelledError`.

    ``options`` are the rest of vLLM's ``KVCacheManager`` constructor arguments
    that can switch on a feature (``use_eagle``, ``num_hash_lookahead_tokens``,
    ``num_prefill_lookahead``, ``dcp_world_size``, ``pcp_world_size``).  With
    decode context parallelism a full-attention block holds ``dcp_world_size``
    times its spec's tokens (each rank keeps its share), as in vLLM.
    """
    _check_options(options)
    _check_config(config)
    specs = tuple(g.kv_cache_spec for g in config.kv_cache_groups)
    windows = tuple(_group_window(spec) for spec in specs)
    dcp = options["dcp_world_size"]
    sizes = {_block_size(spec, w, dcp) for spec, w in zip(specs, windows, strict=True)}
    sizes |= {scheduler_block_size, hash_block_size}
    if len(sizes) != 1:
        raise refuse("groups or hashes of different block sizes",
                     f"block sizes {sorted(sizes)}")
    from vllm.v1.core.kv_cache_coordinator import _validate_prefix_cache_retention_interval

    _validate_prefix_cache_retention_interval(  # vLLM's own check of the setting
        config.prefix_cache_retention_interval, scheduler_block_size, config)
    if config.prefix_cache_retention_interval is not None and any(
            w is not None for w in windows):
        raise refuse("sparse prefix-cache retention",
                     f"prefix_cache_retention_interval={config.prefix_cache_retention_interval}")
    if config.cache_hit_alignment_tokens not in (None, scheduler_block_size):
        raise refuse("sub-block cache hit alignment",
                     f"cache_hit_alignment_tokens={config.cache_hit_alignment_tokens}")
    caps = tuple(None if w is None else spec.max_admission_blocks_per_request(
        max_in_flight_tokens=max_in_flight_tokens, max_model_len=max_model_len)
        for spec, w in zip(specs, windows, strict=True))
    keys = tuple(f"group{i}" for i in range(len(specs)))
    return Layout(keys, specs, scheduler_block_size, windows, caps, config.num_blocks,
                  max_model_len)
