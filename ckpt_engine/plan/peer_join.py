"""A late joiner's time to serve (docs/elastic.md): an engine that registers or restarts mid-job
pulls the version a serving peer holds, from that peer, and serves once every tensor checks out.

Each joiner rank reads its share (the model's bytes / GPUs per engine) from the peer's matching
rank over one link, up to `MAX_WINDOW` reads in flight (`elastic/pull.py`; tensors back to back on both
sides are one read, not counted here), and nothing else waits on it, so

    time to serve = bytes per rank / link rate                      (the reads)
                  + tensors x per-tensor cost + bytes / rate       (the joiner's checksums)
                  + the same again for the peer's checksums          (once per version it holds)
                  + tensors / MAX_WINDOW x per-message latency
                  + a process's first NIXL agent + the control calls (fixed)

The checksums are taken on the device, all of a device's tensors in one launch per word size
(`elastic.offer.tensor_checksums`): ~4 TB/s of bytes and ~16 us per tensor on an H200 (measured,
`params.ASSUMED`); `without_checksums_s` says what the reads and fixed costs alone give. The fixed
costs are the CPU box's; a 24-layer Qwen3-30B-A3B join on 2xH200 served in 3.9 s
(`bench/RESULTS.md`), its peer's first NIXL agent and per-tensor offer the largest part.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from ckpt_engine.plan.cluster import Links, RolloutLayout
from ckpt_engine.plan.model_shapes import ModelBytes
from ckpt_engine.plan.params import Calibration
from ckpt_engine.plan.pull import pull_link_gbs

__all__ = ["ISSUE_SLACK_S", "MAX_WINDOW", "JoinPrediction", "predict_join"]

MAX_WINDOW = 256
"""Reads a joiner keeps in flight at most (`ckpt_engine.elastic.pull.MAX_WINDOW`; the planner imports no torch)."""
ISSUE_SLACK_S = 2.0
"""Issue 43's bar: a late joiner serves within model bytes per rank / link rate + 2 s."""


@dataclass(frozen=True)
class JoinPrediction:
    """Seconds from a joiner's process being ready to it serving, by part."""

    bytes_per_rank: float
    link: str
    link_gbs: float
    read_s: float
    check_s: float
    peer_check_s: float
    window_s: float
    fixed_s: float

    @property
    def total_s(self) -> float:
        return self.read_s + self.check_s + self.peer_check_s + self.window_s + self.fixed_s

    @property
    def without_checksums_s(self) -> float:
        """What the reads and the fixed costs alone give (checksums taken elsewhere, or on the GPU)."""
        return self.read_s + self.window_s + self.fixed_s

    @property
    def bar_s(self) -> float:
        """Issue 43's bar for this join: bytes per rank / link rate + 2 s."""
        return self.read_s + ISSUE_SLACK_S

    def to_json(self) -> dict[str, object]:
        return {**asdict(self), "total_s": self.total_s, "without_checksums_s": self.without_checksums_s, "bar_s": self.bar_s}


def predict_join(model: ModelBytes, rollout: RolloutLayout, links: Links, cal: Calibration, *, peer_checksums_cached: bool = False) -> JoinPrediction:
    """One engine of ``rollout``'s shape joining from a serving peer of the same shape.

    The two share NVLink when two such engines fit in one node, else they read over the NIC.
    ``peer_checksums_cached``: the peer took its checksums of this version for an earlier joiner.
    """
    nvlink = max(2, rollout.num_engines) * rollout.gpus_per_engine <= links.gpus_per_node
    gbs = pull_link_gbs(links, cal, nvlink=nvlink)
    per_rank = model.total_bytes / rollout.gpus_per_engine
    checks = model.num_tensors * cal.checksum_tensor_s + per_rank / (cal.checksum_gbs * 1e9)
    return JoinPrediction(
        bytes_per_rank=per_rank,
        link="NVLink" if nvlink else "NIC",
        link_gbs=gbs,
        read_s=per_rank / (gbs * 1e9),
        check_s=checks,
        peer_check_s=0.0 if peer_checksums_cached else checks,
        window_s=math.ceil(model.num_tensors / MAX_WINDOW) * cal.msg_latency_s,
        fixed_s=cal.nixl_agent_start_s + cal.join_rpc_s,
    )
