"""What one sync asks of the delta bases: the message the controller sends every rank.

The bases are the wire bytes each side kept of the last sync (the sender: what it sent; a
receiver: what it received). They are labelled by a random sync id, not by the public version:
a failed sync never makes two sides believe they hold the same bytes when they do not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["DeltaRequest"]

_MAX_ID = (1 << 63) - 1


@dataclass(frozen=True)
class DeltaRequest:
    """`patches`: the sender may send any bucket as a patch against the bases labelled `base_id`
    (every receiver must hold exactly those). Otherwise every bucket travels dense and (re)seeds
    the bases. After the sync, every side's bases hold the bytes labelled `new_id`."""

    patches: bool
    base_id: int | None
    new_id: int

    def __post_init__(self) -> None:
        if not isinstance(self.patches, bool):
            raise ValueError(f"delta.patches must be a bool, got {self.patches!r}")
        for key in ("base_id", "new_id"):
            value = getattr(self, key)
            if value is None and key == "base_id" and not self.patches:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= _MAX_ID:
                raise ValueError(f"delta.{key} must be an int in [1, 2**63), got {value!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"patches": self.patches, "base_id": self.base_id, "new_id": self.new_id}

    @classmethod
    def from_dict(cls, d: Any) -> DeltaRequest:
        if not isinstance(d, dict) or set(d) != {"patches", "base_id", "new_id"}:
            raise ValueError(f"delta request must be a map of patches, base_id, new_id; got {d!r:.200}")
        return cls(d["patches"], d["base_id"], d["new_id"])
