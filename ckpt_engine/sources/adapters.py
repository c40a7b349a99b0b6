"""`AdapterSource`: only a PEFT model's LoRA adapter, as a weight source (adapter-only syncs).

A LoRA run trains a few MB of adapters over a frozen base: a sync needs only those. The source
yields, for one adapter of a `peft.PeftModel` (or any module whose parameters carry PEFT's names),
the tensors PEFT saves (`base_model.model.<module>.lora_A.weight` / `lora_B.weight`) and the
adapter's config tensor (`lora_format.ADAPTER_CONFIG`), in the layout engines load. The FSDP2
trainer adapter exports the same layout with `FSDP2Config(weights="adapters")`.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ckpt_engine.lora_format import ADAPTER_CONFIG, LoraSpec, peft_wire_name
from ckpt_engine.manifest import TensorSpec
from ckpt_engine.sources.base import WeightSource, spec_of, tensors_device

__all__ = ["AdapterSource", "lora_spec_of"]


def lora_spec_of(model: torch.nn.Module, adapter: str = "default") -> LoraSpec:
    """The `LoraSpec` of `adapter` in a PeftModel (its `peft_config[adapter]`)."""
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, dict) or adapter not in configs:
        known = sorted(configs) if isinstance(configs, dict) else []
        raise ValueError(f"{type(model).__name__} has no PEFT adapter {adapter!r} (adapters: {known}); wrap it with peft.get_peft_model")
    return LoraSpec.from_peft(configs[adapter])


class AdapterSource(WeightSource):
    """One PEFT adapter of an (unsharded) model: its LoRA tensors and config, nothing of the base.

    `dtype` casts the LoRA tensors on the wire (None: their own dtype). Every tensor is the live
    parameter (no copy), so the transport may send from it directly (`stable_tensors`)."""

    stable_tensors = True

    def __init__(self, model: torch.nn.Module, *, adapter: str = "default", spec: LoraSpec | None = None, dtype: torch.dtype | None = None) -> None:
        self.spec = spec if spec is not None else lora_spec_of(model, adapter)
        self.dtype = dtype
        self.weights: dict[str, torch.Tensor] = {}
        for name, p in model.named_parameters():
            wire = peft_wire_name(name, adapter)
            if wire is not None:
                self.weights[wire] = p.detach()
        if not self.weights:
            raise ValueError(f"{type(model).__name__} holds no LoRA parameters of adapter {adapter!r}")
        ranks = {t.shape[0] for n, t in self.weights.items() if ".lora_A." in n}
        if ranks != {self.spec.rank}:
            raise ValueError(f"adapter {adapter!r}: lora_A ranks {sorted(ranks)} differ from its config's r={self.spec.rank}")
        self._config = self.spec.encode()

    def metadata(self) -> list[TensorSpec]:
        return [spec_of(n, t, self.dtype) for n, t in self.weights.items()] + [spec_of(ADAPTER_CONFIG, self._config)]

    @property
    def device(self) -> torch.device | None:
        return tensors_device(self.weights.values())

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for n, t in self.weights.items():
            yield n, t if self.dtype is None or t.dtype == self.dtype else t.to(self.dtype)
        yield ADAPTER_CONFIG, self._config
