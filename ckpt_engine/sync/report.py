"""What a sync reports: its figures (`SyncReport`) or, when it fails mid-way, who failed (`SyncError`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["SOURCE", "SyncError", "SyncReport"]


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

    @property
    def ratio_to_raw(self) -> float | None:
        return self.gbps / self.raw_gbps if self.raw_gbps else None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ratio_to_raw"] = self.ratio_to_raw
        return d
