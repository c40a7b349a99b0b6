"""A sharded trainer's bf16 copies of its own pieces, written through the engine's cast recorder.

With `checkpoint_engine.delta_base: cast` a sender keeps no base copy: the patches are recorded by
the trainer's own fp32 -> bf16 cast (`delta/recorder.py`). A trainer adapter whose masters are
fp32 and whose wire is bf16 would otherwise cast each piece afresh at every sync; with a recorder
it keeps one bf16 copy of every piece it sends (a "shadow": half the bytes of its fp32 pieces),
rewrites it through `recorder.cast_()` after each optimizer step, and hands the shadows out as its
pieces. The sync then sends the recorded patches and reads neither the model nor a base image.

The sync path offers the recorder (`ckpt_engine/recorded_casts.py`) at each sync; `bind` is cheap
when nothing moved and binds anew (the next sync is then dense) when the recorder is new (a new
plan or group), was bound by someone else since, or a master moved (a checkpoint loaded into new
storage).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["CastShadows"]

logger = logging.getLogger(__name__)


class CastShadows:
    """The shadows of one trainer rank and the recorder that writes them (none until offered)."""

    def __init__(self) -> None:
        self._recorder: Any = None
        self._binding = -1
        self._shadows: dict[str, torch.Tensor] = {}
        self._masters: dict[str, torch.Tensor] = {}
        self._stamps: dict[str, int] = {}  # each master's version counter when the shadows were last cast

    @property
    def active(self) -> bool:
        """Whether pieces come from the shadows (a recorder is bound)."""
        return self._recorder is not None

    @property
    def nbytes(self) -> int:
        """Memory of the shadows (the recorder's patch areas are counted by the recorder)."""
        return sum(t.numel() * t.element_size() for t in self._shadows.values())

    def bind(self, recorder: Any, master_of: Callable[[str], torch.Tensor]) -> bool:
        """Bind this rank's fp32 master pieces (`master_of(name)` for every name the recorder
        wants) to shadows, unless they already are, to this very recorder; returns whether it bound
        anew. Masters written since the last cast (outside the optimizer step: a checkpoint loaded
        in place, a user's own write; torch's version counters tell) are cast now, so the shadows
        never lag what the trainer holds. A master that is not a contiguous float32 tensor is
        refused by name (the recorder casts float32 to bfloat16 word by word)."""
        names = sorted(recorder.names)
        masters = {n: master_of(n) for n in names}
        if recorder is self._recorder and recorder.binding == self._binding and _same_places(masters, self._masters):
            if any(m._version != self._stamps.get(n) for n, m in masters.items()):
                logger.info("cast recorder: masters written since the last cast; casting them before the sync")
                self.cast_()
            return False
        for name, m in masters.items():
            if m.dtype != torch.float32:
                raise ValueError(
                    f"delta_base='cast': {name!r} is held in {m.dtype}, not float32; the cast recorder writes bf16 "
                    "weights from fp32 masters (use delta_base='device' or 'host' for this model)"
                )
            if not m.is_contiguous():
                raise ValueError(
                    f"delta_base='cast': this rank's fp32 piece of {name!r} is not contiguous (e.g. one half of a fused "
                    "expert tensor); the cast recorder needs contiguous masters (use delta_base='device' or 'host')"
                )
        shadows: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for name, m in masters.items():
                s = self._shadows.get(name)
                if s is None or s.shape != m.shape or s.device != m.device:
                    s = torch.empty(m.shape, dtype=torch.bfloat16, device=m.device)
                s.copy_(m)  # the version this rank holds now: the next sync sends it dense
                shadows[name] = s
        self._recorder = None
        recorder.bind({n: (masters[n], shadows[n]) for n in names})
        self._recorder, self._binding, self._shadows = recorder, recorder.binding, shadows
        self._masters, self._stamps = masters, {n: m._version for n, m in masters.items()}
        logger.info("cast recorder bound: %d pieces, %.1f MiB of bf16 shadows", len(shadows), self.nbytes / 2**20)
        return True

    def piece(self, name: str) -> torch.Tensor | None:
        """The shadow sent for `name` (None: not recorded, take the piece as usual)."""
        return self._shadows.get(name) if self._recorder is not None else None

    def tensors(self) -> list[torch.Tensor]:
        """Every shadow (anchors of a walk whose pieces are shadows)."""
        return list(self._shadows.values()) if self._recorder is not None else []

    def cast_(self) -> None:
        """After an optimizer step: rewrite the shadows from the masters, recording what changed."""
        if self._recorder is not None:
            self._recorder.cast_()
            self._stamps = {n: m._version for n, m in self._masters.items()}


def _same_places(now: dict[str, torch.Tensor], bound: dict[str, torch.Tensor]) -> bool:
    """Whether every master is where (and of the shape) it was when bound."""
    return now.keys() == bound.keys() and all(
        t.data_ptr() == bound[n].data_ptr() and t.shape == bound[n].shape for n, t in now.items()
    )
