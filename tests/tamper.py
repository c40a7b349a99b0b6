"""A gloo engine that corrupts one patch frame it sends, to show a receiver catches it by checksum."""

from __future__ import annotations

import torch

from ckpt_engine.transports.gloo import GlooCheckpointEngine


class FlipOnce(GlooCheckpointEngine):
    """Flips one bit of the first frame it sends (of bucket `bucket`, or any) once `armed`, then
    disarms. Subclass it per test module: `armed` is class state, so modules must not share it."""

    armed = False
    bucket: int | None = None

    def _tamper_hook(self, bucket_index: int, message: torch.Tensor) -> None:
        cls = type(self)
        if cls.armed and message.numel() > 64 and (cls.bucket is None or bucket_index == cls.bucket):
            message[48] ^= 0x04
            cls.armed = False
