"""Delta framing for the pipelined broadcast: send each bucket dense or as a patch of its base.

Every side keeps a base image of each bucket it sends or receives (the bucket's wire bytes at the
last sync, in the engine's device memory: the whole model on a single sender and on each
receiver, 1/S of it on each of S senders). One delta sync, per sender and bucket:
1. encode: compare the bucket's source tensors with its base image in one pass each
   (`ckpt_engine.delta.direct`, no pack) or, for a bucket that changed a lot last time, pack it and
   let the codec pick a bitmask patch; keep the patch when it is smaller than the bucket; the base
   image becomes the new bytes either way;
2. the bucket's header (kind, bytes, checksum of the result) and payload (the patch, or the base
   image itself) leave at once, so the next bucket is encoded while this one travels.
Receivers check each patch against their own base (the sender's checksum of the result must equal
theirs) as it arrives, apply patches only after every bucket has passed, and then hand tensors to
the loader, so
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
from ckpt_engine.backends.wire_views import flat_bytes, torch_dtype
from ckpt_engine.copies import batched_copy_
from ckpt_engine.delta import codec
from ckpt_engine.delta.direct import BucketDiff
from ckpt_engine.delta.layout import header_fields, word_dtype
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
    busy: set[int] = field(default_factory=set)
    """Sender buckets whose last patch changed more than 1 word in 32: encoded by the codec."""

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
        """Encode and send bucket by bucket: a bucket's header (kind, bytes, checksum) and payload
        leave as soon as it is encoded, so receivers check bucket k while this rank encodes k + 1.
        The diff kernels of bucket k + 1 are queued before bucket k's changed count is read, so the
        device never idles on that host round trip."""
        t_start = time.perf_counter()
        sched, mine, stats = self._own_steps(manifest)
        it = iter(weights)
        works: list[Any] = []
        keep: list[torch.Tensor] = []  # what the queued broadcasts read, alive until drained
        tally = {"wire": 0, "changed": 0, "words": 0, "patches": 0}

        def send(step: Any, frame: tuple[int, int, torch.Tensor | None, torch.Tensor, int]) -> None:
            kind, size, result, msg, num_changed = frame
            tally["wire"] += size
            tally["changed"] += num_changed
            tally["patches"] += kind == PATCH
            header = self._frame_header(kind, size, result)
            self._tamper_hook(step.bucket.index, msg)
            keep.extend((header, msg))
            works.append(self._broadcast_on(step.gid, None, header))
            works.append(self._broadcast_on(step.gid, None, msg))

        try:
            bases = self._bases_for(manifest, delta, [(s.ordinal, s.bucket.nbytes) for s in mine])
            pieces = PieceReader(it, sched, self.rank, self.device, stats)
            pending: tuple[Any, BucketDiff, Any] | None = None
            for i, step in enumerate(mine):
                n, word = step.bucket.nbytes, step.word_bytes
                tally["words"] += n // word
                t0 = time.perf_counter()
                if delta.patches and step.ordinal not in bases.busy and n // word < 2**31:
                    diff, event = self._start_diff(bases, step, pieces, i)
                    if pending is not None:
                        send(pending[0], self._finish_diff(bases, *pending))
                    pending = (step, diff, event)
                else:
                    if pending is not None:  # the codec and dense paths reuse its buffers
                        send(pending[0], self._finish_diff(bases, *pending))
                        pending = None
                    if delta.patches:
                        frame = self._encode_packed(bases, step, pieces, stable, stats)
                    else:
                        self._pack_into(bases.images[step.ordinal], step, pieces, stable, stats)
                        bases.sums[step.ordinal] = None
                        frame = (DENSE, n, None, bases.images[step.ordinal][:n], n // word)
                    send(step, frame)
                if delta.patches:
                    stats.extra["encode_s"] = stats.extra.get("encode_s", 0.0) + time.perf_counter() - t0
            if pending is not None:
                t0 = time.perf_counter()
                send(pending[0], self._finish_diff(bases, *pending))
                stats.extra["encode_s"] = stats.extra.get("encode_s", 0.0) + time.perf_counter() - t0
            if next(it, None) is not None:
                raise ValueError("the weight source yielded more tensors than its metadata lists")
            self._drain_unslotted(works, "delta payloads")
            bases.sync_id = delta.new_id
        except BaseException:
            works.clear()
            self.abort()
            raise
        finally:
            keep.clear()
        words = tally["words"]
        stats.extra.update(
            wire_bytes=float(tally["wire"]), table_bytes=float(24 * len(mine)), dense_bytes=float(sum(s.bucket.nbytes for s in mine)),
            patch_buckets=float(tally["patches"]), changed_fraction=tally["changed"] / words if words else 0.0,
            base_bytes=float(bases.nbytes),
        )
        stats.total_s = time.perf_counter() - t_start
        stats.transfer_s = max(0.0, stats.total_s - stats.export_s - stats.pack_s - stats.extra.get("encode_s", 0.0))
        self.last_delta_stats = dict(stats.extra)
        return stats

    def _pack_into(self, target: torch.Tensor, step: Any, pieces: PieceReader, stable: bool, stats: SendStats) -> None:
        """Copy the bucket's pieces into `target` (the base image, or the scratch buffer)."""
        dsts, srcs = [], []
        for e in step.bucket.entries:
            dst = self._entry_view(target, e)
            src, _own = pieces.source(e)
            if stable:
                dsts.append(dst)
                srcs.append(src)
            else:
                t0 = time.perf_counter()
                dst.copy_(src)  # before the next tensor is requested (a gather frees it)
                stats.pack_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        if srcs:
            batched_copy_(dsts, srcs)
        stats.pack_s += time.perf_counter() - t0

    def _start_diff(self, bases: _Bases, step: Any, pieces: PieceReader, parity: int) -> tuple[BucketDiff, Any]:
        """Queue the one-pass diff of a bucket's source tensors against its base image (no pack;
        a piece not yet in the wire dtype is converted into the scratch buffer first). Two
        buckets' patches are in flight at once, in the two halves of the second buffer."""
        key, n, word = step.ordinal, step.bucket.nbytes, step.word_bytes
        image = bases.images[key][:n]
        if bases.sums.get(key) is None:
            bases.sums[key] = codec.checksum(image, word)
        half = self._buffers[1].numel() // 16 * 8
        region = self._buffers[1][half * (parity % 2) :][:half]
        diff = BucketDiff(region, n, word)
        dtype = word_dtype(word)
        for e in step.bucket.entries:
            src, own = pieces.source(e)
            if e.is_whole and not own:
                converted = self._entry_view(self._buffers[0], e)
                converted.copy_(src)
                src = converted
            new = flat_bytes(src) if e.is_whole else src
            base = image[e.bucket_offset : e.bucket_offset + e.chunk_size]
            diff.add(new.view(dtype), base.view(dtype), e.bucket_offset // word)
        return diff, diff.seal()

    def _finish_diff(self, bases: _Bases, step: Any, diff: BucketDiff, event: Any) -> tuple[int, int, torch.Tensor | None, torch.Tensor, int]:
        """(kind, bytes, checksum of the result, payload, changed words) of a queued diff; a bucket
        with more than 1 changed word in 32 goes dense and is encoded by the codec next time."""
        key, n, word = step.ordinal, step.bucket.nbytes, step.word_bytes
        if event is not None:
            self._wait_event(event, f"the diff of bucket {step.bucket.index}")
        size, delta_sum, num_changed = diff.finish()
        if num_changed > diff.cap:
            bases.busy.add(key)
        return self._frame_of(bases, key, n, word, size, delta_sum, num_changed, diff.out)

    def _encode_packed(
        self, bases: _Bases, step: Any, pieces: PieceReader, stable: bool, stats: SendStats
    ) -> tuple[int, int, torch.Tensor | None, torch.Tensor, int]:
        """A bucket that changed a lot last time: pack it and let the codec choose (its bitmask
        index is smaller than int32 positions there); back to the one-pass diff once it calms."""
        key, n, word = step.ordinal, step.bucket.nbytes, step.word_bytes
        image = bases.images[key][:n]
        if bases.sums.get(key) is None:
            bases.sums[key] = codec.checksum(image, word)
        scratch, out = self._buffers[0][:n], self._buffers[1]
        self._pack_into(scratch, step, pieces, stable, stats)
        size = codec.encode_into_base(image, scratch, word, out)  # the image becomes `new` either way
        num_changed, delta_sum = header_fields(out[:size]) if size is not None else (n // word, 0)
        if size is None or num_changed * 32 < n // word:
            bases.busy.discard(key)
        return self._frame_of(bases, key, n, word, size, delta_sum, num_changed, out)

    def _frame_of(
        self, bases: _Bases, key: int, n: int, word: int, size: int | None, delta_sum: Any, num_changed: int, out: torch.Tensor
    ) -> tuple[int, int, torch.Tensor | None, torch.Tensor, int]:
        if size is None:
            bases.sums[key] = None
            return DENSE, n, None, bases.images[key][:n], n // word
        result = bases.sums[key] + delta_sum
        bases.sums[key] = result
        return PATCH, size, result, out[:size].clone(), num_changed

    def _frame_header(self, kind: int, size: int, checksum: torch.Tensor | None) -> torch.Tensor:
        """(kind, bytes, checksum) of one bucket, one int64 row on the transport's device, written
        by fill kernels (a host-to-device copy would wait for the queued diff kernels)."""
        header = torch.zeros((1, 3), dtype=torch.int64, device=self.device)
        header[0, 0].fill_(kind)
        header[0, 1].fill_(size)
        if checksum is not None:
            header[0, 2].copy_(checksum.reshape(()))
        return header

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
        """Per bucket: its header, then its payload; each patch is checked against this rank's own
        base while the next bucket is in flight. Patches are applied, and tensors handed to the
        loader, only after every bucket has passed; after a failed check the remaining frames are
        still received (so senders finish), then the failure is raised."""
        sched = self._schedule(manifest)
        steps = sched.steps
        works: list[Any] = []
        t_start = time.perf_counter()
        failure: TransferError | None = None
        try:
            bases = self._bases_for(manifest, delta, [(s.bucket.index, s.bucket.nbytes) for s in steps])
            frames: list[tuple[int, int, int]] = []
            patches: dict[int, codec.DecodedPatch] = {}
            pending: tuple[Any, int, int, int, torch.Tensor, Any] | None = None
            check_s = 0.0
            for step in steps:
                header = torch.empty((1, 3), dtype=torch.int64, device=self.device)
                where = f"bucket {step.bucket.index} from sender {step.bucket.sender}"
                self._settle(step.gid, self._broadcast_on(step.gid, None, header), f"the frame header of {where}")
                kind, size, expect = header[0].tolist()
                self._check_frame(step, kind, size, delta)
                frames.append((kind, size, expect))
                image = bases.images[step.bucket.index]
                msg = image[:size] if kind == DENSE else torch.empty(size, dtype=torch.uint8, device=self.device)
                work = self._broadcast_on(step.gid, None, msg)
                if pending is not None:
                    t0 = time.perf_counter()
                    failure = self._check_arrived(bases, patches, pending, failure)
                    check_s += time.perf_counter() - t0
                pending = (step, kind, size, expect, msg, work)
            if pending is not None:
                t0 = time.perf_counter()
                failure = self._check_arrived(bases, patches, pending, failure)
                check_s += time.perf_counter() - t0
            if failure is not None:
                raise failure
            t_apply = time.perf_counter()
            changed = 0
            for step, (kind, _size, expect) in zip(steps, frames):
                k = step.bucket.index
                if kind == DENSE:
                    bases.sums[k] = None
                    continue
                patch = patches.pop(k)
                codec.apply(bases.images[k][: step.bucket.nbytes], patch)
                bases.sums[k] = torch.tensor(expect, dtype=torch.int64, device=self.device)
                changed += int(patch.positions.numel())
            apply_s = time.perf_counter() - t_apply
            bases.sync_id = delta.new_id
        except BaseException:
            works.clear()
            self.abort()
            raise
        wire = sum(size for _k, size, _e in frames)
        self.last_delta_stats = {
            "wire_bytes": float(wire), "dense_bytes": float(sum(s.bucket.nbytes for s in steps)),
            "patch_buckets": float(sum(1 for k, _s, _e in frames if k == PATCH)), "apply_s": apply_s + check_s,
            "check_s": check_s, "receive_s": time.perf_counter() - t_start, "changed_words": float(changed),
            "base_bytes": float(bases.nbytes),
        }
        yield from self._yield_images(manifest, destinations, bases)

    def _settle(self, gid: int, work: Any, what: str) -> None:
        """Wait, with the timeout, for one broadcast on group `gid` (the host then reads its bytes)."""
        if self._comm_stream is None:
            self._wait_work(work, what)
            return
        ev = self._new_event()
        ev.record(self._streams[gid])
        self._wait_event(ev, what)

    def _check_arrived(
        self, bases: _Bases, patches: dict[int, Any], pending: tuple[Any, int, int, int, torch.Tensor, Any], failure: TransferError | None
    ) -> TransferError | None:
        """Wait for a bucket's payload; a patch is decoded and checked (unless an earlier one failed)."""
        step, kind, size, expect, msg, work = pending
        self._settle(step.gid, work, f"bucket {step.bucket.index} from sender {step.bucket.sender}")
        if kind == DENSE or failure is not None:
            return failure
        try:
            patches[step.bucket.index] = self._verify_patch(bases, step, msg, expect)
        except TransferError as exc:
            return exc
        return None

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

    def _verify_patch(self, bases: _Bases, step: Any, payload: torch.Tensor, expect: int) -> Any:
        """Decode a patch and check it against this rank's own base (not yet applied)."""
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
        return patch

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
