"""When a sync may send patches: the controller's side of the delta version chain.

Patches are sent only against bases every member of the group holds exactly: those of the last
sync that completed on this same group with this same plan. Anything else (the first sync, a new
or restarted engine, a rebuilt group, a new plan, a failed sync, `full_sync_every`) makes the
next sync a dense seed. `auto` also stops encoding for a while when patches did not pay (a high
learning rate changes nearly every word), so that case costs what a plain dense sync costs.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass

from ckpt_engine.config import DELTA_MODES
from ckpt_engine.delta.request import DeltaRequest

__all__ = ["DELTA_MODES", "DeltaPolicy"]

logger = logging.getLogger(__name__)



@dataclass
class DeltaPolicy:
    mode: str = "off"
    full_sync_every: int = 0
    """A dense seed every this many syncs (0: only when needed)."""
    worth_ratio: float = 0.5
    """auto: patches pay when wire bytes are at most this fraction of the dense bytes."""
    skip_syncs: int = 8
    """auto: plain dense syncs after patches did not pay, before trying again."""

    def __post_init__(self) -> None:
        if self.mode not in DELTA_MODES:
            raise ValueError(f"delta must be one of {', '.join(DELTA_MODES)}, got {self.mode!r}")
        if not isinstance(self.full_sync_every, int) or self.full_sync_every < 0:
            raise ValueError(f"full_sync_every must be an int >= 0, got {self.full_sync_every!r}")
        self._digest: str | None = None
        self._base_id: int | None = None
        self._since_seed = 0
        self._skip_left = 0

    def request(self, digest: str, supported: str | None) -> DeltaRequest | None:
        """The delta request for the next sync of plan `digest`, or None for a plain dense sync.
        `supported`: None when the backend and every engine take patches, else why not."""
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
        if self._base_id is not None and self._digest == digest and not seed_due:
            return DeltaRequest(True, self._base_id, new_id)
        return DeltaRequest(False, None, new_id)

    def completed(self, digest: str, request: DeltaRequest | None, wire_bytes: float, dense_bytes: float) -> None:
        """The sync of `request` completed on every member: their bases now hold `new_id`."""
        if request is None:
            self._base_id = None
            return
        self._digest, self._base_id = digest, request.new_id
        self._since_seed = self._since_seed + 1 if request.patches else 0
        if self.mode == "auto" and request.patches and dense_bytes and wire_bytes / dense_bytes > self.worth_ratio:
            logger.info(
                "delta patches carried %.0f%% of the dense bytes; the next %d syncs go dense", 100 * wire_bytes / dense_bytes, self.skip_syncs
            )
            self._skip_left = self.skip_syncs

    def failed(self) -> None:
        """A sync failed: nobody may assume any base; the next sync seeds."""
        self._base_id = None

    def forget(self) -> None:
        """The group was rebuilt (members joined with empty bases)."""
        self._base_id = None
