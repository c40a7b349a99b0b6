"""Wire dtypes of a trainer's tensors: which dtype each tensor travels in, by name.

Floating-point tensors travel in one wire dtype (e.g. fp32 master weights sent as bf16), except
the names a keep-fp32 pattern matches (MoE router gates by default), which travel as float32.
Shared by every sharded source (FSDP2, Megatron, Megatron-FSDP, Megatron-FSDP2) and the training
engines' configs that name them.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch

__all__ = [
    "DEFAULT_KEEP_FP32", "FLOAT_DTYPES", "WirePolicy", "check_float_dtype", "dtype_name", "hf_config_of", "tied_embeddings", "torch_dtype",
]

DEFAULT_KEEP_FP32: tuple[str, ...] = (r"(^|\.)mlp\.gate\.weight$",)
"""MoE router gates: engines keep them in fp32 because top-k routing is sensitive to rounding."""

FLOAT_DTYPES = ("float32", "bfloat16", "float16")


def check_float_dtype(field_name: str, value: str | None) -> None:
    if value is not None and value not in FLOAT_DTYPES:
        raise ValueError(f"{field_name} must be one of {FLOAT_DTYPES} or None, got {value!r}")


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"this torch build has no dtype {name!r}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """The manifest's name of `dtype` ("bfloat16"), the inverse of `torch_dtype`."""
    return str(dtype).removeprefix("torch.")


class WirePolicy:
    """Per-name wire dtype: keep-fp32 names first, then `wire_dtype` for floating tensors.

    `wire_dtype`: a torch dtype or its name ("bfloat16"); None keeps every tensor's own dtype.
    `keep_fp32_patterns`: regexes (`re.search` on the HF name) of tensors that travel as float32.
    """

    def __init__(self, wire_dtype: torch.dtype | str | None, keep_fp32_patterns: Sequence[str] = DEFAULT_KEEP_FP32) -> None:
        if isinstance(wire_dtype, str):
            check_float_dtype("wire_dtype", wire_dtype)
            wire_dtype = torch_dtype(wire_dtype)
        if wire_dtype is not None and not wire_dtype.is_floating_point:
            raise ValueError(f"wire_dtype must be a floating-point dtype or None, got {wire_dtype}")
        self.wire: torch.dtype | None = wire_dtype
        self.keep = []
        for pat in keep_fp32_patterns:
            try:
                self.keep.append(re.compile(pat))
            except re.error as exc:
                raise ValueError(f"keep_fp32_patterns: bad regex {pat!r}: {exc}") from None

    def dtype_for(self, name: str, dtype: torch.dtype) -> torch.dtype:
        if not dtype.is_floating_point:
            return dtype
        if any(p.search(name) for p in self.keep):
            return torch.float32
        return self.wire if self.wire is not None else dtype


def hf_config_of(model: torch.nn.Module, who: str) -> Any:
    """`model`'s Hugging Face config (a `transformers.PretrainedConfig`): the export names every
    tensor by its `model_type`. A `peft.PeftModel` forwards its base model's config."""
    from transformers import PretrainedConfig

    config = getattr(model, "config", None)
    if not isinstance(config, PretrainedConfig):
        raise ValueError(f"{who} wraps Hugging Face models (with .config.model_type), got {type(model).__name__}")
    return config


def tied_embeddings(hf_config: Any) -> bool:
    """Whether the model's LM head is its input embedding (HF checkpoints then hold the embedding
    only); a config that does not say is untied."""
    return bool(getattr(hf_config, "tie_word_embeddings", False))
