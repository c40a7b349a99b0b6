"""Who sends, who receives, over which links: the cluster a sync runs on.

Layouts are written the way people say them: ``256xH800`` (a trainer of 256 GPUs, optionally
``256xH800:tp=8,pp=4,ep=8`` for Megatron; FSDP otherwise) and ``16x8xH800`` (16 rollout engines
of 8 GPUs each). Link rates are peak figures per GPU and per direction; the calibration supplies
how much of them a broadcast actually gets.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

__all__ = ["GPUS", "GpuSpec", "Links", "RolloutLayout", "TrainerLayout", "parse_rollout", "parse_trainer"]


@dataclass(frozen=True)
class GpuSpec:
    """Published per-GPU figures: NVLink GB/s per direction, HBM GB/s, memory GiB, default NIC Gb/s."""

    name: str
    nvlink_gbs: float
    hbm_gbs: float
    mem_gib: float
    nic_gbps: float
    pcie_gbs: float


GPUS = {
    "H100": GpuSpec("H100", 450.0, 3350.0, 80.0, 400.0, 55.0),
    "H200": GpuSpec("H200", 450.0, 4800.0, 141.0, 400.0, 55.0),
    "H800": GpuSpec("H800", 200.0, 3350.0, 80.0, 400.0, 55.0),
    "H20": GpuSpec("H20", 450.0, 4000.0, 96.0, 400.0, 55.0),
    "A100": GpuSpec("A100", 300.0, 2039.0, 80.0, 200.0, 25.0),
    "B200": GpuSpec("B200", 900.0, 8000.0, 180.0, 400.0, 55.0),
}


def _gpu(name: str, flag: str) -> GpuSpec:
    spec = GPUS.get(name.upper())
    if spec is None:
        raise ValueError(f"{flag}: unknown GPU {name!r}; known: {', '.join(GPUS)}")
    return spec


@dataclass(frozen=True)
class TrainerLayout:
    """The training job: ``num_gpus`` GPUs; ``tp * pp * ep`` distinct weight shards per replica
    (Megatron) or ``num_gpus`` shards (FSDP, ``fsdp=True``)."""

    num_gpus: int
    gpu: GpuSpec
    tp: int = 1
    pp: int = 1
    ep: int = 1
    fsdp: bool = True

    @property
    def num_shards(self) -> int:
        """Ranks that hold distinct parts of the weights: the most senders there can be."""
        return self.num_gpus if self.fsdp else min(self.num_gpus, self.tp * self.pp * self.ep)


@dataclass(frozen=True)
class RolloutLayout:
    """``num_engines`` engines of ``gpus_per_engine`` GPUs (TP x EP inside an engine)."""

    num_engines: int
    gpus_per_engine: int
    gpu: GpuSpec

    @property
    def num_gpus(self) -> int:
        return self.num_engines * self.gpus_per_engine


@dataclass(frozen=True)
class Links:
    """Per-GPU link rates in GB/s (per direction) and the node size."""

    nvlink_gbs: float
    nic_gbs: float
    pcie_gbs: float
    gpus_per_node: int = 8
    same_node: bool = False

    def __post_init__(self) -> None:
        for field in ("nvlink_gbs", "nic_gbs", "pcie_gbs"):
            if not getattr(self, field) > 0:
                raise ValueError(f"Links.{field} must be > 0, got {getattr(self, field)!r}")
        if self.gpus_per_node < 1:
            raise ValueError(f"Links.gpus_per_node must be >= 1, got {self.gpus_per_node}")

    def nodes(self, num_gpus: int) -> int:
        return max(1, math.ceil(num_gpus / self.gpus_per_node))


_TRAINER = re.compile(r"^(\d+)x([A-Za-z0-9]+)(?::(.*))?$")
_ROLLOUT = re.compile(r"^(\d+)x(?:(\d+)x)?([A-Za-z0-9]+)$")


def parse_trainer(text: str) -> TrainerLayout:
    """``256xH800`` (FSDP over 256 GPUs) or ``64xH20:tp=4,pp=4,ep=8`` (Megatron)."""
    match = _TRAINER.match(text.strip())
    if not match:
        raise ValueError(f"--trainer {text!r}: write GPUSxTYPE[:tp=N,pp=N,ep=N], e.g. 256xH800 or 64xH20:tp=4,pp=4")
    num, gpu, extra = int(match.group(1)), _gpu(match.group(2), "--trainer"), match.group(3)
    if num < 1:
        raise ValueError(f"--trainer {text!r}: needs at least 1 GPU")
    dims = {"tp": 1, "pp": 1, "ep": 1}
    if extra:
        for part in extra.split(","):
            key, _, value = part.partition("=")
            if key not in dims or not value.isdigit() or int(value) < 1:
                raise ValueError(f"--trainer {text!r}: parallel sizes are tp=N, pp=N, ep=N with N >= 1")
            dims[key] = int(value)
    layout = TrainerLayout(num, gpu, fsdp=not extra, **dims)
    if not layout.fsdp and num % (dims["tp"] * dims["pp"]) != 0:
        raise ValueError(f"--trainer {text!r}: {num} GPUs are not a multiple of tp*pp = {dims['tp'] * dims['pp']}")
    return layout


def parse_rollout(text: str) -> RolloutLayout:
    """``16x8xH800`` (16 engines of 8 GPUs) or ``4xH20`` (4 engines of 1 GPU)."""
    match = _ROLLOUT.match(text.strip())
    if not match:
        raise ValueError(f"--rollout {text!r}: write ENGINESxGPUS_PER_ENGINExTYPE, e.g. 16x8xH800")
    engines, per = int(match.group(1)), int(match.group(2) or 1)
    if engines < 1 or per < 1:
        raise ValueError(f"--rollout {text!r}: needs at least 1 engine of 1 GPU")
    return RolloutLayout(engines, per, _gpu(match.group(3), "--rollout"))
