"""Which trainer rank owns which bytes of a tensor: the input of a multi-sender plan.

A sharded trainer declares, without gathering anything, the byte range of every tensor's flat
(row-major) wire image that each sender rank holds. A dim-0 shard (FSDP2, Megatron-FSDP) of rows
[r0, r1) is the byte range [r0 * row_bytes, r1 * row_bytes). Tensors no rank claims are
replicated: the planner gives each to the sender with the fewest bytes so far.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ckpt_engine.manifest import ManifestError, TensorSpec

__all__ = ["OwnerMap", "Shard", "check_shards", "owner_key", "row_shards"]


@dataclass(frozen=True)
class Shard:
    """Bytes [start, stop) of a tensor's flat wire image, held by sender rank `sender`."""

    sender: int
    start: int
    stop: int

    @property
    def nbytes(self) -> int:
        return self.stop - self.start


OwnerMap = Mapping[str, Sequence[Shard]]


def row_shards(spec: TensorSpec, rows_per_sender: Sequence[int]) -> list[Shard]:
    """Shards of a tensor split on dim 0: sender i holds the next `rows_per_sender[i]` rows.

    Uneven splits and senders with zero rows are fine (a zero-row sender owns nothing of it).
    """
    rows = spec.shape[0] if spec.shape else 1
    if sum(rows_per_sender) != rows or any(r < 0 for r in rows_per_sender):
        raise ValueError(f"{spec.name}: rows per sender {list(rows_per_sender)} do not add up to its {rows} rows")
    row_bytes = spec.nbytes // rows if rows else 0
    out, row = [], 0
    for sender, n in enumerate(rows_per_sender):
        if n:
            out.append(Shard(sender, row * row_bytes, (row + n) * row_bytes))
        row += n
    return out


def check_shards(spec: TensorSpec, shards: Sequence[Shard], num_senders: int) -> list[Shard]:
    """The non-empty shards sorted by start; they must cover the tensor's bytes exactly once."""
    kept = sorted((s for s in shards if s.stop > s.start), key=lambda s: s.start)
    end = 0
    for s in kept:
        if not 0 <= s.sender < num_senders:
            raise ManifestError(f"{spec.name}: shard sender {s.sender} is not in [0, {num_senders})")
        if s.start != end:
            raise ManifestError(f"{spec.name}: shards do not cover the tensor exactly once (at byte {min(s.start, end)})")
        end = s.stop
    if end != spec.nbytes:
        raise ManifestError(f"{spec.name}: shards cover {end} of its {spec.nbytes} bytes")
    if len({s.sender for s in kept}) != len(kept):
        raise ManifestError(f"{spec.name}: a sender may own one contiguous range of a tensor, not several")
    return kept


def owner_key(owners: OwnerMap | None) -> tuple[tuple[str, tuple[tuple[int, int, int], ...]], ...] | None:
    """A hashable summary of an ownership map, to tell when a plan must be made again."""
    if owners is None:
        return None
    return tuple(sorted((name, tuple((sh.sender, sh.start, sh.stop) for sh in shards)) for name, shards in owners.items()))
