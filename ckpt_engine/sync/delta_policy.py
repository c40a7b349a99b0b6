"""When a sync may send patches: the controller's side of the delta version chain, and whether they pay.

Patches are sent only against bases every member of the group holds exactly: those of the last
sync that completed on this same group with this same plan. Anything else (the first sync, a new
or restarted engine, a rebuilt group, a new plan, a failed sync, `full_sync_every`) makes the
next sync a dense seed.

`auto` also sends dense whenever patches cost more than a dense sync would, from what the last
syncs cost on this transport (`SyncCosts`): a patch sync can be slower than dense where the link
is faster than the codec (NVLink at a high learning rate, a CPU box with large buckets). It first
measures a plain dense sync (the first sync of a group carries one-time costs and is not kept),
then seeds and patches; once three patch syncs were measured (the first ones compile kernels),
it compares the cheapest recent of each. Where patches cost more it sends plain dense syncs (no
bases kept) for a back-off that doubles each time a new probe still costs more, then probes
again: a seed, then one patch sync. A patch sync whose wire reached the dense bytes cost more
whatever the clock said (a dense sync's work plus the encode).
"""

from __future__ import annotations

import logging
import secrets
from collections import deque
from dataclasses import dataclass, field

from ckpt_engine.config import DELTA_MODES
from ckpt_engine.delta.request import DeltaRequest

__all__ = ["DELTA_MODES", "DeltaPolicy", "SyncCosts", "patches_pay"]

logger = logging.getLogger(__name__)

DENSE_SAMPLES = 3
"""Plain dense syncs whose cost is kept per transport (a seed also writes bases: not kept)."""
PATCH_SAMPLES = 3
"""Patch syncs whose cost is kept per transport: the cheapest of the last three is what patching
costs, so slow first syncs (the receivers', then the sender's kernels compiled at first use) or
one stall do not stop patching alone."""


def patches_pay(dense_s_per_byte: list[float], patch_s_per_byte: list[float]) -> bool | None:
    """Whether patch syncs cost less than dense ones, from recent seconds per dense byte of each:
    the cheapest of the recent samples on both sides (what each costs undisturbed). None until
    dense was measured and PATCH_SAMPLES patch syncs were (the first ones carry one-time costs)."""
    if not dense_s_per_byte or len(patch_s_per_byte) < PATCH_SAMPLES:
        return None
    return min(patch_s_per_byte) <= min(dense_s_per_byte)


@dataclass
class SyncCosts:
    """Recent seconds per dense byte of one transport's syncs (the plan's bytes, so plans of any
    size compare), dense and patch."""

    dense: deque[float] = field(default_factory=lambda: deque(maxlen=DENSE_SAMPLES))
    patch: deque[float] = field(default_factory=lambda: deque(maxlen=PATCH_SAMPLES))

    def record(self, request: DeltaRequest | None, seconds: float, dense_bytes: int) -> None:
        if dense_bytes <= 0 or seconds <= 0:
            return
        if request is None:
            self.dense.append(seconds / dense_bytes)
        elif request.patches:
            self.patch.append(seconds / dense_bytes)

    def verdict(self) -> bool | None:
        """patches_pay over the kept samples."""
        return patches_pay(list(self.dense), list(self.patch))


@dataclass
class DeltaPolicy:
    """One session's delta decisions (modes: config.DELTA_MODES): `request` before each sync,
    `completed` / `failed` after it, `forget` when the group is rebuilt."""

    mode: str = "off"
    full_sync_every: int = 0
    """A dense seed every this many syncs (0: only when needed)."""
    backoff_syncs: int = 4
    """auto: plain dense syncs after patches first cost more than dense, before probing again;
    doubled after each probe that still costs more, up to `max_backoff_syncs`."""
    max_backoff_syncs: int = 64

    def __post_init__(self) -> None:
        if self.mode not in DELTA_MODES:
            raise ValueError(f"delta must be one of {', '.join(DELTA_MODES)}, got {self.mode!r}")
        if not isinstance(self.full_sync_every, int) or self.full_sync_every < 0:
            raise ValueError(f"full_sync_every must be an int >= 0, got {self.full_sync_every!r}")
        if not 1 <= self.backoff_syncs <= self.max_backoff_syncs:
            raise ValueError(f"need 1 <= backoff_syncs <= max_backoff_syncs, got {self.backoff_syncs}, {self.max_backoff_syncs}")
        self._digest: str | None = None
        self._base_id: int | None = None
        self._since_seed = 0
        self._skip_left = 0
        self._backoff = self.backoff_syncs
        self._warm = False  # whether a sync completed since the group was (re)built: the first one's cost is not kept
        self.costs: dict[str, SyncCosts] = {}
        """Per transport name: what its recent syncs cost."""

    def request(self, digest: str, supported: str | None, transport: str = "") -> DeltaRequest | None:
        """The delta request for the next sync of plan `digest` over `transport`, or None for a
        plain dense sync. `supported`: None when the backend and every engine take patches, else
        why not."""
        if self.mode == "off":
            return None
        if supported is not None:
            if self.mode == "on":
                raise ValueError(f"delta=on, but {supported}; use delta=auto or off")
            return None
        if self.mode == "auto" and self._skip_left > 0:
            self._skip_left -= 1
            self._base_id = None
            return None
        new_id = secrets.randbits(62) + 1
        seed_due = self.full_sync_every and self._since_seed + 1 >= self.full_sync_every
        costs = self.costs.get(transport)
        if self.mode == "auto" and (costs is None or not costs.dense):  # measure a plain dense sync first
            self._base_id = None
            return None
        if self._base_id is not None and self._digest == digest and not seed_due:
            return DeltaRequest(True, self._base_id, new_id)
        return DeltaRequest(False, None, new_id)

    def completed(
        self, digest: str, request: DeltaRequest | None, *, transport: str = "", seconds: float = 0.0, plan_bytes: int = 0,
        wire_bytes: int = 0, dense_bytes: int = 0,
    ) -> None:
        """The sync of `request` completed on every member (their bases now hold `new_id`) in
        `seconds` of transfer; `plan_bytes`: the plan's bytes (costs are kept per plan byte);
        `wire_bytes` / `dense_bytes`: what went against what dense would have sent (of the same
        senders)."""
        if self._warm:
            self.costs.setdefault(transport, SyncCosts()).record(request, seconds, plan_bytes)
        self._warm = True
        if request is None:
            self._base_id = None
            return
        self._digest, self._base_id = digest, request.new_id
        self._since_seed = self._since_seed + 1 if request.patches else 0
        if self.mode != "auto" or not request.patches:
            return
        costs = self.costs.get(transport)
        pays = False if dense_bytes and wire_bytes >= dense_bytes else costs.verdict() if costs is not None else None
        if pays is None:
            return
        if pays:
            self._backoff = self.backoff_syncs
            return
        dense = min(costs.dense) * plan_bytes if costs is not None and costs.dense else float("nan")
        logger.info(
            "delta patches cost more than dense syncs over %s (%.3fs, dense about %.3fs; %.0f%% of the bytes on the wire): "
            "the next %d syncs go dense", transport or "this transport", seconds, dense, 100 * wire_bytes / max(dense_bytes, 1), self._backoff,
        )
        self._skip_left, self._base_id = self._backoff, None
        self._backoff = min(2 * self._backoff, self.max_backoff_syncs)

    def failed(self) -> None:
        """A sync failed: nobody may assume any base; the next sync seeds."""
        self._base_id = None

    def forget(self) -> None:
        """The group was rebuilt (members joined with empty bases; its first sync warms it up)."""
        self._base_id = None
        self._warm = False
