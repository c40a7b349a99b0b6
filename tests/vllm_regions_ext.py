"""Test-only worker extension: lands a checkpoint region by region inside each vLLM worker.

Tensors cannot travel in `collective_rpc` arguments, so each worker reads the trainer's weights
from a safetensors file, cuts its own regions (its recorded receive plan) and lands them through
the core's region path, with no transport in between. Also injects a loader the recorder cannot
follow into one parameter. It carries the installed-check faults too (tests/_vllm_installed_faults.py)
and the plan cache's reads (tests/_vllm_plan_cache_ext.py): the session's shared TP=2 engine
(`tp2_qwen2_llm`, tests/conftest.py) runs it for the region tests, for
tests/test_installed_checks_vllm_tp2.py and for tests/test_vllm_plan_cache_tp2.py, one engine start
instead of three.
"""

from __future__ import annotations

from typing import Any

import torch

from _vllm_installed_faults import InstalledFaultsExtension
from _vllm_plan_cache_ext import PlanCacheReads
from ckpt_engine.planning.regions import ReceivePlan

EXTENSION = "vllm_regions_ext.RegionTestExtension"


class RegionTestExtension(InstalledFaultsExtension, PlanCacheReads):
    def test_land_checkpoint(self, path: str, poison: bool, whole: bool = False) -> dict[str, Any]:
        from safetensors.torch import load_file

        core = self._ckpt_core()
        plan = ReceivePlan.from_wire(core.receive_plan()["plan"])
        weights = load_file(path)
        items = []
        for name, regions in plan.holds.items():
            t = weights[name]
            if regions is None or whole:
                items.append((name, None, t))
            else:
                items += [(name, r, t.narrow(r.dim, r.start, r.length).clone()) for r in regions]
        loaded = core.land(items, poison=poison)
        return {"loaded": loaded, "bytes": sum(t.nbytes for _, _, t in items)}

    def test_inject_opaque_loader(self, module_name: str) -> None:
        """Wrap `module_name.weight`'s loader with one that multiplies the whole tensor by 1.0 first
        (arithmetic the recorder cannot slice through); forget the recorded plan."""
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO, _get_original_loader

        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        module = model.get_submodule(module_name)
        meta = LAYERWISE_INFO[module].restore_metadata[0]["weight"]
        original = _get_original_loader(meta)

        def times_one_loader(param: torch.Tensor, loaded_weight: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            return original(param, loaded_weight * 1.0, *args, **kwargs)

        meta.weight_loader = times_one_loader
        self._ckpt_core()._plan = None
