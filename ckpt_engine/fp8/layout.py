"""The block-FP8 checkpoint layout (DeepSeek-V3, Qwen3-*-FP8, vLLM's `Fp8LinearMethod` with
`weight_block_size`): which tensors are quantized, and the names, dtypes and shapes they travel in.

A quantized linear weight `W` ([out, in], or [experts, out, in] stacked) travels as
`float8_e4m3fn` in its own shape, beside `W_scale_inv` (`<name>_scale_inv`, float32,
[ceil(out / 128), ceil(in / 128)]): one scale per 128 x 128 block, stored as the factor that
dequantizes (w ~= q * scale_inv), as vLLM's block-FP8 loader reads `weight_scale_inv`.

What is quantized follows vLLM: every linear layer's weight (`LinearBase`, routed experts) except
the ones FP8 checkpoints leave in high precision: embeddings, the LM head (a
`VocabParallelEmbedding`, not a linear layer), norms, biases, the MoE router (`mlp.gate`,
listed in Qwen3-MoE-FP8's `modules_to_not_convert`) and the shared-expert gate (built with
`quant_config=None`). In HF names: the `.weight` of a module whose name ends in `proj`
(`q_proj` ... `down_proj`, `q_a_proj`, `kv_b_proj`, `gate_up_proj`) or of DeepSeek's
`kv_a_proj_with_mqa`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import torch

from ckpt_engine.manifest import TensorSpec

__all__ = [
    "BLOCK", "FLOAT_WIRE", "FP8_DTYPE", "FP8_NAME", "SCALE_DTYPE", "SCALE_NAME", "SCALE_SUFFIX", "fp8_specs", "quantizes", "scale_name",
    "scale_shape", "weight_of",
]

BLOCK = (128, 128)
"""Rows x columns of one scale block: what every block-FP8 checkpoint in use has (`weight_block_size`)."""
FP8_DTYPE = torch.float8_e4m3fn
FP8_NAME = "float8_e4m3fn"
SCALE_DTYPE = torch.float32
SCALE_NAME = "float32"
SCALE_SUFFIX = "_scale_inv"
FLOAT_WIRE = frozenset({"bfloat16", "float16", "float32"})
"""Wire dtypes a quantized weight may come from."""

_LINEAR = re.compile(r"(^|\.)[A-Za-z0-9_]*proj(_with_mqa)?\.weight$")


def quantizes(spec: TensorSpec) -> bool:
    """Whether `spec` travels block-quantized: a floating linear weight of 2 (or 3, experts
    stacked) dims that vLLM's block-FP8 layers hold in FP8 (module docstring)."""
    return spec.dtype in FLOAT_WIRE and len(spec.shape) in (2, 3) and _LINEAR.search(spec.name) is not None


def scale_name(weight: str) -> str:
    """`model.layers.0.mlp.down_proj.weight` -> `model.layers.0.mlp.down_proj.weight_scale_inv`."""
    return weight + SCALE_SUFFIX


def weight_of(name: str) -> str | None:
    """The weight a scale tensor belongs to (None: `name` is not a scale tensor's)."""
    return name[: -len(SCALE_SUFFIX)] if name.endswith(SCALE_SUFFIX) else None


def scale_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """Shape of the scales of a weight of `shape`: leading dims as they are, the last two in blocks."""
    *lead, rows, cols = shape
    return (*lead, math.ceil(rows / BLOCK[0]), math.ceil(cols / BLOCK[1]))


def fp8_specs(specs: Sequence[TensorSpec]) -> list[TensorSpec]:
    """The wire specs of a block-FP8 sync of `specs`: each quantized weight as FP8, followed by its
    scales; every other tensor as it is. Also the layout a block-FP8 checkpoint of the model holds."""
    out: list[TensorSpec] = []
    for spec in specs:
        if not quantizes(spec):
            out.append(spec)
            continue
        out.append(TensorSpec(spec.name, FP8_NAME, spec.shape))
        out.append(TensorSpec(scale_name(spec.name), SCALE_NAME, scale_shape(spec.shape)))
    return out
