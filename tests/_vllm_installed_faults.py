"""Test-only vLLM worker extension for installed-weight checks (tests/test_installed_checks_vllm.py,
and tests/test_installed_checks_vllm_native.py beside the `ckpt_engine` weight-transfer backend):
plants one fault inside each worker, as a real engine would carry it, and takes it back.

`transpose`: a parameter's loader copies the checkpoint tensor transposed (a loader that transposes
once too often); `skip`: a parameter's loader copies nothing (a loader that drops a tensor); `buffer`:
a persistent buffer of the engine's layout that no sync writes (a buffer never synced). The loaders
are planted where layerwise reload takes them from (the layer's restore metadata), as
tests/vllm_regions_ext.py does; the recorded landings are kept (they were recorded before the fault).

`PlantsExtension` holds the plants that need nothing of the library's worker extension: an engine
started with the native `ckpt_engine` weight-transfer backend takes it alone, so the tests that hold
"the native backend needs no worker extension" and the fault tests can share one engine
(tests/conftest.py); `InstalledFaultsExtension` is the library's extension plus those plants.
"""

from __future__ import annotations

from typing import Any

import torch

from ckpt_engine.rollout_adapters.vllm.worker import CkptEngineWorkerExtension

EXTENSION = "_vllm_installed_faults.InstalledFaultsExtension"
NATIVE_EXTENSION = "_vllm_installed_faults.PlantsExtension"
PLANTED_BUFFER = "ckpt_planted_scale"


class PlantsExtension:
    """The plants and state reads that use only vLLM's worker and the native backend's engine."""

    _planted: list[tuple[Any, Any]]

    def test_plant(self, fault: str, module_name: str) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO, _get_original_loader

        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        self._planted = getattr(self, "_planted", [])
        module = model.get_submodule(module_name)
        if fault == "buffer":
            module.register_buffer(PLANTED_BUFFER, torch.ones(8), persistent=True)
            self._planted.append((module, None))
            return
        meta = LAYERWISE_INFO[module].restore_metadata[0]["weight"]
        original = _get_original_loader(meta)

        def transposing_loader(param: torch.Tensor, loaded_weight: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            return original(param, loaded_weight.t(), *args, **kwargs)

        def skipping_loader(param: torch.Tensor, loaded_weight: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            return None

        meta.weight_loader = transposing_loader if fault == "transpose" else skipping_loader
        self._planted.append((meta, original))

    def test_unplant(self) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

        for target, original in getattr(self, "_planted", []):
            if original is None:  # an open reload keeps it among the layer's kernel tensors, to put back
                target._buffers.pop(PLANTED_BUFFER, None)
                kernel = LAYERWISE_INFO[target].kernel_tensors
                if kernel is not None:
                    kernel[1].pop(PLANTED_BUFFER, None)
            else:
                target.weight_loader = original
        self._planted = []

    def test_native_state(self) -> dict[str, Any]:
        """The same of the `ckpt_engine` weight-transfer backend's core (an engine started with
        `weight_transfer_config={"backend": "ckpt_engine"}` beside this extension)."""
        core = self.weight_transfer_engine.core  # type: ignore[attr-defined]
        return {"stale": core.stale, "version": core.version}

    # --- adapter (LoRA) syncs: faults in vLLM's LoRA model build and in its slot writes ---
    def test_lora_plant(self, fault: str, module_name: str) -> None:
        """`build`: vLLM's `LoRAModel.from_lora_tensors` hands `module_name` a scrambled lora_B (its
        bytes read as the transpose); `slot-skip`: that LoRA layer's `set_lora` writes nothing;
        `slot-transpose`: it copies a scrambled lora_A (the first slice of a packed layer)."""
        from vllm.lora.lora_model import LoRAModel

        self._lora_planted = getattr(self, "_lora_planted", [])
        if fault == "build":
            original = LoRAModel.__dict__["from_lora_tensors"]

            def from_lora_tensors(cls: Any, *args: Any, **kwargs: Any) -> Any:
                lora = original.__func__(cls, *args, **kwargs)
                b = lora.loras[module_name].lora_b
                lora.loras[module_name].lora_b = b.t().contiguous().view(b.shape)
                return lora

            LoRAModel.from_lora_tensors = classmethod(from_lora_tensors)  # type: ignore[method-assign, assignment]
            self._lora_planted.append((LoRAModel, "from_lora_tensors", original))
            return
        module = self._ckpt_lora.adapters.modules[module_name]  # type: ignore[attr-defined]  # the library extension's
        set_lora = module.set_lora

        def scrambled(x: Any) -> Any:
            if isinstance(x, list):
                return [scrambled(x[0]), *x[1:]]
            return x.t().contiguous().view(x.shape)

        def faulty_set_lora(index: int, lora_a: Any, lora_b: Any) -> None:
            if fault == "slot-skip":
                module.reset_lora(index)
            else:
                set_lora(index, scrambled(lora_a), lora_b)

        module.set_lora = faulty_set_lora
        self._lora_planted.append((module, "set_lora", None))

    def test_lora_unplant(self) -> None:
        for target, attr, original in getattr(self, "_lora_planted", []):
            if original is None:
                vars(target).pop(attr, None)
            else:
                setattr(target, attr, original)
        self._lora_planted = []

    def test_native_lora_state(self) -> dict[str, Any]:
        """`test_lora_state` of the `ckpt_engine` weight-transfer backend's adapter join."""
        core = self.weight_transfer_engine.lora.core  # type: ignore[attr-defined]
        return {"stale": core.stale, "version": core.versions.newest}


class InstalledFaultsExtension(CkptEngineWorkerExtension, PlantsExtension):
    """The library's worker extension plus the plants, and the plants and reads that need it."""

    def test_plant_direct(self, target: str) -> None:
        """A direct copy (`vllm/direct_load.py`: a model that loads in place, bf16 on CUDA) that
        leaves one wrong bit in `target`'s last element after every load (the element each sampled
        check reads)."""
        direct = self._ckpt_core()._direct_loads()
        assert direct is not None, "this engine makes no direct copies"
        original = direct.load
        words = self.model_runner.get_model().get_parameter(target).data.view(-1).view(torch.int16)  # type: ignore[attr-defined]

        def load(pairs: Any) -> Any:
            rest = original(pairs)
            words[-1:].bitwise_xor_(1)
            return rest

        direct.load = load  # type: ignore[method-assign]
        self._direct_planted = direct

    def test_unplant_direct(self) -> None:
        vars(self._direct_planted).pop("load", None)

    def test_fail_next_finalize(self, why: str) -> None:
        """The worker's next finalize raises `why` before it post-processes anything (then it is taken back)."""
        core = self._ckpt_core()

        def finalize(version: Any) -> dict[str, Any]:
            vars(core).pop("finalize", None)
            raise RuntimeError(why)

        core.finalize = finalize  # type: ignore[method-assign]

    def test_state(self) -> dict[str, Any]:
        core = self._ckpt_core()
        return {"stale": core.stale, "version": core.version}

    def test_lora_state(self) -> dict[str, Any]:
        core = self._ckpt_lora_core()
        return {"stale": core.stale, "version": core.versions.newest}
