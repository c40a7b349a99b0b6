"""The wire layout of an adapter-only (LoRA) sync, shared by the senders and every engine.

An adapter sync carries exactly what PEFT saves for one adapter: per target module
`base_model.model.<module>.lora_A.weight` ([rank, in_features]) and `...lora_B.weight`
([out_features, rank]), plus one uint8 tensor named `adapter_config.json` holding the adapter's
PEFT config as JSON (rank, alpha, target modules, rsLoRA). So the manifest alone tells an engine the
rank, the target modules and every shape before a byte moves, and the config (alpha) travels with
the tensors it scales, in the same version; no second config has to agree with the trainer's.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import cast

import torch

from ckpt_engine.manifest import TensorSpec

__all__ = [
    "ADAPTER_CONFIG",
    "PEFT_PREFIX",
    "AdapterLayout",
    "LoraSpec",
    "adapter_layout",
    "check_adapter",
    "peft_wire_name",
]

ADAPTER_CONFIG = "adapter_config.json"
"""The name of the uint8 tensor that carries the adapter's PEFT config (JSON)."""
PEFT_PREFIX = "base_model.model."
MAX_CONFIG_BYTES = 1 << 16

_LORA_NAME = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")


@dataclass(frozen=True)
class LoraSpec:
    """What an engine needs besides the tensors: PEFT's `r`, `lora_alpha`, `target_modules`, `use_rslora`."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    use_rslora: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoRA rank must be a positive int, got {self.rank!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not self.alpha > 0:
            raise ValueError(f"LoRA alpha must be a positive number, got {self.alpha!r}")
        if not self.target_modules or not all(isinstance(m, str) and m for m in self.target_modules):
            raise ValueError(f"LoRA target_modules must be non-empty module names, got {self.target_modules!r}")

    def peft_config(self) -> dict[str, object]:
        """The fields of PEFT's `adapter_config.json` an engine reads (vLLM's `PEFTHelper.from_dict`)."""
        return {
            "peft_type": "LORA",
            "r": self.rank,
            "lora_alpha": self.alpha,
            "target_modules": sorted(self.target_modules),
            "use_rslora": self.use_rslora,
            "bias": "none",
        }

    def encode(self) -> torch.Tensor:
        """The config as the uint8 tensor that travels under `ADAPTER_CONFIG` (same bytes every sync)."""
        raw = json.dumps(self.peft_config(), sort_keys=True).encode()
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8)

    @classmethod
    def decode(cls, tensor: torch.Tensor) -> LoraSpec:
        """Read a received config tensor; a malformed one is refused by what is wrong with it."""
        if tensor.dtype != torch.uint8 or tensor.dim() != 1 or tensor.numel() > MAX_CONFIG_BYTES:
            raise ValueError(f"{ADAPTER_CONFIG}: expected a 1-D uint8 tensor of at most {MAX_CONFIG_BYTES} bytes")
        try:
            d = json.loads(bytes(tensor.cpu().numpy().tobytes()).decode())
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{ADAPTER_CONFIG}: not JSON ({exc})") from None
        if not isinstance(d, dict) or d.get("peft_type", "LORA") != "LORA":
            raise ValueError(f"{ADAPTER_CONFIG}: expected a PEFT LoRA config, got {str(d)[:120]}")
        targets = d.get("target_modules")
        targets = [targets] if isinstance(targets, str) else targets
        # rank and alpha as sent: __post_init__ refuses a missing or malformed one
        return cls(cast(int, d.get("r")), cast(float, d.get("lora_alpha")), tuple(targets or ()), bool(d.get("use_rslora", False)))

    @classmethod
    def from_peft(cls, config: object) -> LoraSpec:
        """From a `peft.LoraConfig` (attributes r, lora_alpha, target_modules, use_rslora); rank or
        alpha patterns per module are refused (one rank and one scaling per adapter here)."""
        for field in ("rank_pattern", "alpha_pattern"):
            if getattr(config, field, None):
                raise ValueError(f"LoRA {field} is not supported by adapter syncs (one rank and alpha per adapter)")
        if getattr(config, "use_dora", False):
            raise ValueError("DoRA adapters are not supported by adapter syncs (vLLM serves plain LoRA)")
        targets = config.target_modules  # type: ignore[attr-defined]
        targets = (targets,) if isinstance(targets, str) else tuple(sorted(targets))
        return cls(int(config.r), float(config.lora_alpha), targets, bool(config.use_rslora))  # type: ignore[attr-defined]

    def config_spec(self) -> TensorSpec:
        return TensorSpec(ADAPTER_CONFIG, "uint8", (self.encode().numel(),))


def peft_wire_name(param_name: str, adapter: str = "default") -> str | None:
    """The saved-PEFT name of a PeftModel parameter of `adapter` (`...q_proj.lora_A.default.weight`
    -> `...q_proj.lora_A.weight`); None for any other parameter (base weights, other adapters)."""
    for ab in ("A", "B"):
        seg = f".lora_{ab}.{adapter}.weight"
        if param_name.endswith(seg):
            name = param_name[: -len(seg)] + f".lora_{ab}.weight"
            return name if name.startswith(PEFT_PREFIX) else PEFT_PREFIX + name
    return None


@dataclass(frozen=True)
class AdapterLayout:
    """What a manifest's tensor specs say of the adapter: its rank(s), modules and their shapes."""

    modules: dict[str, tuple[TensorSpec | None, TensorSpec | None]]
    """Module path (HF names, e.g. `model.layers.0.self_attn.q_proj`) -> (lora_A spec, lora_B spec)."""
    config: TensorSpec | None
    others: list[str]
    """Names that are neither LoRA tensors nor the config."""

    @property
    def ranks(self) -> set[int]:
        return {a.shape[0] for a, _ in self.modules.values() if a is not None and len(a.shape) == 2}

    @property
    def targets(self) -> set[str]:
        return {m.rsplit(".", 1)[-1] for m in self.modules}


def adapter_layout(specs: Iterable[TensorSpec]) -> AdapterLayout:
    modules: dict[str, list[TensorSpec | None]] = {}
    config, others = None, []
    for s in specs:
        if s.name == ADAPTER_CONFIG:
            config = s
            continue
        m = _LORA_NAME.match(s.name)
        if m is None:
            others.append(s.name)
            continue
        modules.setdefault(m["module"], [None, None])[0 if m["ab"] == "A" else 1] = s
    return AdapterLayout({k: (v[0], v[1]) for k, v in modules.items()}, config, others)


def check_adapter(
    specs: Iterable[TensorSpec],
    *,
    max_rank: int,
    base_shapes: Mapping[str, tuple[int, int]],
    targets: Iterable[str] | None = None,
) -> list[str]:
    """Problems with serving the adapter a manifest describes on an engine ([] = fine), each naming
    its tensor or setting: the engine's LoRA config allows ranks up to `max_rank` and the modules in
    `targets` (leaf names such as `q_proj`; None: any module in `base_shapes`); `base_shapes` maps
    each module the engine can adapt to its base weight's (out_features, in_features)."""
    layout = adapter_layout(specs)
    problems = [f"{n}: not a LoRA tensor (adapter syncs carry only PEFT lora_A / lora_B weights and {ADAPTER_CONFIG})" for n in layout.others]
    if layout.config is None:
        problems.append(f"{ADAPTER_CONFIG}: the manifest lacks the adapter's config tensor")
    elif layout.config.dtype != "uint8" or len(layout.config.shape) != 1:
        problems.append(f"{ADAPTER_CONFIG}: must be a 1-D uint8 tensor, got {layout.config.dtype} {list(layout.config.shape)}")
    elif not 1 <= layout.config.shape[0] <= MAX_CONFIG_BYTES:  # what `LoraSpec.decode` takes at finalize, checked before a byte moves
        problems.append(f"{ADAPTER_CONFIG}: {layout.config.shape[0]} bytes; a PEFT config takes 1 to {MAX_CONFIG_BYTES} bytes")
    if not layout.modules:
        problems.append("the manifest holds no LoRA tensors")
    allowed = set(targets) if targets is not None else None
    ranks = layout.ranks
    if len(ranks) > 1:
        problems.append(f"lora_A ranks differ between modules ({sorted(ranks)}); an adapter sync carries one rank")
    for r in sorted(ranks):
        if r < 1:
            problems.append(f"LoRA rank {r} (from the lora_A shapes): an adapter has rank 1 to the engine's max_lora_rank {max_rank}")
        if r > max_rank:
            problems.append(f"LoRA rank {r} exceeds the engine's max_lora_rank {max_rank}")
    for module, (a, b) in sorted(layout.modules.items()):
        leaf = module.rsplit(".", 1)[-1]
        if allowed is not None and leaf not in allowed:
            problems.append(f"{module}: target module {leaf!r} is not among the engine's LoRA target modules {sorted(allowed)}")
            continue
        base = base_shapes.get(module)
        if base is None:
            problems.append(f"{module}: the engine has no LoRA-capable module of this name")
            continue
        if a is None or b is None:
            problems.append(f"{module}: lora_{'A' if a is None else 'B'}.weight is missing (send both or neither)")
            continue
        out_f, in_f = base
        r = a.shape[0] if len(a.shape) == 2 else -1
        if tuple(a.shape) != (r, in_f):
            problems.append(f"{a.name}: shape {list(a.shape)} but the engine's {module} needs [rank, {in_f}]")
        if tuple(b.shape) != (out_f, r):
            problems.append(f"{b.name}: shape {list(b.shape)} but the engine's {module} needs [{out_f}, {r}]")
    return problems


def largest_adapter(max_rank: int, base_shapes: Mapping[str, tuple[int, int]], targets: Iterable[str] | None = None) -> list[TensorSpec]:
    """The specs of the largest adapter an engine's LoRA config admits (every allowed module at
    `max_rank`, float32, and the biggest config): what a manifest's decode budget allows."""
    allowed = set(targets) if targets is not None else None
    specs = [TensorSpec(ADAPTER_CONFIG, "uint8", (MAX_CONFIG_BYTES,))]
    for module, (out_f, in_f) in base_shapes.items():
        if allowed is None or module.rsplit(".", 1)[-1] in allowed:
            specs.append(TensorSpec(f"{PEFT_PREFIX}{module}.lora_A.weight", "float32", (max_rank, in_f)))
            specs.append(TensorSpec(f"{PEFT_PREFIX}{module}.lora_B.weight", "float32", (out_f, max_rank)))
    return specs


def check_finite(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """The names of floating-point adapter tensors holding NaN or infinity (an engine must not serve them)."""
    return [n for n, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
