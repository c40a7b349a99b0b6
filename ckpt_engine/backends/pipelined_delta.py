"""Delta framing for the pipelined broadcast: send each bucket dense or as a patch of its base.

Every side keeps a base image of each bucket it sends or receives (the bucket's wire bytes at the
last sync, in the engine's device memory: the whole model on a single sender and on each
receiver, 1/S of it on each of S senders). One delta sync, per sender:
1. encode: pack each bucket, compare it with its base image (`ckpt_engine.delta.codec`), keep the
   patch when it is smaller than the bucket, and bring the base image up to date;
2. a table (kind, bytes, checksum per bucket) goes to every receiver in one message;
3. each bucket's payload follows from stable memory (the patch, or the base image itself).
Receivers check each patch against their own base (the sender's checksum of the result must equal
theirs) before applying it, and hand tensors to the loader only after every bucket has passed, so
a corrupt or mismatched patch leaves the engine's own weights untouched. Dense frames need no
check beyond the transport's (as a dense sync); their checksum is computed lazily, the first time
a patch builds on them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ckpt_engine.backends.piece_reader import PieceReader
from ckpt_engine.backends.wire_views import torch_dtype
from ckpt_engine.copies import batched_copy_
from ckpt_engine.delta import codec
from ckpt_engine.delta.layout import header_fields
from ckpt_engine.delta.request import DeltaRequest
from ckpt_engine.engine import SendStats, TransferError
from ckpt_engine.manifest import BucketManifest

__all__ = ["DeltaTransferMixin"]

logger = logging.getLogger(__name__)

DENSE, PATCH = 0, 1


@dataclass
class _Bases:
    """Base images of the buckets this rank sends (by ordinal) or receives (by manifest index)."""

    digest: str | None = None
    sync_id: int | None = None
    images: dict[int, torch.Tensor] = field(default_factory=dict)
    sums: dict[int, torch.Tensor | None] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for t in self.images.values())


class DeltaTransferMixin:
    """Mixed into PipelinedBroadcastEngine: `_send_delta` / `_receive_delta` and the bases."""

    def _init_delta(self) -> None:
        self._bases = _Bases()
        self.last_delta_stats: dict[str, float] = {}

    def _reset_delta(self) -> None:
        self._bases = _Bases()

    def _invalidate_delta(self) -> None:
        """The bases no longer match what the other side holds (a failure, or a sync without them)."""
        self._bases.sync_id = None

    def delta_base_id(self, manifest: BucketManifest) -> int | None:
        b = self._bases
        return b.sync_id if b.digest == manifest.digest else None

    @property
    def delta_base_bytes(self) -> int:
        """Memory the base images take on this rank."""
        return self._bases.nbytes

    def _bases_for(self, manifest: BucketManifest, delta: DeltaRequest, keys: list[tuple[int, int]]) -> _Bases:
        """The base images for this sync: checked against the request, (re)allocated for a new plan."""
        b = self._bases
        if delta.patches:
            if b.digest != manifest.digest or b.sync_id != delta.base_id:
                held = b.sync_id if b.digest == manifest.digest else None
                raise TransferError(
                    f"rank {self.rank}: asked to patch against base {delta.base_id}, but this rank's bases hold "
                    f"{held if held is not None else 'nothing valid'} for this plan; the sync must be dense"
                )
        elif b.digest != manifest.digest:
            self._bases = b = _Bases(digest=manifest.digest)
            for key, nbytes in keys:
                b.images[key] = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
                b.sums[key] = None
        b.sync_id = None  # until this sync completes on this rank
        return b

    # --- sender ------------------------------------------------------------------------------
    def _send_delta(
        self, manifest: BucketManifest, weights: Iterable[tuple[str, torch.Tensor]], *, stable: bool, delta: DeltaRequest
    ) -> SendStats:
        t_start = time.perf_counter()
        sched, mine, stats = self._own_steps(manifest)
        it = iter(weights)
        works: list[Any] = []
        try:
            bases = self._bases_for(manifest, delta, [(s.ordinal, s.bucket.nbytes) for s in mine])
            pieces = PieceReader(it, sched, self.rank, self.device, stats)
            scratch, out = self._buffers[0], self._buffers[1]
            frames: list[tuple[int, int, torch.Tensor | None]] = []
            msgs: list[torch.Tensor] = []
            changed = total_words = 0
            for step in mine:
                bucket, n = step.bucket, step.bucket.nbytes
                image = bases.images[step.ordinal]
                target = scratch if delta.patches else image
                dsts = [self._entry_view(target, e) for e in bucket.entries]
                srcs = []
                for e, dst in zip(bucket.entries, dsts):
                    src, _own = pieces.source(e)
                    if stable:
                        srcs.append(src)
                    else:
                        t0 = time.perf_counter()
                        dst.copy_(src)  # before the next tensor is requested (a gather frees it)
                        stats.pack_s += time.perf_counter() - t0
                t0 = time.perf_counter()
                if srcs:
                    batched_copy_(dsts, srcs)
                stats.pack_s += time.perf_counter() - t0
                total_words += n // step.word_bytes
                if not delta.patches:
                    bases.sums[step.ordinal] = None
                    frames.append((DENSE, n, None))
                    msgs.append(image[:n])
                    continue
                t0 = time.perf_counter()
                size, result, num_changed = self._encode_bucket(bases, step.ordinal, image[:n], scratch[:n], out, step.word_bytes)
                stats.extra["encode_s"] = stats.extra.get("encode_s", 0.0) + time.perf_counter() - t0
                if size is None:
                    frames.append((DENSE, n, None))
                    msgs.append(image[:n])
                    changed += n // step.word_bytes
                else:
                    frames.append((PATCH, size, result))
                    msgs.append(out[:size].clone())
                    changed += num_changed
            if next(it, None) is not None:
                raise ValueError("the weight source yielded more tensors than its metadata lists")
            table = self._frame_table(frames)
            works.append(self._broadcast_on(self.rank * self.num_lanes, None, table))
            for step, msg in zip(mine, msgs):
                self._tamper_hook(step.bucket.index, msg)
                works.append(self._broadcast_on(step.gid, None, msg))
            self._drain_unslotted(works, "delta payloads")
            bases.sync_id = delta.new_id
        except BaseException:
            works.clear()
            self.abort()
            raise
        wire = sum(size for _k, size, _s in frames)
        stats.extra.update(
            wire_bytes=float(wire), table_bytes=float(table.numel() * 8), dense_bytes=float(sum(s.bucket.nbytes for s in mine)),
            patch_buckets=float(sum(1 for k, _n, _s in frames if k == PATCH)),
            changed_fraction=changed / total_words if total_words else 0.0,
            base_bytes=float(bases.nbytes),
        )
        stats.total_s = time.perf_counter() - t_start
        stats.transfer_s = max(0.0, stats.total_s - stats.export_s - stats.pack_s - stats.extra.get("encode_s", 0.0))
        self.last_delta_stats = dict(stats.extra)
        return stats

    def _encode_bucket(
        self, bases: _Bases, key: int, image: torch.Tensor, new: torch.Tensor, out: torch.Tensor, word: int
    ) -> tuple[int | None, torch.Tensor | None, int]:
        """Patch of `new` against `image` into `out`; the image becomes `new` either way.
        Returns (patch bytes or None for dense, checksum of the result, changed words)."""
        if bases.sums.get(key) is None:
            bases.sums[key] = codec.checksum(image, word)
        size = codec.encode_into_base(image, new, word, out)  # the image becomes `new` either way
        if size is None:
            bases.sums[key] = None
            return None, None, 0
        num_changed, delta_sum = header_fields(out[:size])
        result = bases.sums[key] + delta_sum
        bases.sums[key] = result
        return size, result, num_changed

    def _frame_table(self, frames: list[tuple[int, int, torch.Tensor | None]]) -> torch.Tensor:
        """(kind, bytes, checksum) per bucket, one int64 row each, on the transport's device."""
        head = torch.tensor([[k, n] for k, n, _s in frames], dtype=torch.int64).reshape(-1, 2)
        zero = torch.zeros((), dtype=torch.int64, device=self.device)
        sums = torch.stack([s if s is not None else zero for _k, _n, s in frames]) if frames else zero.reshape(0)
        return torch.cat([head.to(self.device), sums.reshape(-1, 1).to(self.device)], dim=1).contiguous()

    def _drain_unslotted(self, works: list[Any], what: str) -> None:
        if self._comm_stream is None:
            for work in works:
                self._wait_work(work, what)
            return
        for gid, stream in self._streams.items():
            ev = self._new_event()
            ev.record(stream)
            self._wait_event(ev, f"{what} on group {gid}")

    # --- receiver ----------------------------------------------------------------------------
    def _receive_delta(
        self, manifest: BucketManifest, destinations: Mapping[str, torch.Tensor] | None, delta: DeltaRequest
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        sched = self._schedule(manifest)
        steps = sched.steps
        works: list[Any] = []
        t_start = time.perf_counter()
        try:
            bases = self._bases_for(manifest, delta, [(s.bucket.index, s.bucket.nbytes) for s in steps])
            tables = []
            for sender, own in enumerate(sched.by_sender):
                t = torch.empty((len(own), 3), dtype=torch.int64, device=self.device)
                tables.append(t)
                works.append(self._broadcast_on(sender * self.num_lanes, None, t))
            if self._comm_stream is None:
                for sender, work in enumerate(works[:]):
                    self._wait_work(work, f"the delta table from sender {sender}")
            else:
                self._drain_unslotted(works, "delta tables")
            works.clear()
            rows = [t.tolist() for t in tables]
            frames = []
            for step in steps:
                kind, size, expect = rows[step.bucket.sender][step.ordinal]
                self._check_frame(step, kind, size, delta)
                frames.append((kind, size, expect))
            payloads: list[torch.Tensor] = []
            for step, (kind, size, _e) in zip(steps, frames):
                image = bases.images[step.bucket.index]
                msg = image[:size] if kind == DENSE else torch.empty(size, dtype=torch.uint8, device=self.device)
                payloads.append(msg)
                works.append(self._broadcast_on(step.gid, None, msg))
            if self._comm_stream is None:  # each wait names the sender a lost bucket came from
                for step, work in zip(steps, works[:]):
                    self._wait_work(work, f"bucket {step.bucket.index} from sender {step.bucket.sender}")
            else:
                self._drain_unslotted(works, "delta payloads")
            works.clear()
            t_apply = time.perf_counter()
            changed = 0
            for step, (kind, size, expect), payload in zip(steps, frames, payloads):
                k = step.bucket.index
                if kind == DENSE:
                    bases.sums[k] = None
                    continue
                changed += self._apply_patch(bases, step, payload, expect)
            apply_s = time.perf_counter() - t_apply
            bases.sync_id = delta.new_id
        except BaseException:
            works.clear()
            self.abort()
            raise
        wire = sum(size for _k, size, _e in frames)
        self.last_delta_stats = {
            "wire_bytes": float(wire), "dense_bytes": float(sum(s.bucket.nbytes for s in steps)),
            "patch_buckets": float(sum(1 for k, _s, _e in frames if k == PATCH)), "apply_s": apply_s,
            "receive_s": time.perf_counter() - t_start, "changed_words": float(changed), "base_bytes": float(bases.nbytes),
        }
        yield from self._yield_images(manifest, destinations, bases)

    def _check_frame(self, step: Any, kind: int, size: int, delta: DeltaRequest) -> None:
        n = step.bucket.nbytes
        ok = (kind == DENSE and size == n) or (
            kind == PATCH and delta.patches and codec.PATCH_HEADER_BYTES <= size <= n
        )
        if not ok:
            self._broken = True
            raise TransferError(
                f"rank {self.rank}: bucket {step.bucket.index} from sender {step.bucket.sender} announced "
                f"kind {kind} of {size} bytes (bucket of {n} bytes, patches {'allowed' if delta.patches else 'not allowed'})"
            )

    def _apply_patch(self, bases: _Bases, step: Any, payload: torch.Tensor, expect: int) -> int:
        """Check a patch against this rank's own base and apply it; returns the changed words."""
        k, word = step.bucket.index, step.word_bytes
        image = bases.images[k][: step.bucket.nbytes]
        where = f"rank {self.rank}: bucket {k} from sender {step.bucket.sender}"
        try:
            patch = codec.decode(payload, image.numel(), word)
        except codec.PatchError as exc:
            self._broken = True
            raise TransferError(f"{where}: malformed patch: {exc}") from exc
        if bases.sums.get(k) is None:
            bases.sums[k] = codec.checksum(image, word)
        got = int((bases.sums[k] + codec.delta_checksum(image, patch)).item())
        if got != expect:
            self._broken = True
            raise TransferError(
                f"{where}: checksum mismatch after applying the patch (sender {expect}, here {got}): "
                "the patch was corrupted or this rank's base differs; the engine keeps its old weights"
            )
        codec.apply(image, patch)
        bases.sums[k] = torch.tensor(expect, dtype=torch.int64, device=self.device)
        return int(patch.positions.numel())

    def _yield_images(
        self, manifest: BucketManifest, destinations: Mapping[str, torch.Tensor] | None, bases: _Bases
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The verified images, bucket by bucket, as the dense loop yields its buffers."""
        sched = self._schedule(manifest)
        remaining = dict(sched.tensor_bytes)
        if self._assembly_digest != manifest.digest:
            self._assembly, self._assembly_digest = {}, manifest.digest
        for step in sched.steps:
            image = bases.images[step.bucket.index]
            out: list[tuple[str, torch.Tensor]] = []
            for e in step.bucket.entries:
                view = self._entry_view(image, e)
                if e.is_whole:
                    out.append((e.name, view))
                    continue
                asm = self._assembly_of(e, destinations)
                asm[e.chunk_offset : e.chunk_offset + e.chunk_size].copy_(view)
                remaining[e.name] -= e.chunk_size
                if remaining[e.name] == 0:
                    out.append((e.name, asm.view(torch_dtype(e.dtype)).view(e.shape)))
            yield out
        if self._comm_stream is not None:
            done = self._new_event()
            done.record(self._current_stream())
            self._wait_event(done, "loading the last bucket")
