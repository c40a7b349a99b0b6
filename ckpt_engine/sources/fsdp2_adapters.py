"""`AdapterExport`: what `FSDP2Source(adapter=...)` exports: one PEFT adapter's LoRA tensors under
PEFT's saved names, then its config tensor (`lora_format.py`); the frozen base never moves. One
sender gathers each LoRA tensor alone (`full_tensor()`, a collective every rank walks in order)
instead of whole decoder layers; many senders send their own rows, as for any FSDP2 tensor."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ckpt_engine.lora_format import ADAPTER_CONFIG, LoraSpec, peft_wire_name
from ckpt_engine.manifest import TensorSpec
from ckpt_engine.sources.adapters import lora_spec_of
from ckpt_engine.sources.export_plan import ExportEntry

__all__ = ["AdapterExport"]


class _ConfigHolder(nn.Module):
    """Holds the config tensor as a buffer, so the export plan treats it as a replicated entry."""

    config: torch.Tensor

    def __init__(self, config: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("config", config)


class AdapterExport:
    """The adapter-only export plan of a PEFT model sharded by FSDP2 (built before sharding)."""

    def __init__(self, model: nn.Module, adapter: str) -> None:
        self.adapter = adapter
        self.spec: LoraSpec = lora_spec_of(model, adapter)
        self.holder = _ConfigHolder(self.spec.encode())

    def entries(self, entries: list[ExportEntry]) -> list[ExportEntry]:
        """Keep the adapter's LoRA entries (renamed to PEFT's saved names), then the config entry."""
        kept = []
        for e in entries:
            wire = peft_wire_name(e.name, self.adapter)
            if wire is None:
                continue
            e.name = wire
            e.specs = [TensorSpec(wire, s.dtype, s.shape) for s in e.specs]
            kept.append(e)
        if not kept:
            raise ValueError(f"the model holds no LoRA parameters of adapter {self.adapter!r} (FSDP2Config.weights='adapters')")
        ranks = {e.shape[0] for e in kept if ".lora_A." in e.name}
        if ranks != {self.spec.rank}:
            raise ValueError(f"adapter {self.adapter!r}: lora_A ranks {sorted(ranks)} differ from its config's r={self.spec.rank}")
        config = self.holder.config
        kept.append(ExportEntry(0, self.holder, "config", True, ADAPTER_CONFIG, tuple(config.shape), config.dtype, [self.spec.config_spec()]))
        return kept

    def iter_weights(self, entries: list[ExportEntry], master: Callable[[ExportEntry], Any]) -> Iterator[tuple[str, torch.Tensor]]:
        """Each LoRA tensor gathered on its own (collective: every rank walks it to its end)."""
        with torch.no_grad():
            for e in entries:
                spec = e.specs[0]
                if e.module is self.holder:
                    yield spec.name, self.holder.config
                    continue
                t = master(e)
                t = t.full_tensor() if isinstance(t, torch.distributed.tensor.DTensor) else t
                want = getattr(torch, spec.dtype)
                yield spec.name, t if t.dtype == want else t.to(want)
