"""The demo's model: a tiny Qwen2 `config.json`, shared by the vLLM job and the Ray job.

vLLM loads dummy weights from it and the trainer initializes its own; the first sync replaces
vLLM's. Its own module so the jobs that write it import nothing of each other.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TINY_QWEN2"]

# ~54M parameters (214 MB in fp32): small enough to start and train in seconds on 2 CPU cores,
# large enough that a sync's transfer outweighs its fixed control cost (a 1.5 MB model spends
# ~60% of each sync on pause/validate/finalize round trips, this one ~10%). head_dim 64 (vLLM's
# CPU attention has no kernel for head_dim 16).
TINY_QWEN2: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "vocab_size": 8192,
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
    "initializer_range": 0.02,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
