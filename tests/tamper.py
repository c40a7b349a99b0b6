"""The pipelined engine over gloo as a class of its own, for tests to subclass with fault hooks
(and to register as a whole engine in place of `gloo`); one that corrupts one patch frame it
sends, to show a receiver catches it by checksum."""

from __future__ import annotations

from typing import Any

import torch

from ckpt_engine.pipeline.engine import PipelinedEngine
from ckpt_engine.transports.gloo import GlooTransport


class GlooEngine(PipelinedEngine):
    """`CheckpointEngineRegistry.new("gloo", ...)`, as a class: what the registry reads of a
    backend's class before building one is the transport's."""

    name, device_type, supports_many_senders = GlooTransport.name, GlooTransport.device_type, GlooTransport.supports_many_senders

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(GlooTransport, **kwargs)


class FlipOnce(GlooEngine):
    """Flips one bit of the first frame it sends (of bucket `bucket`, or any) once `armed`, then
    disarms. Subclass it per test module: `armed` is class state, so modules must not share it."""

    armed = False
    bucket: int | None = None

    def _tamper_hook(self, bucket_index: int, message: torch.Tensor) -> None:
        cls = type(self)
        if cls.armed and message.numel() > 64 and (cls.bucket is None or bucket_index == cls.bucket):
            message[48] ^= 0x04
            cls.armed = False
