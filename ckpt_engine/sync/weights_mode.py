"""`checkpoint_engine.weights`: a sync carries full weights or only a LoRA adapter; both ends agree.

Checked on the sender before any engine is asked to validate or pause (only the read-only
membership query may be under way), so a trainer that sends an adapter to an engine expecting full
weights (or the reverse) is refused by name, with every engine serving.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

from ckpt_engine.lora_format import ADAPTER_CONFIG, adapter_layout
from ckpt_engine.manifest import TensorSpec
from ckpt_engine.rollout_adapters.base import RolloutAdapter

__all__ = ["check_weights_mode"]

_NAME = operator.attrgetter("name")


def check_weights_mode(mode: str, specs: Sequence[TensorSpec], rollouts: Sequence[RolloutAdapter]) -> None:
    """Raise ValueError when the source's tensors or an engine do not match `mode` (full | adapters)."""
    other = [r.name for r in rollouts if r.capabilities.weights != mode]
    if other:
        raise ValueError(
            f"checkpoint_engine.weights={mode!r} but engine(s) {', '.join(map(repr, other))} take "
            f"{'full weights' if mode == 'adapters' else 'adapter syncs'}; set checkpoint_engine.weights to match the engines"
        )
    if mode == "adapters":
        layout = adapter_layout(specs)
        if layout.others or layout.config is None or not layout.modules:
            bad = layout.others[:3] or ([ADAPTER_CONFIG] if layout.config is None else ["(no lora_A / lora_B tensors)"])
            raise ValueError(
                f"checkpoint_engine.weights='adapters' but the source does not send one LoRA adapter in PEFT's layout "
                f"({', '.join(bad)}); use AdapterSource(model) or FSDP2Config(weights='adapters')"
            )
    elif ADAPTER_CONFIG in map(_NAME, specs):  # read every sync: ~3x faster than a generator on a MoE's ~19,000 specs
        raise ValueError(
            "the source sends a LoRA adapter but checkpoint_engine.weights='full'; set checkpoint_engine.weights=adapters"
        )
