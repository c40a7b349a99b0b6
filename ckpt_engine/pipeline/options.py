"""The options both ends of a pipelined transfer share, and the per-bucket routes they decide.

Every route here is a pure function of the manifest, these options and the transport's declared
shape, so every rank decides alike without exchanging a word.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckpt_engine.manifest import Bucket
from ckpt_engine.transports.transport import Transport

__all__ = ["PipelineOptions"]


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
