"""The export plan FSDP2 and Megatron-FSDP2 share (`sources/export_plan.py`), on CPU.

Megatron-FSDP2 needs CUDA and megatron-fsdp, so its engine is tested on the device box only; its
plan (parameters only, persistent buffers refused by name) is checked here, beside FSDP2's.
"""

from __future__ import annotations

import pytest
import torch

from ckpt_engine.sources.wire import WirePolicy
from ckpt_engine.sources.export_plan import emit_entry, plan_export
from ckpt_engine.trainer.engines.common import decoder_layers
from tests.test_trainer_fsdp2 import build_model


def _plan(model: torch.nn.Module, **kw):  # noqa: ANN202 - list[ExportEntry]
    return plan_export(model, decoder_layers(model), model_type=model.config.model_type, wire=WirePolicy("bfloat16", ()), **kw)


def test_names_order_units_and_wire_dtypes_follow_the_hf_state_dict() -> None:
    model = build_model("qwen2", tie=True)
    entries = _plan(model, buffers=True, tied_head=True, who="FSDP2")
    want = [k for k in model.state_dict() if k != "lm_head.weight"]
    assert [e.name for e in entries] == want
    layer0 = decoder_layers(model)[0]
    assert {e.unit for e in entries if e.name.startswith("model.layers.0.")} == {1}
    assert {e.unit for e in entries if not e.name.startswith("model.layers.")} == {0}
    assert all(s.dtype == "bfloat16" for e in entries for s in e.specs)
    in_layer0 = {id(m) for m in layer0.modules()}
    assert all(id(e.module) in in_layer0 for e in entries if e.unit == 1)


def test_fused_experts_are_unfused_per_expert_in_their_wire_dtype() -> None:
    model = build_model("qwen3_moe")
    entries = _plan(model, buffers=False, tied_head=False, who="Megatron-FSDP2")
    fused = [e for e in entries if e.expert_outputs]
    assert fused, "the MoE model holds fused experts"
    e = fused[0]
    t = getattr(e.module, e.attr).detach()
    out = list(emit_entry(model.config.model_type, e, t))
    assert [n for n, _ in out] == [s.name for s in e.specs]
    assert len(out) == e.shape[0] * e.expert_outputs
    assert all(x.dtype == torch.bfloat16 for _, x in out)


def test_parameters_only_plan_refuses_a_persistent_buffer_by_name() -> None:
    model = build_model("qwen2")
    model.model.norm.register_buffer("scale", torch.ones(1))
    assert "model.norm.scale" in [e.name for e in _plan(model, buffers=True, tied_head=False, who="FSDP2")]
    with pytest.raises(ValueError, match=r"persistent buffers \(model\.norm\.scale, \.\.\.\): Megatron-FSDP2 export covers parameters only"):
        _plan(model, buffers=False, tied_head=False, who="Megatron-FSDP2")
