"""Hand-made Hugging Face ``config.json`` files for the text models vLLM's core tests name.

No weights and no tokenizer: vLLM's ``ModelConfig`` reads only the config, so with
``HF_HUB_OFFLINE=1`` and ``HF_HOME=DIR`` the tests build their schedulers offline.
The files are laid out as a hub cache (``DIR/hub/models--ORG--NAME``).

    python .ci/vllm_hf_configs.py DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

REVISION = "0" * 40
_OPT: dict[str, Any] = {
    "activation_function": "relu", "architectures": ["OPTForCausalLM"], "bos_token_id": 2,
    "dropout": 0.1, "eos_token_id": 2, "model_type": "opt", "pad_token_id": 1,
    "torch_dtype": "float16", "vocab_size": 50272, "max_position_embeddings": 2048}
_QWEN: dict[str, Any] = {
    "bos_token_id": 151643, "hidden_act": "silu", "max_window_layers": 28,
    "rms_norm_eps": 1e-06, "torch_dtype": "bfloat16", "use_sliding_window": False,
    "vocab_size": 151936}
CONFIGS: dict[str, dict[str, Any]] = {
    "facebook/opt-125m": {**_OPT, "do_layer_norm_before": True, "ffn_dim": 3072,
                          "hidden_size": 768, "num_attention_heads": 12,
                          "num_hidden_layers": 12, "word_embed_proj_dim": 768},
    "facebook/opt-350m": {**_OPT, "do_layer_norm_before": False, "ffn_dim": 4096,
                          "hidden_size": 1024, "num_attention_heads": 16,
                          "num_hidden_layers": 24, "word_embed_proj_dim": 512},
    "Qwen/Qwen3-0.6B": {**_QWEN, "architectures": ["Qwen3ForCausalLM"],
                        "attention_bias": False, "eos_token_id": 151645, "head_dim": 128,
                        "hidden_size": 1024, "intermediate_size": 3072,
                        "max_position_embeddings": 40960, "model_type": "qwen3",
                        "num_attention_heads": 16, "num_hidden_layers": 28,
                        "num_key_value_heads": 8, "rope_theta": 1000000,
                        "sliding_window": None, "tie_word_embeddings": True},
    "Qwen/Qwen1.5-7B": {**_QWEN, "architectures": ["Qwen2ForCausalLM"],
                        "eos_token_id": 151643, "hidden_size": 4096,
                        "intermediate_size": 11008, "max_position_embeddings": 32768,
                        "model_type": "qwen2", "num_attention_heads": 32,
                        "num_hidden_layers": 32, "num_key_value_heads": 32, "rope_theta": 1e6,
                        "sliding_window": 32768, "tie_word_embeddings": False},
}


def write_configs(home: Path) -> int:
    """Write every config under ``home/hub``; the number written."""
    for name, config in CONFIGS.items():
        repo = home / "hub" / ("models--" + name.replace("/", "--"))
        snapshot = repo / "snapshots" / REVISION
        snapshot.mkdir(parents=True, exist_ok=True)
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(REVISION)
        (snapshot / "config.json").write_text(json.dumps(config, indent=1))
    return len(CONFIGS)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python .ci/vllm_hf_configs.py DIR")
    print(f"{write_configs(Path(sys.argv[1]))} model configs under {sys.argv[1]}/hub")
