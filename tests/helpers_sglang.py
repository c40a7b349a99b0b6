"""The SGLang stand-in (`tests/sglang_standin.py`) serving a tiny Qwen2, for the SGLang tests: one
model config, one start (forked from the preloaded fork server, tests/ranks.py: no second torch
import), one bounded wait for its port. Shared by tests/test_sglang_adapter.py and test_sglang_dies.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from helpers_procs import ForkedProcess, fork_program

__all__ = ["TINY_QWEN2", "standin", "tiny_model", "write_model_dir"]

TINY_QWEN2 = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 256, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": True,
    "initializer_range": 0.2, "torch_dtype": "float32",
}
"""A two-layer Qwen2 (≈ 0.3 MB of fp32 weights) the stand-in loads from its `config.json`."""


def write_model_dir(model_dir: Path) -> Path:
    """`model_dir` holding the tiny model's `config.json` (what the stand-in's --model-path reads)."""
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(TINY_QWEN2))
    return model_dir


def tiny_model(model_dir: Path, seed: int) -> torch.nn.Module:
    """The trainer's HF model with fresh random weights (seeded)."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.AutoConfig.from_pretrained(model_dir)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@contextmanager
def standin(model_dir: Path, *extra: str, start_timeout_s: float = 120.0) -> Iterator[tuple[ForkedProcess, str]]:
    """A running stand-in server for `model_dir`: (its process, its base URL); killed on exit."""
    program = fork_program("sglang_standin:main", ["--model-path", str(model_dir), *extra], "sglang-standin")
    try:
        line = program.read_line("SGLANG_STANDIN_PORT=", start_timeout_s)
        if line is None:
            raise RuntimeError(f"the SGLang stand-in did not start within {start_timeout_s:g}s (exit {program.process.poll()})")
        yield program.process, f"http://127.0.0.1:{int(line.split('=')[1])}"
    finally:
        program.process.kill()
        program.process.wait(10)
