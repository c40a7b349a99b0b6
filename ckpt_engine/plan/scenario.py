"""A set-up written as plain values (CLI flags, a JSON preset) turned into a :class:`SyncSetup`.

The CLI, the sweep and the published-figure presets all build set-ups here, so one set of
defaults and one set of error messages serve them all.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from ckpt_engine.plan.cluster import Links, parse_rollout, parse_trainer
from ckpt_engine.plan.cost import PARALLEL_SETS, SyncSetup
from ckpt_engine.plan.model_shapes import model_bytes

__all__ = ["Scenario", "SWEEPABLE"]

#: settings ``--sweep`` may vary, and how to read one value of each
SWEEPABLE = {
    "bucket_mb": float,
    "buffers": int,
    "senders": int,
    "delta": float,
    "nic_gbps": float,
    "nvlink_gbs": float,
}


@dataclass
class Scenario:
    """One planner question in plain values; ``setup()`` checks and resolves it."""

    model: str = "qwen2.5-7b"
    dtype: str = "bfloat16"
    trainer: str = "8xH100"
    rollout: str = "1x8xH100"
    nic_gbps: float | None = None
    nvlink_gbs: float | None = None
    pcie_gbs: float | None = None
    gpus_per_node: int = 8
    same_node: bool = False
    strategy: str = "single"
    senders: int | None = None
    delta: float | None = None
    bucket_mb: float = 1024.0
    buffers: int = 2
    loader: str = "vllm"
    export: str = "gather"
    receive: str = "full"
    overlap_export: bool = True
    fused_experts: bool = False
    parallel_sets: int = PARALLEL_SETS
    backend: str = "nccl"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Scenario:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**data)

    def setup(self) -> SyncSetup:
        trainer, rollout = parse_trainer(self.trainer), parse_rollout(self.rollout)
        if self.nic_gbps is not None and not self.nic_gbps > 0:
            raise ValueError(f"--nic-gbps must be > 0 (Gb/s per GPU), got {self.nic_gbps}")
        if self.gpus_per_node < 1:
            raise ValueError(f"--gpus-per-node must be >= 1, got {self.gpus_per_node}")
        if self.dtype not in ("bfloat16", "fp8"):
            raise ValueError(f"--dtype {self.dtype!r}: use bfloat16 or fp8")
        gpu = rollout.gpu
        links = Links(
            nvlink_gbs=self.nvlink_gbs if self.nvlink_gbs is not None else gpu.nvlink_gbs,
            nic_gbs=(self.nic_gbps if self.nic_gbps is not None else gpu.nic_gbps) / 8,
            pcie_gbs=self.pcie_gbs if self.pcie_gbs is not None else gpu.pcie_gbs,
            gpus_per_node=self.gpus_per_node,
            same_node=self.same_node,
        )
        return SyncSetup(
            model=model_bytes(self.model, dtype=self.dtype, fused_experts=self.fused_experts),
            trainer=trainer,
            rollout=rollout,
            links=links,
            strategy=self.strategy,
            delta=self.delta,
            bucket_bytes=int(self.bucket_mb * 2**20),
            num_buffers=self.buffers,
            loader=self.loader,
            export=self.export if trainer.num_shards > 1 or self.export != "gather" else "none",
            senders=self.senders,
            receive=self.receive,
            overlap_export=self.overlap_export,
            parallel_sets=self.parallel_sets,
            backend=self.backend,
        )
