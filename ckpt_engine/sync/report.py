"""What a sync reports: its figures (`SyncReport`) or, when it fails mid-way, who failed (`SyncError`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ckpt_engine.delta.request import DeltaRequest
    from ckpt_engine.manifest import BucketManifest
    from ckpt_engine.rollout_adapters.base import ReceiveReport
    from ckpt_engine.transports.base import SendStats

__all__ = ["SOURCE", "SyncError", "SyncReport", "make_report"]


class SyncError(RuntimeError):
    """A sync failed at `stage`; `failed` names the culprits: engines, "sender", or SOURCE.

    After the pause, every surviving engine stays paused and stale until a later sync completes.
    `sender_error` keeps the sender's own exception when the culprits are others.
    """

    def __init__(self, stage: str, failed: dict[str, str], stale: list[str], *, sender_error: str | None = None) -> None:
        detail = "; ".join(f"{name}: {why}" for name, why in failed.items())
        also = f"; the sender saw: {sender_error}" if sender_error else ""
        super().__init__(
            f"weight sync failed during {stage}: {detail}{also}; engines left paused and stale: {', '.join(stale) or 'none'}"
        )
        self.stage, self.failed, self.stale, self.sender_error = stage, failed, stale, sender_error


SOURCE = "weight source"
"""The key of `SyncError.failed` when the trainer's own weight source raised (no engine failed)."""


@dataclass
class SyncReport:
    """One sync's figures. `seconds["transfer"]` runs from the first bucket sent to the last
    receiver done loading (streaming and loading overlap); `export`/`pack` are the sender's host
    time inside it, `load_max` the slowest engine's loader time."""

    version: int
    bytes: int
    tensors: int
    buckets: int
    engines: int
    seconds: dict[str, float] = field(default_factory=dict)
    gbps: float = 0.0
    raw_gbps: float | None = None
    receivers: dict[str, dict[str, Any]] = field(default_factory=dict)
    delta: str = "off"
    """`off` (no base copies), `seed` (dense, (re)seeding the bases), or `patch` (patches allowed)."""
    wire_bytes: int = 0
    """Bytes the senders put on the wire (patches plus dense buckets); equals `dense_bytes` when nothing was patched."""
    dense_bytes: int = 0
    """What a dense sync of the same plan sends."""
    changed_fraction: float = 1.0
    """Words that changed since the base (1.0 for a dense sync)."""
    senders: int = 1
    base_bytes: int = 0
    """Memory of this rank's delta base copies."""
    received_bytes: dict[str, list[int]] = field(default_factory=dict)
    """Per engine, the bytes each of its ranks takes in a dense sync: `bytes` (the model) each,
    or with region delivery (issue 27) only what that rank holds."""

    @property
    def ratio_to_raw(self) -> float | None:
        return self.gbps / self.raw_gbps if self.raw_gbps else None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ratio_to_raw"] = self.ratio_to_raw
        return d


def make_report(
    version: int, manifest: BucketManifest, request: DeltaRequest | None, stats: SendStats,
    receivers: Mapping[str, ReceiveReport], engines: int, senders: int, seconds: dict[str, float], raw_gbps: float | None,
) -> SyncReport:
    """A completed sync's report from the plan, the sender's stats and every engine's receive
    report; fills the sender's and receivers' entries of `seconds`."""
    seconds.update(export=stats.export_s, pack=stats.pack_s, send=stats.total_s)
    if "encode_s" in stats.extra:
        seconds["encode"] = stats.extra["encode_s"]
    seconds["apply_max"] = max((r.extra.get("delta_apply_s", 0.0) for r in receivers.values()), default=0.0)
    wire = int(stats.extra.get("wire_bytes", manifest.wire_bytes)) if request is not None else manifest.total_bytes
    dense = int(stats.extra.get("dense_bytes", manifest.wire_bytes)) if request is not None else manifest.total_bytes
    seconds["load_max"] = max((r.load_s for r in receivers.values()), default=0.0)
    return SyncReport(
        version=version,
        bytes=manifest.total_bytes,
        tensors=manifest.num_tensors,
        buckets=manifest.num_buckets,
        engines=engines,
        seconds=seconds,
        gbps=manifest.total_bytes / seconds["transfer"] / 1e9 if seconds["transfer"] > 0 else 0.0,
        raw_gbps=raw_gbps,
        receivers={n: r.to_dict() for n, r in receivers.items()},
        delta="off" if request is None else ("patch" if request.patches else "seed"),
        wire_bytes=wire,
        dense_bytes=dense,
        changed_fraction=float(stats.extra.get("changed_fraction", 1.0)) if request is not None and request.patches else 1.0,
        senders=senders,
        base_bytes=int(stats.extra.get("base_bytes", 0)),
    )
