"""The options of a pipelined engine: what `checkpoint_engine.engine_kwargs.<backend>` may set
(`EngineOptions`, plus the transport's own typed options, `split_options`), and the options both
ends of a transfer share with the per-bucket routes they decide (`PipelineOptions`).

Every route here is a pure function of the manifest, these options and the transport's declared
shape, so every rank decides alike without exchanging a word.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from ckpt_engine.manifest import Bucket
from ckpt_engine.transports.transport import Transport, TransportOptions

__all__ = ["EngineOptions", "PipelineOptions", "split_options"]


def _is_count(value: Any, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


@dataclass(frozen=True, kw_only=True)
class EngineOptions:
    """What every pipelined backend takes besides its transport's options (None: the transport's
    default)."""

    solo_bytes: int | None = None
    """Tensors of at least this size get a bucket of their own (0: never); see `plan_buckets`."""
    group_max_tensors: int | None = None
    """A bucket of at most this many tensors travels as one coalesced group of per-tensor messages
    (0: never)."""
    delta_scatter_below: float = 1 / 4
    """Most changed words (a fraction of a bucket's) for which a sender diffs the bucket straight
    from its source; a busier bucket is packed first, then diffed the same way (the same wire
    bytes). 1/4 on every transport: 7B at lr 1e-5 on 2xH200 0.91x a raw broadcast against 1.35x
    with 1/32; tiny preset on the 2-core CPU box 0.23-1.41 s against 0.76-2.92 s (bench/RESULTS.md)."""

    def __post_init__(self) -> None:
        for name, value, least in (("solo_bytes", self.solo_bytes, 0), ("group_max_tensors", self.group_max_tensors, 0)):
            if value is not None and not _is_count(value, least):
                raise ValueError(f"{name} must be an int >= {least}{' (0: never)' if least == 0 else ''}, got {value!r}")
        below = self.delta_scatter_below
        if isinstance(below, bool) or not isinstance(below, (int, float)) or not 0 < below <= 0.5:
            raise ValueError(f"delta_scatter_below must be a fraction in (0, 0.5], got {below!r}")


def split_options(transport_cls: type[Transport], kwargs: dict[str, Any]) -> tuple[EngineOptions, TransportOptions]:
    """`kwargs` (a backend's engine_kwargs, None meaning "the default") as the engine's options and
    the transport's typed ones, each value checked; an unknown name or a bad value is a ValueError
    that names it (and, for a name, lists the allowed ones)."""
    engine_fields = {f.name for f in dataclasses.fields(EngineOptions)}
    transport_fields = {f.name for f in dataclasses.fields(transport_cls.Options)}
    unknown = sorted(set(kwargs) - engine_fields - transport_fields)
    if unknown:
        raise ValueError(f"unknown option(s) {', '.join(unknown)}; allowed: {', '.join(sorted(engine_fields | transport_fields))}")
    given = {k: v for k, v in kwargs.items() if v is not None}
    engine = EngineOptions(**{k: v for k, v in given.items() if k in engine_fields})
    transport = transport_cls.Options(**{k: v for k, v in given.items() if k in transport_fields})
    kind = transport_cls.device_type
    if transport.device is not None and kind is not None and torch.device(transport.device).type != kind:
        raise ValueError(f"device: the {transport_cls.name} backend moves {kind} tensors, got device={transport.device!r}")
    return engine, transport


@dataclass(frozen=True)
class PipelineOptions:
    bucket_size_bytes: int
    num_buffers: int
    timeout_s: float
    verify: bool
    group_max_tensors: int
    """A bucket of at most this many tensors travels as one coalesced group (0: never)."""

    def is_direct(self, bucket: Bucket, transport: Transport) -> bool:
        """A bucket holding one chunk of a tensor larger than a bucket lands straight in the
        receiver's reassembly tensor (no copy out of a buffer); a sender with stable sources also
        sends it from the tensor's own memory. Either side may pack instead: the bytes match."""
        return (
            len(bucket.entries) == 1 and not bucket.entries[0].is_whole and not self.verify
            and not transport.reads_in_place(bucket.sender)
        )

    def is_direct_whole(self, bucket: Bucket, transport: Transport) -> bool:
        """A bucket holding one whole tensor may land straight in the loader's destination."""
        return (
            len(bucket.entries) == 1 and bucket.entries[0].is_whole and bucket.nbytes > 0 and not self.verify
            and not transport.reads_in_place(bucket.sender)
        )

    def is_grouped(self, bucket: Bucket, transport: Transport) -> bool:
        """Whether a bucket travels as a coalesced group of per-tensor messages."""
        n = len(bucket.entries)
        return 1 < n <= self.group_max_tensors and bucket.nbytes > 0 and not self.verify and not transport.reads_in_place(bucket.sender)
