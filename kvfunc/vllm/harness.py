"""A small vLLM scheduler to try kvfunc's manager on: no model, no GPU, fake model outputs.

vLLM's ``Scheduler`` needs a model configuration, a KV cache configuration
and, after every ``schedule()``, the model's output.  This module makes each
from a few numbers, for examples, tests and benchmarks:

* :func:`kv_cache_config`: vLLM's ``KVCacheConfig`` of full-attention and
  sliding-window groups in one pool;
* :func:`build_scheduler`: vLLM's ``Scheduler`` (or ``AsyncScheduler``) for a
  tiny OPT-shaped model (a ``config.json`` only, written once to a temporary
  directory), with the manager asked for: ``"kvfunc"``, ``"vllm"`` or
  ``"shadow"``;
* :func:`make_request`: a vLLM ``Request`` whose block hashes vLLM computes;
* :func:`model_output`: a fake ``ModelRunnerOutput`` that samples one token
  per scheduled request (none for a non-final prefill chunk).

Every function imports vLLM when called.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["build_scheduler", "kv_cache_config", "make_request", "model_output"]

_MODEL = {"activation_function": "relu", "architectures": ["OPTForCausalLM"],
          "bos_token_id": 2, "eos_token_id": 2, "pad_token_id": 1, "model_type": "opt",
          "torch_dtype": "float16", "vocab_size": 50272, "max_position_embeddings": 65536,
          "do_layer_norm_before": True, "ffn_dim": 256, "hidden_size": 64,
          "num_attention_heads": 4, "num_hidden_layers": 2, "word_embed_proj_dim": 64,
          "dropout": 0.0}
_HASHER: list[Callable[[Any], Any]] = []


def kv_cache_config(num_blocks: int, block_size: int = 16,
                    windows: Sequence[int | None] = (None,)) -> Any:
    """vLLM's ``KVCacheConfig``: one pool of ``num_blocks``, a group per window.

    ``None`` in ``windows`` is a full-attention group, an int a sliding
    window of that many tokens.
    """
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    def spec(window: int | None) -> Any:
        if window is None:
            return FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1,
                                     dtype=torch.float32)
        return SlidingWindowSpec(block_size=block_size, num_kv_heads=1, head_size=1,
                                 dtype=torch.float32, sliding_window=window)

    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec([f"layer{i}"], spec(w)) for i, w in enumerate(windows)])


def _model_dir() -> str:
    """A directory holding the tiny model's ``config.json`` (written once)."""
    path = Path(tempfile.gettempdir()) / "kvfunc-vllm-tiny-opt"
    config = path / "config.json"
    if not config.exists():
        path.mkdir(parents=True, exist_ok=True)
        config.write_text(json.dumps(_MODEL))
    return str(path)


def build_scheduler(config: Any, *, manager: str = "kvfunc", max_model_len: int = 8192,
                    max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                    enable_prefix_caching: bool = True, async_scheduling: bool = False) -> Any:
    """vLLM's scheduler over ``config`` (a ``KVCacheConfig``) with the manager asked for.

    ``manager`` is ``"kvfunc"``, ``"vllm"`` or ``"shadow"``; whatever
    :func:`~kvfunc.vllm.install` set up before is restored afterwards.
    """
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    from vllm.v1.structured_output import StructuredOutputManager

    from kvfunc.vllm._plugin import install, installed_mode, uninstall

    block_size = config.kv_cache_groups[0].kv_cache_spec.block_size
    model = ModelConfig(model=_model_dir(), skip_tokenizer_init=True, dtype="float16",
                        max_model_len=max_model_len, seed=0)
    vllm_config = VllmConfig(
        model_config=model, cache_config=CacheConfig(
            block_size=block_size, enable_prefix_caching=enable_prefix_caching),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len, is_encoder_decoder=False,
            async_scheduling=async_scheduling))
    vllm_config.cache_config.num_gpu_blocks = config.num_blocks
    register_all_kvcache_specs(vllm_config)
    before = installed_mode()
    _switch(manager, install, uninstall)
    try:
        cls = AsyncScheduler if async_scheduling else Scheduler
        return cls(vllm_config=vllm_config, kv_cache_config=config, block_size=block_size,
                   log_stats=True, structured_output_manager=StructuredOutputManager(
                       vllm_config))
    finally:
        _switch(before or "vllm", install, uninstall)


def _switch(manager: str, install: Callable[..., None], uninstall: Callable[[], None]) -> None:
    if manager == "vllm":
        uninstall()
    elif manager in ("kvfunc", "manager"):
        install()
    elif manager == "shadow":
        install(mode="shadow")
    else:
        from kvfunc.core import InvalidArgumentError

        raise InvalidArgumentError(f"manager must be 'kvfunc', 'vllm' or 'shadow', got "
                                   f"{manager!r}")


def make_request(request_id: str, prompt_token_ids: Sequence[int], *, block_size: int = 16,
                 max_tokens: int = 16) -> Any:
    """A vLLM ``Request`` (its block hashes by vLLM's sha256 request hasher)."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    if not _HASHER:
        init_none_hash(sha256)
        _HASHER.append(sha256)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    params.update_from_generation_config({}, eos_token_id=None)
    return Request(request_id=request_id, prompt_token_ids=list(prompt_token_ids),
                   mm_features=None, sampling_params=params, pooling_params=None,
                   block_hasher=get_request_block_hasher(block_size, sha256))


def model_output(scheduler_output: Any, scheduler: Any = None, token_id: int = 7) -> Any:
    """A fake model output: ``token_id`` sampled for every request the step scheduled.

    With ``scheduler`` (call it right after ``schedule()``), requests whose
    step is a non-final prefill chunk sample nothing, as vLLM's model runner
    discards their tokens.
    """
    from vllm.v1.outputs import ModelRunnerOutput

    req_ids = list(scheduler_output.num_scheduled_tokens)
    requests = {} if scheduler is None else scheduler.requests
    sampled = [[] if (r := requests.get(rid)) is not None and r.is_prefill_chunk
               else [token_id] for rid in req_ids]
    return ModelRunnerOutput(req_ids=req_ids,
                             req_id_to_index={r: i for i, r in enumerate(req_ids)},
                             sampled_token_ids=sampled, logprobs=None, prompt_logprobs_dict={},
                             pooler_output=[])
