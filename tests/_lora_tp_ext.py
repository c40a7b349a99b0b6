"""Test-only worker extension for test_lora_vllm_tp: what each TP rank's LoRA layers hold.

Tensors cannot travel in `collective_rpc` replies as tensors, so each worker answers with nested
lists: for every LoRA layer, the `lora_a` / `lora_b` slices vLLM filled (per sub-module: q, k, v of
`qkv_proj`) in the slot that holds a given LoRA id.
"""

from __future__ import annotations

from typing import Any

from ckpt_engine.rollout_adapters.vllm.worker import CkptEngineWorkerExtension

EXTENSION = "_lora_tp_ext.LoraTpTestExtension"


class LoraTpTestExtension(CkptEngineWorkerExtension):
    def test_lora_slices(self, lora_id: int) -> dict[str, Any]:
        """This rank's tensor-parallel rank and, by module path, the lora_a / lora_b slices of `lora_id`."""
        from vllm.distributed import get_tensor_model_parallel_rank
        from vllm.lora.layers import BaseLayerWithLoRA

        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        slot = model.lora_manager.lora_index_to_id.index(lora_id)
        layers: dict[str, Any] = {}
        for name, module in model.named_modules():
            if isinstance(module, BaseLayerWithLoRA) and hasattr(module, "lora_a_stacked"):
                layers[name] = {
                    "a": [s[slot, 0].tolist() for s in module.lora_a_stacked],
                    "b": [s[slot, 0].tolist() for s in module.lora_b_stacked],
                }
        return {"tp_rank": int(get_tensor_model_parallel_rank()), "layers": layers}
