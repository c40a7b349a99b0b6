"""Patches recorded by the trainer's own fp32 -> bf16 cast, so a sender keeps no base copy.

A trainer with fp32 masters and a bf16 copy of its weights rewrites that copy after every
optimizer step. A `CastRecorder` does that write for it (`cast_()`), bucket by bucket of the
sender's plan: each master word is rounded, compared with the bf16 word it replaces, and only
changed words are written and recorded in the bucket's patch (cast_kernels.py on CUDA; on a CPU
BucketDiff.add_cast: one compiled pass with numba, else torch's cast and numpy). The next sync
sends those patches as they are: it reads neither the model nor a base copy, and the bf16 weights
before the cast were the base.

A recorded patch is only valid against the version the bucket held at the last sync, so each
bucket tracks (base id, casts since). Several casts between two syncs (a trainer that syncs every
k steps) record into one patch: each cast appends the words it changed and the repeats are merged
(last value kept), so the patch carries every word changed since the sync, once. A bucket written
by anything but the recorder (torch's version counter), never sent since binding, sent from other
tensors than the ones bound, or whose changes since the sync outgrow its patch area travels dense
next time (always correct, just not small).
Memory: each recordable bucket holds a patch area of (4 + 2) bytes per word it may carry
(`scatter_below` of its words: 3/4 of the bucket's bytes at 1/4), and no base image.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ckpt_engine.delta import cast_kernels, kernels
from ckpt_engine.delta.direct import BucketDiff, out_bytes

__all__ = ["CastBucket", "CastRecorder", "CastSlice"]

logger = logging.getLogger(__name__)

_WIRE = "bfloat16"


@dataclass(frozen=True)
class CastSlice:
    """Bytes [chunk_offset, chunk_offset + chunk_size) of tensor `name` (full shape `shape`, wire
    dtype `dtype`) at `bucket_offset` of its bucket; `piece_start`: the byte where the piece this
    sender holds of the tensor begins (0 for a whole tensor)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    piece_start: int
    chunk_offset: int
    chunk_size: int
    bucket_offset: int


@dataclass(frozen=True)
class CastBucket:
    key: int
    nbytes: int
    word_bytes: int
    slices: tuple[CastSlice, ...]


@dataclass
class _State:
    bucket: CastBucket
    out: torch.Tensor | None  # the patch area (recordable buckets only)
    base_id: int | None = None  # the sync whose bytes the bound tensors held after it
    casts: int = 0
    bound: bool = False
    pointers: list[int] = field(default_factory=list)  # where each slice's bytes live in the bound tensors
    host_rows: list[tuple[torch.Tensor, torch.Tensor, int]] = field(default_factory=list)
    tables: Any = None
    origins: tuple[torch.Tensor, torch.Tensor] | None = None
    names: tuple[str, ...] = ()
    diff: BucketDiff | None = None


class CastRecorder:
    """Casts a sender's fp32 masters into its bf16 weights and records each bucket's patch.

    Made by the engine from its plan (`engine.cast_recorder(manifest)`); `bind` the trainer's
    (master, bf16) pairs once, call `cast_()` where the trainer would copy masters into its bf16
    weights, and sync as usual. Bind before the first (dense) sync: a bucket is only recorded
    once it was last sent from the bound tensors."""

    def __init__(self, buckets: Sequence[CastBucket], device: torch.device, scatter_below: float) -> None:
        if device.type == "cuda" and device.index is None:  # compare with the tensors' own (indexed) device
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.scatter_below = scatter_below
        self._states: dict[int, _State] = {}
        for b in buckets:
            recordable = b.word_bytes == 2 and bool(b.slices) and all(s.dtype == _WIRE for s in b.slices)
            out = None
            if recordable:
                out = torch.empty(out_bytes(b.nbytes, 2, scatter_below), dtype=torch.uint8, device=device)
            self._states[b.key] = _State(b, out)
        self._tensors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._stamps: dict[str, int] = {}
        self.binding = 0
        """How many times `bind` has run (a sender that skips its walk checks it is the same)."""

    @property
    def nbytes(self) -> int:
        """Device (or host) memory of the patch areas."""
        return sum(s.out.numel() for s in self._states.values() if s.out is not None)

    @property
    def names(self) -> set[str]:
        """The bf16 tensors this sender sends (whole or in part): what `bind` wants."""
        return {sl.name for s in self._states.values() for sl in s.bucket.slices if sl.dtype == _WIRE}

    def bind(self, pairs: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Take the trainer's (fp32 master, bf16 weight) per tensor name, the bf16 weight being
        the very tensor the sync's source yields for that name (the whole tensor, or this rank's
        shard of it). Every bf16 tensor of this sender's plan must be bound; tensors sent in
        another dtype (an fp32 router, int buffers) are not, and the buckets that hold them travel
        dense (their bf16 tensors are still cast, plainly)."""
        want = self.names
        unknown = sorted(set(pairs) - want)
        if unknown:
            raise ValueError(f"cast recorder: {len(unknown)} bound name(s) hold no bf16 bytes this sender sends, e.g. {unknown[:3]}")
        missing = sorted(want - set(pairs))
        if missing:
            raise ValueError(f"cast recorder: {len(missing)} bf16 tensor(s) this sender sends are not bound, e.g. {missing[:3]}")
        for name, pair in pairs.items():
            if not isinstance(pair, tuple) or len(pair) != 2 or not all(isinstance(t, torch.Tensor) for t in pair):
                raise ValueError(f"cast recorder: {name!r} must be bound to a (master, weight) pair of tensors")
            master, wire = pair
            if master.dtype != torch.float32 or wire.dtype != torch.bfloat16:
                raise ValueError(f"cast recorder: {name!r} pairs a {master.dtype} master with a {wire.dtype} weight; it casts float32 to bfloat16")
            if master.shape != wire.shape or not master.is_contiguous() or not wire.is_contiguous():
                raise ValueError(f"cast recorder: {name!r}: master {tuple(master.shape)} and weight {tuple(wire.shape)} must be contiguous and of one shape")
            if master.device != self.device or wire.device != self.device:
                raise ValueError(f"cast recorder: {name!r} lives on {master.device}/{wire.device}, the engine on {self.device}")
        self._tensors = dict(pairs)
        self.binding += 1
        try:
            for st in self._states.values():
                self._bind_bucket(st)
        except BaseException:  # nothing half-bound: cast_() refuses until a good bind
            self._tensors = {}
            for st in self._states.values():
                st.bound, st.base_id, st.diff = False, None, None
            raise
        self._stamps = {n: w._version for n, (_m, w) in self._tensors.items()}

    def _bind_bucket(self, st: _State) -> None:
        st.pointers, st.host_rows, rows = [], [], []
        for sl in st.bucket.slices:
            if sl.name not in self._tensors:  # sent in its own dtype: the recorder does not write it
                st.pointers.append(-1)
                continue
            master, wire = self._tensors[sl.name]
            start = 0 if tuple(wire.shape) == sl.shape else sl.piece_start
            lo, n = (sl.chunk_offset - start) // 2, sl.chunk_size // 2
            if sl.chunk_offset < start or lo + n > wire.numel():
                raise ValueError(f"cast recorder: {sl.name!r} holds {wire.numel()} words, the plan sends words [{lo}, {lo + n}) of it from this rank")
            st.pointers.append(wire.data_ptr() + 2 * lo)
            first = sl.bucket_offset // 2
            st.host_rows.append((master.reshape(-1)[lo : lo + n], wire.reshape(-1).view(torch.int16)[lo : lo + n], first))
            rows.append((master.data_ptr() + 4 * lo, wire.data_ptr() + 2 * lo, n, first))
        st.names = tuple(sl.name for sl in st.bucket.slices if sl.name in self._tensors)
        st.bound, st.base_id, st.casts = st.out is not None, None, 0
        if st.bound and kernels.available(self.device):
            m, w = self._tensors[st.bucket.slices[0].name]
            st.origins = (m.reshape(-1).view(torch.int32), w.reshape(-1).view(torch.int16))
            st.tables = cast_kernels.cast_tables(rows, *st.origins)

    def cast_(self) -> None:
        """Write every bound master into its bf16 weight, recording each bucket's changed words."""
        if not self._tensors:
            raise RuntimeError("cast recorder: bind() the trainer's (master, weight) pairs before cast_()")
        for st in self._states.values():
            if not st.bound:  # a bucket that also holds other dtypes: a plain cast, sent dense
                for master, words, _first in st.host_rows:
                    words.copy_(master.to(torch.bfloat16).view(torch.int16))
                continue
            self._check_stamps(st)
            assert st.out is not None
            again = st.diff is not None and st.base_id is not None  # a second step before the sync: record on top
            diff = st.diff if again else BucketDiff(st.out, st.bucket.nbytes, 2, self.scatter_below)
            assert diff is not None
            if st.tables is not None and st.origins is not None:
                cast_kernels.cast_pieces(st.tables, *st.origins, diff.targets())
            else:
                for master, words, first in st.host_rows:
                    diff.add_cast(master, words, first)
            if again:
                diff.merge_repeats()
            diff.seal()
            st.diff = diff
            st.casts += 1
        self._stamps = {n: w._version for n, (_m, w) in self._tensors.items()}

    def _check_stamps(self, st: _State) -> None:
        """A bound weight written by anything but the recorder since it last looked no longer
        holds the version its bucket was last sent as."""
        if st.base_id is not None and any(self._tensors[n][1]._version != self._stamps.get(n) for n in st.names):
            logger.info("cast recorder: bucket %s was written outside the recorder; it travels dense next sync", st.bucket.key)
            st.base_id = None

    def bound_keys(self) -> set[int]:
        """Buckets whose patches this recorder writes (the others hold tensors of other dtypes)."""
        return {k for k, st in self._states.items() if st.bound}

    def holds(self, key: int, pointers: Sequence[int]) -> bool:
        """Whether the sync's source yields, for bucket `key`, the bytes this recorder writes."""
        st = self._states.get(key)
        return st is not None and st.bound and list(pointers) == st.pointers

    def take(self, key: int, base_id: int | None) -> BucketDiff | None:
        """The recorded patch of bucket `key` against sync `base_id`, if it is one: every cast
        since that sync recorded into it (none: an empty patch), and nothing else wrote the
        bucket's weights."""
        st = self._states.get(key)
        if st is None or not st.bound:
            return None
        self._check_stamps(st)
        if base_id is None or st.base_id != base_id:
            return None
        if st.casts == 0:  # synced again without a step: nothing changed
            assert st.out is not None
            return BucketDiff(st.out, st.bucket.nbytes, 2, self.scatter_below)
        return st.diff

    def synced(self, sync_id: int, keys: set[int]) -> None:
        """A sync completed: buckets in `keys` were sent from the bound tensors and now hold
        version `sync_id` on both sides; the others are no longer known."""
        for key, st in self._states.items():
            st.base_id = sync_id if key in keys and st.bound else None
            st.casts, st.diff = 0, None
        self._stamps = {n: w._version for n, (_m, w) in self._tensors.items()}

    def forget(self) -> None:
        """The other side's versions are unknown (a failed or plain sync): every bucket dense next."""
        for st in self._states.values():
            st.base_id, st.casts, st.diff = None, 0, None
