"""What kvfunc does not model is refused when the manager is built, naming the feature."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)

from kvfunc.vllm import KVCacheManager, ManagerInternalsError, NotModelledError
from kvfunc.vllm.harness import kv_cache_config

FULL = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=1, dtype=torch.float32)


def build(specs: list[Any] | None = None, *, config: Any = None, **kwargs: Any) -> Any:
    """A kvfunc manager over groups of ``specs`` (block size 16)."""
    if config is None:
        config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[
            KVCacheGroupSpec([f"l{i}"], s) for i, s in enumerate(specs or [FULL])])
    options: dict[str, Any] = {"max_model_len": 1024, "scheduler_block_size": 16,
                               "hash_block_size": 16}
    options.update(kwargs)
    return KVCacheManager(config, **options)


def mamba(mode: str) -> MambaSpec:
    return MambaSpec(block_size=16, shapes=((2, 8),), dtypes=(torch.float32,),
                     mamba_cache_mode=mode)


REFUSED = [
    ("EAGLE", {"use_eagle": True}, None),
    ("lookahead block hashing", {"num_hash_lookahead_tokens": 2}, None),
    ("multi-module MTP", {"num_prefill_lookahead": 3}, None),
    ("prefill context parallelism", {"pcp_world_size": 2}, None),
    ("Mamba 'align' mode", {}, [FULL, mamba("align")]),
    ("Mamba state groups", {}, [FULL, mamba("none")]),
    ("the CrossAttentionSpec KV cache spec", {},
     [FULL, CrossAttentionSpec(block_size=16, num_kv_heads=1, head_size=1,
                               dtype=torch.float32)]),
    ("the ChunkedLocalAttentionSpec KV cache spec", {},
     [ChunkedLocalAttentionSpec(block_size=16, num_kv_heads=1, head_size=1,
                                dtype=torch.float32, attention_chunk_size=64)]),
    ("groups or hashes of different block sizes", {}, [FULL, replace(FULL, block_size=32)]),
    ("extra retained sliding-window tokens", {},
     [FULL, SlidingWindowSpec(block_size=16, num_kv_heads=1, head_size=1, dtype=torch.float32,
                              sliding_window=64, extra_retained_tokens=3)]),
]


@pytest.mark.parametrize(("feature", "options", "specs"), REFUSED,
                         ids=[r[0] for r in REFUSED])
def test_feature_is_refused_by_name(feature: str, options: dict[str, Any],
                                    specs: list[Any] | None) -> None:
    """Each feature kvfunc does not model raises NotModelledError naming it, at construction."""
    with pytest.raises(NotModelledError, match=f"does not model {feature}"):
        build(specs, **options)


def test_hisparse_is_refused() -> None:
    """A HiSparse host pool is refused by name."""
    config = replace(kv_cache_config(64, 16), hisparse_host_num_blocks=8)
    with pytest.raises(NotModelledError, match="does not model HiSparse"):
        build(config=config)


def test_sparse_retention_with_windows_is_refused() -> None:
    """Sparse prefix-cache retention under sliding windows is refused by name."""
    config = replace(kv_cache_config(64, 16, (None, 64)), prefix_cache_retention_interval=32)
    with pytest.raises(NotModelledError, match="sparse prefix-cache retention"):
        build(config=config)


def test_decode_context_parallelism_scales_full_attention_blocks() -> None:
    """With DCP a full-attention block holds dcp_world_size times the spec's tokens, as in vLLM."""
    m = build(scheduler_block_size=64, hash_block_size=64, dcp_world_size=4)
    assert 64 == m.coordinator.single_type_managers[0].block_size


def test_manager_internals_are_named_when_read() -> None:
    """Reading an internal of vLLM's own manager raises an AttributeError that names it."""
    m = build()
    with pytest.raises(ManagerInternalsError, match=r"no block_pool\.free_block_queue"):
        _ = m.block_pool.free_block_queue
    assert not hasattr(m.coordinator, "req_to_blocks")
