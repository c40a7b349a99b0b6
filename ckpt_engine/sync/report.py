"""What a sync reports: its figures (`SyncReport`) or, when it fails mid-way, who failed (`SyncError`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ckpt_engine.delta.request import DeltaRequest
    from ckpt_engine.manifest import BucketManifest
    from ckpt_engine.rollout_adapters.base import ReceiveReport
    from ckpt_engine.engine import SendStats

__all__ = ["RATIO_MEANING", "SOURCE", "SyncError", "SyncReport", "make_report"]


BEFORE_PAUSE = frozenset({"join", "validate"})
"""Stages that end before any engine is paused: a failure there leaves every engine serving."""


class SyncError(RuntimeError):
    """A sync failed at `stage`; `failed` names the culprits: engines, "sender", or SOURCE.

    After the pause, every surviving engine stays paused and stale until a later sync completes.
    `sender_error` keeps the sender's own exception when the culprits are others. `stale`: every
    engine the next sync reseeds; the message says what each does meanwhile, and `serving` lists
    those that went live with the new version (a swap or a resume went through before the failure).
    """

    def __init__(self, stage: str, failed: dict[str, str], stale: list[str], *, sender_error: str | None = None) -> None:
        detail = "; ".join(f"{name}: {why}" for name, why in failed.items())
        self._head = f"weight sync failed during {stage}: {detail}" + (f"; the sender saw: {sender_error}" if sender_error else "")
        if stage in BEFORE_PAUSE:
            left = f"nothing was paused; engines to rejoin at the next sync: {', '.join(stale) or 'none'}"
        else:
            left = f"engines left paused and stale: {', '.join(stale) or 'none'}"
        super().__init__(f"{self._head}; {left}")
        self.stage, self.failed, self.stale, self.sender_error = stage, failed, stale, sender_error
        self.serving: list[str] = []

    def restate(self, left: str, serving: list[str] | None = None) -> None:
        """Say what the engines were left doing (`sync/progress.py` knows): `left` replaces the words
        after the failures; `serving`: the engines that went live with the new version."""
        self.args = (f"{self._head}; {left}",)
        self.serving = sorted(serving or [])


RATIO_MEANING = (
    "ratio_to_raw = raw's seconds / these seconds for the same dense bytes (this GB/s over raw's): "
    "higher is better, 1.0 = as fast as raw, above 1 beats it (e.g. patches)"
)
"""The one meaning of `ratio_to_raw`, in `SyncReport` and in every `ckpt-engine bench` JSON."""

SOURCE = "weight source"
"""The key of `SyncError.failed` when the trainer's own weight source raised (no engine failed)."""


@dataclass
class SyncReport:
    """One sync's figures. `seconds["transfer"]` runs from the first bucket sent to the last
    receiver done loading (streaming and loading overlap); `export`/`pack` are the sender's host
    time inside it, `load_max` the slowest engine's loader time."""

    version: int
    bytes: int
    """The plan's bytes: every tensor of the trainer's checkpoint once, whoever holds it."""
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
    """Bytes every sender together put on the wire (patches plus dense buckets): the figure to
    hold against the senders' links. Equals `dense_bytes` when nothing was patched. A dense sync
    counts the tensor bytes it sends; with region delivery only the pieces some rank holds, each
    once per receiver set it travels to (a piece two TP ranks hold goes once to their set), so a
    tensor no rank holds is not counted and `wire_bytes` may be below `bytes` and below the sum of
    `received_bytes` (issue 42 item 3). A delta sync counts its frames (dense frames are whole
    buckets, alignment included)."""
    dense_bytes: int = 0
    """What a dense sync of the same plan and region delivery sends, from every sender."""
    changed_fraction: float = 1.0
    """Words that changed since the base, over every sender's buckets (1.0 for a dense sync)."""
    senders: int = 1
    base_bytes: int = 0
    """Memory of this rank's delta base copies."""
    received_bytes: dict[str, list[int]] = field(default_factory=dict)
    """Per engine, the bytes each of its ranks takes in a dense sync: `bytes` (the model) each,
    or with region delivery (issue 27) only what that rank holds."""
    wire_bytes_per_sender: list[int] = field(default_factory=list)
    """Each sender's share of `wire_bytes`, sender 0 first."""
    staged: str = "off"
    """How the engines took this sync (issue 28): `off` (paused for the whole sync), `patches` or
    `full` (streamed into a staging area while serving, paused only for the swap)."""
    engine_gbps: dict[str, float] = field(default_factory=dict)
    """Per engine, the rate it achieved (issue 43's guardrail): the bytes its ranks took over its
    receive seconds (0.0 where an engine reported no receive time). A link that silently fell
    back to a slower wire shows here first; the pull transport also checks each link against a
    floor as it reads (`engine_kwargs.nixl.min_gbps`)."""
    stall_s: float = 0.0
    """The engines' largest stall: seconds an engine produced no tokens because of this sync (the
    swap when staged; pause to resume otherwise), beside `seconds["transfer"]`."""

    @property
    def ratio_to_raw(self) -> float | None:
        """`RATIO_MEANING`: raw seconds / this sync's seconds (higher is better)."""
        return self.gbps / self.raw_gbps if self.raw_gbps else None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ratio_to_raw"] = self.ratio_to_raw
        return d


def make_report(
    version: int, manifest: BucketManifest, request: DeltaRequest | None, stats: SendStats,
    receivers: Mapping[str, ReceiveReport], engines: int, senders: int, seconds: dict[str, float], raw_gbps: float | None,
    other_senders: Sequence[Mapping[str, float]] = (), region_bytes: Sequence[int] | None = None,
) -> SyncReport:
    """A completed sync's report from the plan, the sender's stats, the other senders' figures
    (`sender_follower.send_figures`, gathered in the report round) and every engine's receive
    report; fills the sender's and receivers' entries of `seconds`. Wire and dense bytes count
    every sender; `region_bytes` (`RegionDelivery.sent_bytes`): each sender's bytes of a dense
    sync that delivers regions."""
    seconds.update(export=stats.export_s, pack=stats.pack_s, send=stats.total_s)
    if "encode_s" in stats.extra:
        seconds["encode"] = stats.extra["encode_s"]
    seconds["apply_max"] = max((r.extra.get("delta_apply_s", 0.0) for r in receivers.values()), default=0.0)
    seconds["load_max"] = max((r.load_s for r in receivers.values()), default=0.0)
    starts = [r.extra["start_s"] for r in receivers.values() if "start_s" in r.extra]
    if starts:  # engines that time their receive's setup (vLLM workers): the slowest, from its begin to its first bucket
        seconds["receive_start_max"] = max(starts)
    if request is None and region_bytes is not None:  # dense, regions: the pieces some rank holds
        per_sender = list(region_bytes)
        wire = dense = sum(per_sender)
        changed = 1.0
    elif request is None:  # dense: the plan's bytes, whoever sent them
        wire = dense = manifest.total_bytes
        per_sender = manifest.bytes_per_sender() if senders > 1 else [wire]
        changed = 1.0
    else:
        own: dict[str, float] = {k: float(stats.extra[k]) for k in ("wire_bytes", "dense_bytes", "changed_fraction") if k in stats.extra}
        own.setdefault("wire_bytes", float(manifest.wire_bytes if senders == 1 else sum(b.nbytes for b in manifest.sender_buckets(0))))
        own.setdefault("dense_bytes", own["wire_bytes"])
        shares: list[Mapping[str, float]] = [own, *other_senders]
        per_sender = [int(f.get("wire_bytes", 0.0)) for f in shares]
        wire = sum(per_sender)
        dense = int(sum(f.get("dense_bytes", 0.0) for f in shares))
        weight = [f.get("dense_bytes", 0.0) for f in shares]
        changed = sum(w * f.get("changed_fraction", 1.0) for w, f in zip(weight, shares)) / sum(weight) if sum(weight) else 1.0
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
        changed_fraction=float(changed) if request is not None and request.patches else 1.0,
        senders=senders,
        base_bytes=int(stats.extra.get("base_bytes", 0)),
        wire_bytes_per_sender=per_sender,
        engine_gbps={n: r.bytes / r.receive_s / 1e9 if r.receive_s > 0 else 0.0 for n, r in receivers.items()},
    )
