"""The reference receiver's model: its tensors (zeros of a spec file's, or a fresh HF model's),
or, as one rank of a TP / EP engine, only its slices (`planning/tp_ep.py`) and the plan it states.

A spec file lists `[name, dtype, shape]` of every tensor, as msgpack.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import msgpack
import torch

from ckpt_engine.manifest import TensorSpec
from ckpt_engine.planning.receive_sets import cut_region
from ckpt_engine.planning.regions import ReceivePlan
from ckpt_engine.planning.fused_experts import fuse_specs
from ckpt_engine.planning.tp_ep import tp_ep_plan
from ckpt_engine.sources.base import spec_of

__all__ = ["RefModel", "load_spec_file", "write_spec_file"]


def write_spec_file(path: str | os.PathLike[str], specs: list[TensorSpec]) -> None:
    Path(path).write_bytes(msgpack.packb([[s.name, s.dtype, list(s.shape)] for s in specs], use_bin_type=True))


def load_spec_file(path: str | os.PathLike[str]) -> list[TensorSpec]:
    raw = msgpack.unpackb(Path(path).read_bytes(), raw=False, max_ext_len=0)
    if not isinstance(raw, list):
        raise ValueError(f"{path}: a spec file holds a list of [name, dtype, shape]")
    return [TensorSpec(n, d, tuple(s)) for n, d, s in raw]


@dataclass
class RefModel:
    """What a reference receiver holds: `tensors` by name, the HF `module` they belong to (or
    None), and as a TP / EP rank its `plan` and the global specs it `expected` to be sent."""

    tensors: dict[str, torch.Tensor]
    module: torch.nn.Module | None = None
    plan: ReceivePlan | None = None
    expected: dict[str, TensorSpec] | None = None

    @classmethod
    def sharded(cls, specs: list[TensorSpec], layout: dict[str, int]) -> RefModel:
        """A TP / EP rank of the model `specs` (global shapes): zeros of its slices. `layout`:
        tp_size, tp_rank, ep_size, ep_rank, num_kv_heads (see `tp_ep_plan`); fused_experts=1: it
        holds each layer's experts stacked (`planning/fused_experts.py`), as vLLM's w13/w2 do."""
        layout = dict(layout)
        if layout.pop("fused_experts", 0):
            specs = fuse_specs(specs)[0]
        plan = tp_ep_plan(specs, **layout)
        if plan is None:
            return cls({s.name: torch.zeros(s.shape, dtype=getattr(torch, s.dtype)) for s in specs})
        tensors = {}
        for s in specs:
            if s.name in plan.holds:
                rs = plan.holds[s.name]
                shape = cut_region(torch.empty(s.shape, device="meta"), rs[0] if rs is not None else None).shape
                tensors[s.name] = torch.zeros(shape, dtype=getattr(torch, s.dtype))
        return cls(tensors, plan=plan, expected={s.name: s for s in specs})

    @classmethod
    def from_spec_file(cls, path: str, layout: dict[str, int] | None = None) -> RefModel:
        if layout:
            return cls.sharded(load_spec_file(path), layout)
        return cls({s.name: torch.zeros(s.shape, dtype=getattr(torch, s.dtype)) for s in load_spec_file(path)})

    @classmethod
    def from_hf_config(cls, model_dir: str, dtype: str, layout: dict[str, int] | None = None) -> RefModel:
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(model_dir)
        if layout:
            with torch.device("meta"):
                meta = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
            specs, ids = [], set()
            for name, t in meta.state_dict().items():  # tied weights once, under their first name
                if id(t) not in ids:
                    ids.add(id(t))
                    specs.append(spec_of(name, t))
            kv = getattr(config, "num_key_value_heads", None)
            return cls.sharded(specs, {"num_kv_heads": kv, **layout} if kv is not None else layout)
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
        tensors: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for name, t in model.state_dict().items():  # tied weights appear once, under their first name
            if t.data_ptr() in seen and t.numel():
                continue
            seen.add(t.data_ptr())
            tensors[name] = t
        return cls(tensors, module=model)
