"""The receiving side of a delta sync: per bucket a frame header, then the payload (dense or a patch).

No receive is posted with a size from an unchecked header. A header whose seal
(`delta_bases.frame_seal`) does not match was corrupted on its own: nothing is posted and this
rank drops its groups (a SyncError naming bucket and sender). A sealed header that announces a
kind or size the bucket cannot have (a lying sender) fails the sync, but its payload is still
taken into scratch memory so the collective stays in step. Each patch is checked as it arrives:
the sender's checksum of the result must equal this rank's base checksum plus the patch's change.
Tensors reach the loader only after every bucket passed, so a bad frame leaves the engine's
weights as they were; after a failed check the remaining frames are still received, then raised.

Two places for the base. With `destinations` holding every entry in the wire layout, the loader's
own tensors are the base (`delta.pieces.ScatteredImage`): a patch's words are written as it lands
(the writes overlap the transfer), the checks are read back together after the last bucket, and
the old words are kept until the sync ends, so a failure writes them back, latest bucket first;
no bucket-sized copy exists. Otherwise each bucket has a base image in device memory, patched
after every check passed, whose views are handed to the loader.
"""

from __future__ import annotations

import logging
import struct
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ckpt_engine.delta import codec
from ckpt_engine.delta.layout import word_dtype
from ckpt_engine.delta.pieces import ScatteredImage, pair_delta
from ckpt_engine.delta.request import DeltaRequest
from ckpt_engine.manifest import BucketManifest
from ckpt_engine.pipeline.assembly import chunk_landed
from ckpt_engine.pipeline.delta_bases import DENSE, FRAME_WORDS, PATCH, SEAL_WORD, Bases, bases_for, frame_seal, frames_of, stamp_of
from ckpt_engine.pipeline.options import PipelineOptions
from ckpt_engine.pipeline.plan_state import PlanState
from ckpt_engine.pipeline.schedule import Step
from ckpt_engine.pipeline.staging import StagedBuckets, StagedPatch, StagedPatches, read_words, write_words
from ckpt_engine.staged import StagedVersion
from ckpt_engine.pipeline.wire_views import entry_view, flat_bytes, has_wire_layout
from ckpt_engine.engine import TransferError
from ckpt_engine.transports.transport import SLACK, Transport

__all__ = ["DeltaReceiver"]

logger = logging.getLogger(__name__)

_DROPPED = -1
"""The kind of a refused frame whose payload is taken and dropped."""


class DeltaReceiver:
    """Takes a delta sync's frames, checks them all, then hands the result to the loader."""

    def __init__(self, transport: Transport, options: PipelineOptions) -> None:
        self.t = transport
        self.opts = options
        self.last_stats: dict[str, float] = {}

    def receive(
        self, state: PlanState, manifest: BucketManifest, destinations: Mapping[str, torch.Tensor] | None, delta: DeltaRequest
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        places = self._take(state, manifest, destinations, delta, None)
        if places is not None:
            assert destinations is not None
            yield from self._yield_destinations(state, destinations)
        else:
            yield from self._yield_images(state, destinations, state.bases)

    def receive_staged(
        self, state: PlanState, manifest: BucketManifest, destinations: Mapping[str, torch.Tensor] | None, delta: DeltaRequest
    ) -> StagedVersion:
        """A patch sync taken and checked without writing `destinations` (the live weights); see
        `pipeline/staging.py`. With base images the loader's buckets are kept as they are (views of
        the verified images, unchanged until the next sync; chunked tensors reassemble aside)."""
        if not delta.patches:
            raise ValueError("a staged patch receive takes a patch sync (a delta request with patches); stage a seed as 'full'")
        if self._places(state, destinations) is None:
            buckets = list(self.receive(state, manifest, None, delta))

            def forget() -> None:  # the images hold the discarded version: the next sync seeds them
                state.bases.sync_id = None

            return StagedBuckets(buckets, on_discard=forget)
        staged: list[StagedPatch] = []
        places = self._take(state, manifest, destinations, delta, staged)
        assert places is not None and destinations is not None
        bases = state.bases

        live = {name: x for name, x in destinations.items() if x.numel() and name in state.schedule.tensor_bytes}
        return StagedPatches(
            bases, places, staged, delta.new_id, live, lambda: self._yield_destinations(state, destinations), self.t.wait_compute
        )

    def _take(
        self, state: PlanState, manifest: BucketManifest, destinations: Mapping[str, torch.Tensor] | None, delta: DeltaRequest,
        staged: list[StagedPatch] | None,
    ) -> dict[int, ScatteredImage] | None:
        """Take every frame and check it; then (not `staged`) apply them. `staged`: in place,
        check each patch without writing and keep it (and each dense frame) there instead.
        Returns the in-place images (None: base images)."""
        t, link = self.t, frames_of(self.t)
        sched = state.schedule
        steps = sched.steps
        works: list[Any] = []
        t_start = time.perf_counter()
        failure: TransferError | None = None
        places: dict[int, ScatteredImage] | None = None
        undo: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # in place: (bucket, positions, old words) written
        checks: list[_Check] = []  # in place: each patch's check, read back once at the end
        try:
            places = self._places(state, destinations)
            keys = [(s.bucket.index, s.bucket.nbytes) for s in steps]
            bases = state.bases = bases_for(
                state.bases, manifest, delta, keys, inplace=places is not None, rank=t.rank, device=t.device
            )
            if places is not None and delta.patches:
                assert destinations is not None
                failure = self._stale_destination(bases, destinations)
            frames: list[tuple[int, int, int]] = []
            arrived: dict[int, Any] = {}  # checked patches, and dense frames staged for in-place receivers
            pending: _Pending | None = None
            check_s = 0.0
            setup_s = time.perf_counter() - t_start  # host time before the first frame (per-tensor checks)
            for step in steps:
                gid = step.bucket.sender  # each sender streams over its own group
                header = link.fresh(gid, FRAME_WORDS, torch.int64, (1, FRAME_WORDS))
                where = f"bucket {step.bucket.index} from sender {step.bucket.sender}"
                link.settle(gid, link.post(gid, header, after_producer=False), f"the frame header of {where}")
                with link.reading(gid):
                    row = header[0].tolist()
                kind, size, expect = row[:3]
                head = struct.pack(f"<{SEAL_WORD - 3}q", *row[3:SEAL_WORD])  # the patch's own header, sent ahead of it
                self._check_seal(step, kind, size, row[SEAL_WORD], delta)
                bad = self._check_frame(step, kind, size, delta)
                if bad is not None:  # take its payload (what the sender posts) and drop it
                    kind = _DROPPED
                    msg = link.fresh(gid, size)
                    work = link.post(gid, msg, after_producer=False)
                elif kind == DENSE and places is None:  # into the base image: after the compute stream's use of it
                    msg = bases.images[step.bucket.index][:size]
                    work = link.post(gid, msg)
                elif kind == PATCH and not t.uses_streams:
                    msg = self._patch_buffer(state, step.bucket.index, size, step.bucket.nbytes)
                    work = link.post(gid, msg, after_producer=False)
                else:  # lands while earlier patches are applied on the compute stream
                    msg = link.fresh(gid, size)
                    work = link.post(gid, msg, after_producer=False)
                works.append(work)
                frames.append((kind, size, expect))
                landed = None
                if places is not None and t.uses_streams:  # the compute stream waits for it, not the host
                    landed = link.landed_event(gid)
                if pending is not None:
                    t0 = time.perf_counter()
                    failure = self._check_arrived(bases, places, arrived, pending, failure, delta, undo, checks, staged is not None)
                    check_s += time.perf_counter() - t0
                pending = (step, kind, size, expect, msg, work, landed, head, bad)
            if pending is not None:
                t0 = time.perf_counter()
                failure = self._check_arrived(bases, places, arrived, pending, failure, delta, undo, checks, staged is not None)
                for gid in {s.bucket.sender for s in steps}:  # every payload landed, within the timeout, before any read back
                    link.settle(gid, None, f"the last payloads on group {gid}")
                failure = self._settle_checks(checks) or failure  # the earlier buckets' failure, if any
                check_s += time.perf_counter() - t0
            if failure is not None:
                raise failure
            t_apply = time.perf_counter()
            if staged is not None:
                staged.extend(arrived[s.bucket.index] for s in steps if s.bucket.index in arrived)
                changed = sum(int(f.positions.numel()) for f in staged if f.positions is not None)
            else:
                changed = self._apply_all(bases, places, arrived, steps, frames)
            apply_s = time.perf_counter() - t_apply
            if places is not None and staged is None:
                assert destinations is not None
                bases.stamps = {name: stamp_of(x) for name, x in destinations.items() if x.numel() and name in sched.tensor_bytes}
            if staged is None:
                bases.sync_id = delta.new_id
            undo.clear()
        except BaseException:
            works.clear()
            self._roll_back(places, undo)
            t.abort()
            state.bases.sync_id = None
            raise
        wire = sum(size for _k, size, _e in frames)
        self.last_stats = {
            "wire_bytes": float(wire), "dense_bytes": float(sum(s.bucket.nbytes for s in steps)),
            "patch_buckets": float(sum(1 for k, _s, _e in frames if k == PATCH)), "apply_s": apply_s + check_s,
            "check_s": check_s, "receive_s": time.perf_counter() - t_start, "changed_words": float(changed),
            "base_bytes": float(bases.nbytes), "in_place": float(places is not None), "setup_s": setup_s,
        }
        return places

    def _check_seal(self, step: Step, kind: int, size: int, seal: int, delta: DeltaRequest) -> None:
        """A header whose seal does not match its kind and size was corrupted after the sender
        made it: what the sender posts is unknown, so nothing is posted; the TransferError raised
        here drops this rank's groups (`_take`), and the sender and every other rank (all read
        the same header) fail their pending broadcasts at once instead of gloo aborting on a
        receive of the wrong size."""
        if seal == frame_seal(kind, size, step.bucket.index, delta.new_id):
            return
        self.t.broken = True
        raise TransferError(
            f"rank {self.t.rank}: bucket {step.bucket.index} from sender {step.bucket.sender}: the frame header is corrupt "
            f"(kind {kind}, {size} bytes: its seal does not match); nothing of it was received, the engine keeps its old weights"
        )

    def _check_frame(self, step: Step, kind: int, size: int, delta: DeltaRequest) -> TransferError | None:
        """A frame whose header announces what this bucket cannot be: a TransferError (its payload
        is still taken); a size this rank cannot even post is raised at once (the group aborts)."""
        n = step.bucket.nbytes
        ok = (kind == DENSE and size == n) or (kind == PATCH and delta.patches and codec.PATCH_HEADER_BYTES <= size <= n)
        if ok:
            return None
        self.t.broken = True
        error = TransferError(
            f"rank {self.t.rank}: bucket {step.bucket.index} from sender {step.bucket.sender} announced "
            f"kind {kind} of {size} bytes (bucket of {n} bytes, patches {'allowed' if delta.patches else 'not allowed'}); "
            "the engine keeps its old weights"
        )
        if not 0 <= size <= max(n, self.opts.bucket_size_bytes) + SLACK:
            raise error
        return error

    def _patch_buffer(self, state: PlanState, index: int, size: int, bucket_bytes: int) -> torch.Tensor:
        """Host memory for bucket `index`'s patch, kept from sync to sync: a fresh allocation of
        tens of MB comes as new pages from the OS, and touching them first cost more than receiving
        the patch (1-layer 7B on the CPU box: ~100 ms of a 0.5 s sync for one 65 MB patch). Kept
        only for patches of at most a quarter of their bucket, so it holds <= 1/4 of the model
        (~6 % at lr 1e-6); nothing reads it after the sync that received into it has ended."""
        if size > bucket_bytes // 4:
            return torch.empty(size, dtype=torch.uint8)
        kept = state.patch_buffers
        buf = kept.get(index)
        if buf is None or buf.numel() < size:
            buf = kept[index] = torch.empty(min(bucket_bytes // 4, size + size // 4), dtype=torch.uint8)
        return buf[:size]

    def _places(self, state: PlanState, destinations: Mapping[str, torch.Tensor] | None) -> dict[int, ScatteredImage] | None:
        """Per bucket, its words as they lie in the loader's tensors; None unless every entry of
        the manifest has a destination in the wire layout on this device (cached per plan and
        tensors)."""
        if not destinations:
            return None
        sched = state.schedule
        key = tuple((n, x.data_ptr()) for n, x in destinations.items() if n in sched.tensor_bytes)
        if state.places is not None and state.places[0] == key:
            return state.places[1]
        places: dict[int, ScatteredImage] | None = {}
        for step in sched.steps:
            regions = []
            word = step.word_bytes
            for e in step.bucket.entries:
                dest = destinations.get(e.name)
                if dest is None or not has_wire_layout(dest, e, self.t.device):
                    places = None
                    break
                if e.chunk_size:
                    region = flat_bytes(dest)[e.chunk_offset : e.chunk_offset + e.chunk_size]
                    regions.append((e.bucket_offset // word, region.view(word_dtype(word))))
            if places is None:
                break
            if regions:
                places[step.bucket.index] = ScatteredImage(regions, step.bucket.nbytes // word)
        state.places = (key, places)
        return places

    def _yield_destinations(self, state: PlanState, destinations: Mapping[str, torch.Tensor]) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """In place: each tensor is complete already; it is yielded (itself, so a loader's copy is
        skipped) with the bucket that carries its last bytes."""
        for step in state.schedule.steps:
            yield [(e.name, destinations[e.name]) for e in step.bucket.entries if e.chunk_offset + e.chunk_size == e.nbytes]
        self.t.wait_compute("applying the patches")

    def _yield_images(
        self, state: PlanState, destinations: Mapping[str, torch.Tensor] | None, bases: Bases
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The verified images, bucket by bucket, as the dense loop yields its buffers."""
        sched = state.schedule
        remaining = dict(sched.tensor_bytes)
        for step in sched.steps:
            image = bases.images[step.bucket.index]
            out: list[tuple[str, torch.Tensor]] = []
            for e in step.bucket.entries:
                view = entry_view(image, e)
                if e.is_whole:
                    out.append((e.name, view))
                    continue
                done = chunk_landed(state, e, view, remaining, destinations, self.t.device)
                if done is not None:
                    out.append((e.name, done))
            yield out
        self.t.wait_compute("loading the last bucket")

    def _stale_destination(self, bases: Bases, destinations: Mapping[str, torch.Tensor]) -> TransferError | None:
        """A destination written by anything but the last sync is no longer the base."""
        for name, (ptr, version) in bases.stamps.items():
            t = destinations.get(name)
            if t is None or stamp_of(t) != (ptr, version):
                self.t.broken = True
                return TransferError(
                    f"rank {self.t.rank}: the loader's tensor {name!r} changed since the last sync (it is the base of "
                    "this patch sync); the engine keeps its weights and the next sync must be dense"
                )
        return None

    def _check_arrived(
        self,
        bases: Bases,
        places: dict[int, ScatteredImage] | None,
        arrived: dict[int, Any],
        pending: _Pending,
        failure: TransferError | None,
        delta: DeltaRequest,
        undo: list[tuple[int, torch.Tensor, torch.Tensor]],
        checks: list[_Check],
        staged: bool = False,
    ) -> TransferError | None:
        """Wait for a bucket's payload (in place on an accelerator: the compute stream waits, the
        host goes on); check a patch (unless an earlier one failed). An in-place receiver stages
        a dense frame (with its checksum) until every patch has passed, or, in a sync without
        patches, copies it in at once."""
        step, kind, size, expect, msg, work, landed, head, bad = pending
        k = step.bucket.index
        if landed is not None:
            frames_of(self.t).wait_landed(landed)
        else:
            frames_of(self.t).settle(step.bucket.sender, work, f"bucket {k} from sender {step.bucket.sender}")
        if failure is not None:
            return failure
        if bad is not None:
            return bad
        if kind == DENSE:
            if places is not None and staged:  # kept (the slot may be reused) with its checksum and the words it replaces
                image = places.get(k)
                old = read_words(image) if image is not None else msg[:0]
                arrived[k] = StagedPatch(k, codec.checksum(msg, step.word_bytes), msg.clone(), old)
            elif places is not None:
                bases.sums[k] = codec.checksum(msg, step.word_bytes)
                if delta.patches:
                    arrived[k] = msg
                else:
                    self._write_dense(step, msg, places)
            return None
        try:
            arrived[k] = self._verify_patch(bases, places, step, msg, expect, undo, checks, head, staged)
        except TransferError as exc:
            return exc
        return None

    def _write_dense(self, step: Any, frame: torch.Tensor, places: dict[int, ScatteredImage]) -> None:
        image = places.get(step.bucket.index)
        if image is not None:
            write_words(image, frame)

    def _verify_patch(
        self, bases: Bases, places: dict[int, ScatteredImage] | None, step: Any, payload: torch.Tensor, expect: int,
        undo: list[tuple[int, torch.Tensor, torch.Tensor]], checks: list[_Check], head: bytes, staged: bool = False,
    ) -> Any:
        """Decode a patch and check it against this rank's own base. A base image is not written
        yet; in place, the new words are written as soon as the old ones are read (a position
        that appears twice in a corrupt patch still reads its old word twice: every read is
        queued before the write), the old words go to `undo`, and the check goes to `checks`:
        it is read back with every other bucket's at the end of the receive loop (_settle_checks),
        so the host never waits here for the kernels that apply the patch."""
        k, word = step.bucket.index, step.word_bytes
        n = step.bucket.nbytes
        where = f"rank {self.t.rank}: bucket {k} from sender {step.bucket.sender}"
        try:
            if places is None:
                patch = codec.decode(payload, n, word)
            else:  # swap_in counts positions outside the bucket's tensors (those < 0 or past the bucket among them)
                patch = codec.decode(payload, n, word, check_range=False, head=head)
        except codec.PatchError as exc:
            self.t.broken = True
            raise TransferError(f"{where}: malformed patch: {exc}") from exc
        if places is not None:
            base_sum = bases.sums.get(k)
            if base_sum is None or k not in places:
                raise TransferError(f"{where}: this rank holds no checksum of the bucket's base; the sync must be dense")
            if staged:  # read-only: the live words at the positions, kept patch for the swap
                old, bad = places[k].gather(patch.positions)
                checks.append((where, expect, base_sum + pair_delta(patch.positions, patch.values, old), bad, patch.unchecked))
                return StagedPatch(k, expect, patch.values.clone(), old, patch.positions.clone())
            old, bad, change = places[k].swap_in(patch.positions, patch.values)  # reads all, then writes
            undo.append((k, patch.positions, old))
            checks.append((where, expect, base_sum + change, bad, patch.unchecked))
            return patch
        image = bases.images[k][:n]
        base_sum = bases.sums.get(k)
        if base_sum is None:
            base_sum = bases.sums[k] = codec.checksum(image, word)
        got = int((base_sum + codec.delta_checksum(image, patch)).item())
        if got != expect:
            self.t.broken = True
            raise TransferError(_mismatch(where, expect, got))
        return patch

    def _settle_checks(self, checks: list[_Check]) -> TransferError | None:
        """Read back every deferred in-place check at once (one host sync); the first failure in
        bucket order, or None."""
        if not checks:
            return None
        zero = torch.zeros((), dtype=torch.int64, device=self.t.device)
        rows = torch.stack([
            torch.stack([got.reshape(()), bad.reshape(()).to(torch.int64), (pad if pad is not None else zero).reshape(()).to(torch.int64)])
            for _w, _e, got, bad, pad in checks
        ]).tolist()
        done = list(checks)
        checks.clear()
        for (where, expect, _g, _b, _p), (got, outside, pad) in zip(done, rows):
            if pad:
                self.t.broken = True
                return TransferError(f"{where}: malformed patch: patch padding after the positions is not zero")
            if outside:
                self.t.broken = True
                return TransferError(f"{where}: the patch writes {outside} words outside every tensor of the bucket; the engine keeps its old weights")
            if got != expect:
                self.t.broken = True
                return TransferError(_mismatch(where, expect, got))
        return None

    def _apply_all(
        self, bases: Bases, places: dict[int, ScatteredImage] | None, arrived: dict[int, Any], steps: list[Any], frames: list[tuple[int, int, int]]
    ) -> int:
        """Every bucket passed: apply the patches to base images (in place they are written
        already) and copy in staged dense frames; returns the changed words."""
        changed = 0
        for step, (kind, _size, expect) in zip(steps, frames):
            k = step.bucket.index
            if kind == DENSE:
                if places is None:
                    bases.sums[k] = None  # computed the first time a patch builds on it
                elif k in arrived:
                    self._write_dense(step, arrived.pop(k), places)
                continue
            patch = arrived.pop(k)
            if places is None:
                codec.apply(bases.images[k][: step.bucket.nbytes], patch)
            bases.sums[k] = torch.tensor(expect, dtype=torch.int64, device=self.t.device)
            changed += int(patch.positions.numel())
        return changed

    def _roll_back(self, places: dict[int, ScatteredImage] | None, undo: list[tuple[int, torch.Tensor, torch.Tensor]]) -> None:
        """Write back the old words of every patch written in place this sync (latest first), and
        wait until they are in: the engine's weights are then exactly the previous version."""
        if not undo or places is None:
            return
        try:
            for k, positions, old in reversed(undo):
                places[k].scatter(positions, old)
            self.t.wait_compute("writing back the previous version")
        except Exception:
            logger.critical("rank %s: writing the previous version back failed: the engine's weights are not to be trusted", self.t.rank)
            raise
        finally:
            undo.clear()


_Check = tuple[str, int, torch.Tensor, torch.Tensor, "torch.Tensor | None"]
"""An in-place patch's deferred check: (where, the sender's checksum, this rank's checksum after
the patch, positions outside every tensor, nonzero padding bytes), device values read at the end."""


def _mismatch(where: str, expect: int, got: int) -> str:
    return (
        f"{where}: checksum mismatch after applying the patch (sender {expect}, here {got}): "
        "the patch was corrupted or this rank's base differs; the engine keeps its old weights"
    )


_Pending = tuple[Any, int, int, int, torch.Tensor, Any, Any, bytes, "TransferError | None"]
"""A bucket whose payload is on its way: (step, kind, bytes, the sender's checksum, the payload,
its broadcast's work, the event after it on its group's stream (in place on an accelerator, else
None), the patch's header as its frame announced it, the frame's refusal: its payload is taken
and dropped)."""
