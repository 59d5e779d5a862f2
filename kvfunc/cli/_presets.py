"""Model presets: the caches of real architectures as :class:`~kvfunc.ModelCacheInfo`.

Each preset turns a model's published configuration into per-layer cache
records.  The figures come from the model's own ``config.json`` (and paper
where the config does not say how the cache is laid out); every builder
names its sources, and ``kvfunc plan --preset NAME`` prints them.

What is a model figure and what is an engine choice:

* layer count, KV heads, head dims, window, layer pattern, context length and
  the number of multi-token-prediction (MTP) layers are the model's;
* ``block_size``, the cache ``dtype`` (``bfloat16`` unless overridden) and the
  dtype of recurrent states are the engine's, and each preset says which it
  assumes.  ``block_size`` and the attention ``dtype`` can be overridden.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from kvfunc.cli._errors import CLIError
from kvfunc.cli._inputs import show
from kvfunc.core import (
    CacheEntry,
    LayerCacheInfo,
    MambaCacheEntry,
    ModelCacheInfo,
    dtype_itemsize,
    validate_cache_info,
)

__all__ = ["MAX_FIELD", "MAX_MODEL_LEN", "MAX_NEXT_N", "PRESETS", "ModelPreset", "build_preset",
           "preset_names"]

#: The largest dimension, head count, block size, window or ratio a model may have.
MAX_FIELD = 2**24
#: The deepest multi-token prediction (``next_n``, ``--mtp``).
MAX_NEXT_N = 16
#: The longest context a model or a simulation may have (``max_model_len``).
MAX_MODEL_LEN = 2**24


@attrs.frozen
class ModelPreset:
    """A model's caches plus what planning and simulation need to know about it.

    Attributes:
        name: the preset's name (``llama-3-8b``).
        title: a one-line description.
        sources: where the figures come from (URLs).
        cache_info: every layer's caches, MTP layers included when ``next_n > 0``.
        max_model_len: the model's context length (``max_position_embeddings``).
        next_n: the MTP depth the caches were built for.
        notes: assumptions that are the engine's, not the model's.
    """

    name: str
    title: str
    sources: tuple[str, ...]
    cache_info: ModelCacheInfo
    max_model_len: int
    next_n: int = 0
    notes: tuple[str, ...] = ()


@attrs.frozen
class _Options:
    block_size: int | None
    kv_dtype: str | None
    next_n: int


def _kv_pair(heads: int, head_dim: int, attn_type: str, opts: _Options, default_bs: int,
             window: int | None = None) -> list[CacheEntry]:
    """The separate K and V caches of one GQA/MHA layer."""
    bs = opts.block_size or default_bs
    dtype = opts.kv_dtype or "bfloat16"
    return [CacheEntry(name, attn_type, head_dim, heads, dtype, True, block_size=bs,
                       sliding_window=window) for name in ("k_cache", "v_cache")]


def _no_mtp(name: str, opts: _Options) -> None:
    if opts.next_n:
        msg = (f"preset {name} has no multi-token-prediction layers, so --mtp must be 0 "
               f"(got {opts.next_n})")
        raise CLIError(msg)


# --- Llama-3-8B: grouped-query attention ------------------------------------------------

_LLAMA3_8B = "https://huggingface.co/meta-llama/Meta-Llama-3-8B/blob/main/config.json"


def _llama_3_8b(opts: _Options) -> ModelPreset:
    # config.json: num_hidden_layers 32, num_attention_heads 32, num_key_value_heads 8,
    # hidden_size 4096 (head_dim 4096 / 32 = 128), max_position_embeddings 8192.
    _no_mtp("llama-3-8b", opts)
    layers = [LayerCacheInfo(i, _kv_pair(8, 128, "FullAttention", opts, 16)) for i in range(32)]
    return ModelPreset(
        "llama-3-8b", "Llama-3-8B: 32 layers of GQA (8 KV heads x 128)", (_LLAMA3_8B,),
        ModelCacheInfo(32, layers), 8192,
        notes=("block_size 16 and a bfloat16 cache are engine defaults, not model figures",))


# --- DeepSeek-V3: multi-head latent attention + one MTP layer ----------------------------

_DSV3_CONFIG = "https://huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json"
_DSV3_PAPER = "https://arxiv.org/abs/2412.19437"
_DSV3_WEIGHTS = "https://github.com/deepseek-ai/DeepSeek-V3/blob/main/README_WEIGHTS.md"


def _mla_layer(idx: int, opts: _Options) -> LayerCacheInfo:
    # MLA caches only the compressed latent c_KV (kv_lora_rank = 512) and the
    # decoupled RoPE key k_R (qk_rope_head_dim = 64), one "head" each (paper §2.1.1).
    bs = opts.block_size or 64
    dtype = opts.kv_dtype or "bfloat16"
    return LayerCacheInfo(idx, [
        CacheEntry("kv_latent", "FullAttention", 512, 1, dtype, True, block_size=bs),
        CacheEntry("k_rope", "FullAttention", 64, 1, dtype, True, block_size=bs),
    ])


def _deepseek_v3(opts: _Options) -> ModelPreset:
    # config.json: num_hidden_layers 61, kv_lora_rank 512, qk_rope_head_dim 64,
    # num_nextn_predict_layers 1, max_position_embeddings 163840.  The MTP module
    # is one more transformer block like the main ones (README_WEIGHTS: layer 61).
    info = ModelCacheInfo(61, [_mla_layer(i, opts) for i in range(61)], is_mla_backend=True)
    if opts.next_n:
        info = info.merge(ModelCacheInfo(1, [_mla_layer(0, opts)], is_mla_backend=True))
    return ModelPreset(
        "deepseek-v3", "DeepSeek-V3: 61 MLA layers (latent 512 + RoPE 64) and 1 MTP layer",
        (_DSV3_CONFIG, _DSV3_PAPER, _DSV3_WEIGHTS), info, 163840, opts.next_n,
        notes=("block_size 64 and a bfloat16 cache are engine choices",
               "one MTP layer serves every speculative step, whatever the depth"))


# --- gpt-oss-120b: alternating sliding-window and full attention --------------------------

_GPT_OSS = "https://huggingface.co/openai/gpt-oss-120b/blob/main/config.json"
_GPT_OSS_CARD = "https://arxiv.org/abs/2508.10925"


def _gpt_oss_120b(opts: _Options) -> ModelPreset:
    # config.json: num_hidden_layers 36, num_key_value_heads 8, head_dim 64,
    # sliding_window 128, layer_types alternating "sliding_attention" (even
    # layers) and "full_attention" (odd layers), max_position_embeddings 131072.
    _no_mtp("gpt-oss-120b", opts)
    layers = []
    for i in range(36):
        if i % 2 == 0:
            caches = _kv_pair(8, 64, "SlidingWindow", opts, 16, window=128)
        else:
            caches = _kv_pair(8, 64, "FullAttention", opts, 16)
        layers.append(LayerCacheInfo(i, caches))
    return ModelPreset(
        "gpt-oss-120b", "gpt-oss-120b: 18 window-128 + 18 full GQA layers (8 KV heads x 64)",
        (_GPT_OSS, _GPT_OSS_CARD), ModelCacheInfo(36, layers), 131072,
        notes=("block_size 16 and a bfloat16 cache are engine defaults",))


# --- Qwen3-Next-80B-A3B: Gated DeltaNet (recurrent state) + gated full attention ----------

_QWEN3_NEXT = "https://huggingface.co/Qwen/Qwen3-Next-80B-A3B-Instruct/blob/main/config.json"
_QWEN3_NEXT_CARD = "https://huggingface.co/Qwen/Qwen3-Next-80B-A3B-Instruct"


def _qwen3_next_layer(idx: int, full: bool, opts: _Options) -> LayerCacheInfo:
    if full:
        return LayerCacheInfo(idx, _kv_pair(2, 256, "FullAttention", opts, 16))
    # Gated DeltaNet: 16 key heads and 32 value heads of dim 128, a causal conv of
    # kernel 4 over q, k and v (2 * 16 * 128 + 32 * 128 = 8192 channels, 3 past
    # positions), and a 32 x 128 x 128 recurrent state.
    conv = MambaCacheEntry(cache_name="conv_state", dtype="bfloat16", needs_block=True,
                           shape=[3, 8192], next_n=opts.next_n)
    ssm = MambaCacheEntry(cache_name="ssm_state", dtype="float32", needs_block=True,
                          shape=[32, 128, 128], next_n=opts.next_n)
    return LayerCacheInfo(idx, [conv, ssm])


def _qwen3_next(opts: _Options) -> ModelPreset:
    # config.json: num_hidden_layers 48, full_attention_interval 4 (layers 3, 7, ...
    # are full attention), num_key_value_heads 2, head_dim 256, linear_num_key_heads
    # 16, linear_num_value_heads 32, linear_key/value_head_dim 128,
    # linear_conv_kernel_dim 4, max_position_embeddings 262144.  The model card
    # lists multi-token prediction.
    layers = [_qwen3_next_layer(i, (i + 1) % 4 == 0, opts) for i in range(48)]
    info = ModelCacheInfo(48, layers)
    if opts.next_n:
        info = info.merge(ModelCacheInfo(1, [_qwen3_next_layer(0, True, opts)]))
    return ModelPreset(
        "qwen3-next-80b", "Qwen3-Next-80B-A3B: 36 Gated DeltaNet state layers + 12 full layers",
        (_QWEN3_NEXT, _QWEN3_NEXT_CARD), info, 262144, opts.next_n,
        notes=("block_size 16, a bfloat16 KV cache and conv state, and a float32 "
               "recurrent state are engine choices",
               "the MTP layer is taken to be one full-attention layer"))


_Builder = Callable[[_Options], ModelPreset]

#: Preset name -> (builder, default MTP depth).
PRESETS: dict[str, tuple[_Builder, int]] = {
    "llama-3-8b": (_llama_3_8b, 0),
    "deepseek-v3": (_deepseek_v3, 1),
    "gpt-oss-120b": (_gpt_oss_120b, 0),
    "qwen3-next-80b": (_qwen3_next, 1),
}


def preset_names() -> list[str]:
    """The preset names, sorted.

    >>> preset_names()
    ['deepseek-v3', 'gpt-oss-120b', 'llama-3-8b', 'qwen3-next-80b']
    """
    return sorted(PRESETS)


def build_preset(name: str, *, block_size: int | None = None, kv_dtype: str | None = None,
                 next_n: int | None = None) -> ModelPreset:
    """The preset ``name``, its caches validated.

    Args:
        name: one of :func:`preset_names`.
        block_size: overrides the attention caches' block size.
        kv_dtype: overrides the attention caches' dtype (``"fp8"``, ``"float16"``…).
        next_n: MTP depth; ``None`` takes the preset's default (1 where the
            model ships an MTP layer, else 0).

    Raises:
        CLIError: unknown name, or an option the model cannot take.

    >>> p = build_preset("llama-3-8b")
    >>> p.cache_info.num_layers, p.max_model_len, p.cache_info.layer_infos[0].caches[0].num_head
    (32, 8192, 8)
    >>> build_preset("deepseek-v3").cache_info.num_layers  # 61 + 1 MTP layer
    62
    >>> build_preset("llama-2")
    Traceback (most recent call last):
    ...
    kvfunc.cli._errors.CLIError: unknown preset 'llama-2'; choose one of ['deepseek-v3', ...
    """
    entry = PRESETS.get(name)
    if entry is None:
        msg = (f"unknown preset {show(name)}; choose one of {preset_names()} "
               "or describe your model in a file with --model FILE.toml")
        raise CLIError(msg)
    if block_size is not None and (type(block_size) is not int
                                   or not 0 < block_size <= MAX_FIELD):
        msg = f"--block-size must be an integer from 1 to {MAX_FIELD:,}, got {block_size!r}"
        raise CLIError(msg)
    if next_n is not None and (type(next_n) is not int or not 0 <= next_n <= MAX_NEXT_N):
        msg = f"--mtp must be an integer from 0 to {MAX_NEXT_N}, got {next_n!r}"
        raise CLIError(msg)
    if kv_dtype is not None:
        try:
            dtype_itemsize(kv_dtype)
        except ValueError:
            msg = f"--kv-dtype {show(kv_dtype)} is not a dtype kvfunc knows; try bfloat16 or fp8"
            raise CLIError(msg) from None
    builder, default_next_n = entry
    opts = _Options(block_size, kv_dtype, default_next_n if next_n is None else next_n)
    preset = builder(opts)
    try:
        validate_cache_info(preset.cache_info)
    except ValueError as exc:
        raise CLIError(f"preset {name}: {exc}") from None
    return preset
