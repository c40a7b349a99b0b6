"""The sending side of a delta sync (receiving: pipelined_delta_receive.py; what each rank keeps
between syncs: delta_bases.py).

A sender keeps a base image of each bucket it sends (the bucket's wire bytes at the last sync, in
device memory: 1/S of the model on each of S senders). One patch sync, per bucket:
1. encode: a bucket that changed little last time is compared with its base straight from the
   source tensors, one pass per piece (`ckpt_engine.delta.direct`, no pack); any other is packed
   and encoded by the codec, which picks a bitmask patch when many words change. A patch is kept
   when smaller than the bucket; the base image becomes the new bytes either way;
2. the bucket's header (kind, bytes, checksum of the result) and payload (the patch, or the base
   image itself) leave at once, so the next bucket is encoded while this one travels.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

import torch

from ckpt_engine.transports.delta_bases import DELTA_BASES, DENSE, FRAME_WORDS, PATCH, Bases
from ckpt_engine.transports.piece_reader import PieceReader
from ckpt_engine.transports.wire_views import flat_bytes
from ckpt_engine.copies import batched_copy_, put_int64s_
from ckpt_engine.delta import codec
from ckpt_engine.delta.direct import SCATTER_BELOW, BucketDiff, capacity
from ckpt_engine.delta.layout import PATCH_HEADER_BYTES, header_fields, word_dtype
from ckpt_engine.delta.request import DeltaRequest
from ckpt_engine.transports.base import SendStats, TransferError
from ckpt_engine.manifest import BucketManifest

__all__ = ["FAST_LINK_SCATTER_BELOW", "DeltaTransferMixin"]

logger = logging.getLogger(__name__)

FAST_LINK_SCATTER_BELOW = 1 / 4
# Above the default limit, a bucket moves to the one-pass diff when its changed words last time
# were at most _JOIN_AT of what a scatter patch may carry, and back to the codec above _LEAVE_AT: a
# diff that overflows the patch sends the whole bucket, so the change rate may grow a little
# before it would. At the default 1/32 the bitmask is as small as the patch there, and the margin
# only sent more buckets through the codec (a CPU sender, 7B one layer at lr 1e-6: 5.9x raw with
# it, 4.95x without, on a noisy 2-core box).
_JOIN_AT = 0.75
_LEAVE_AT = 0.9

class DeltaTransferMixin:
    """Mixed into PipelinedBroadcastEngine: the bases and `_send_delta` (receiving is in
    pipelined_delta_receive.py)."""

    def _init_delta(self, delta_base: str = "device", delta_scatter_below: float | None = None) -> None:
        if delta_base not in DELTA_BASES:
            raise ValueError(f"delta_base must be one of {', '.join(DELTA_BASES)}, got {delta_base!r}")
        if delta_scatter_below is not None and (
            isinstance(delta_scatter_below, bool) or not isinstance(delta_scatter_below, (int, float)) or not 0 < delta_scatter_below <= 0.5
        ):
            raise ValueError(f"delta_scatter_below must be a fraction in (0, 0.5], got {delta_scatter_below!r}")
        self.delta_base = delta_base
        """Where a sender keeps the base of what it sends: `device` memory (fastest: the one-pass
        diff reads it in place), or pinned `host` memory (no device memory but one bucket-sized
        staging buffer; each bucket's base crosses the host link twice per sync, so a sync is
        bound by that link: for trainers short of device memory on a slow network), or nowhere
        (`cast`: the trainer writes its bf16 weights through `cast_recorder()`, which records
        each bucket's patch as it casts; pipelined_cast_send.py). Receivers keep theirs on the
        device (or none, in place) either way."""
        self._scatter_below_given = delta_scatter_below is not None
        self.delta_scatter_below = float(delta_scatter_below) if delta_scatter_below is not None else (
            FAST_LINK_SCATTER_BELOW if self.device.type == "cuda" else SCATTER_BELOW
        )
        """Most changed words (a fraction of a bucket's) for which a sender encodes the bucket in
        one pass to int32 positions; a busier bucket is packed and encoded by the codec (a bitmask
        index: smaller on the wire, but a pack, two passes and more host work per bucket). Default:
        1/4 on CUDA transports (NVLink, InfiniBand: the encode costs more than the extra wire
        bytes; 7B at lr 1e-5 on 2xH200: 0.91x a raw broadcast against 1.35x with 1/32), 1/32
        elsewhere (the smaller patch). A cast recorder's patch areas hold this fraction of their
        buckets' words, 1/4 unless given (a bitmask patch is not recorded)."""
        self._bases = Bases()
        self._places_cache: Any = None
        self._patch_buffers: tuple[str, dict[int, torch.Tensor]] | None = None  # a CPU receiver's, per bucket
        self._stage: torch.Tensor | None = None
        self._recorder: Any = None  # (plan digest, CastRecorder) with delta_base="cast"
        self.last_delta_stats: dict[str, float] = {}

    def _reset_delta(self) -> None:
        self._bases = Bases()
        self._places_cache = None
        self._patch_buffers = None
        self._stage = None
        if self._recorder is not None:
            self._recorder[1].forget()

    def _invalidate_delta(self) -> None:
        """The bases no longer match what the other side holds (a failure, or a sync without them)."""
        self._bases.sync_id = None
        if self._recorder is not None:
            self._recorder[1].forget()

    def delta_base_id(self, manifest: BucketManifest) -> int | None:
        b = self._bases
        return b.sync_id if b.digest == manifest.digest else None

    @property
    def delta_base_bytes(self) -> int:
        """Memory the base images (or a cast recorder's patch areas) take on this rank."""
        return self._bases.nbytes + (self._recorder[1].nbytes if self._recorder is not None else 0)

    def _bases_for(self, manifest: BucketManifest, delta: DeltaRequest, keys: list[tuple[int, int]], inplace: bool = False) -> Bases:
        """The bases for this sync: checked against the request, (re)allocated for a new plan (or
        a receiver whose destinations start or stop holding the base: `inplace`)."""
        b = self._bases
        if delta.patches:
            if b.digest != manifest.digest or b.sync_id != delta.base_id or b.inplace != inplace:
                held = b.sync_id if b.digest == manifest.digest else None
                where = "" if b.inplace == inplace else (
                    " (held in the loader's tensors, which this sync does not offer)" if b.inplace else " (held in base copies, not the loader's tensors)"
                )
                raise TransferError(
                    f"rank {self.rank}: asked to patch against base {delta.base_id}, but this rank's bases hold "
                    f"{held if held is not None else 'nothing valid'} for this plan{where}; the sync must be dense"
                )
        elif b.digest != manifest.digest or b.inplace != inplace:
            self._bases = b = Bases(digest=manifest.digest, inplace=inplace)
            pinned = self._host_bases() and self.device.type != "cpu"
            for key, nbytes in keys:
                if not inplace and not (self.delta_base == "cast" and getattr(self, "is_sender", False)):  # a cast sender keeps none  # allocated pinned at once (pinning a pageable copy costs seconds per 10 GB)
                    b.images[key] = (
                        torch.zeros(nbytes, dtype=torch.uint8, device=self.device) if not pinned
                        else torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)  # a seed writes every byte
                    )
                b.sums[key] = None
        b.sync_id = None  # until this sync completes on this rank
        return b

    def _host_bases(self) -> bool:
        """Whether this rank's (sender) bases are kept apart from the transport's device: in pinned
        host memory (on a CPU transport the same logic runs with host tensors throughout)."""
        return self.delta_base == "host" and bool(getattr(self, "is_sender", False))

    # --- sender ------------------------------------------------------------------------------
    def _send_delta(
        self, manifest: BucketManifest, weights: Iterable[tuple[str, torch.Tensor]], *, stable: bool, delta: DeltaRequest
    ) -> SendStats:
        """Encode and send bucket by bucket: a bucket's header (kind, bytes, checksum) and payload
        leave as soon as it is encoded, so receivers check bucket k while this rank encodes k + 1.
        The diff kernels of bucket k + 1 are queued before bucket k's changed count is read, so the
        device never idles on that host round trip."""
        if self.delta_base == "cast":
            return self._send_cast(manifest, weights, stable=stable, delta=delta)
        t_start = time.perf_counter()
        sched, mine, stats = self._own_steps(manifest)
        it = iter(weights)
        works: list[Any] = []
        keep: list[torch.Tensor] = []  # what the queued broadcasts read, alive until drained
        tally = {"wire": 0, "changed": 0, "words": 0, "patches": 0, "direct": 0}

        host = {"host_walk_s": 0.0, "host_finish_s": 0.0, "host_wait_s": 0.0, "host_send_s": 0.0}  # where the host's time goes

        def send(step: Any, frame: tuple[int, int, torch.Tensor | None, torch.Tensor, int]) -> None:
            t_send = time.perf_counter()
            kind, size, result, msg, num_changed = frame
            tally["wire"] += size
            tally["changed"] += num_changed
            tally["patches"] += kind == PATCH
            header = self._frame_header(kind, size, result, msg)
            self._tamper_hook(step.bucket.index, msg)
            keep.extend((header, msg))
            works.append(self._broadcast_on(step.gid, None, header))
            works.append(self._broadcast_on(step.gid, None, msg))
            host["host_send_s"] += time.perf_counter() - t_send

        def finish(pending: tuple[Any, BucketDiff, Any]) -> tuple[int, int, torch.Tensor | None, torch.Tensor, int]:
            t_finish = time.perf_counter()
            frame = self._finish_diff(bases, *pending, host)
            host["host_finish_s"] += time.perf_counter() - t_finish
            return frame

        try:
            bases = self._bases_for(manifest, delta, [(s.ordinal, s.bucket.nbytes) for s in mine])
            pieces = PieceReader(it, sched, self.rank, self.device, stats, self._known_sources(manifest, stable))
            pending: tuple[Any, BucketDiff, Any] | None = None
            for i, step in enumerate(mine):
                n, word = step.bucket.nbytes, step.word_bytes
                tally["words"] += n // word
                t0 = time.perf_counter()
                if delta.patches and step.ordinal in bases.calm and n // word < 2**31 and not self._host_bases():
                    diff, event = self._start_diff(bases, step, pieces, i, stable)
                    host["host_walk_s"] += time.perf_counter() - t0
                    tally["direct"] += 1
                    if pending is not None:
                        send(pending[0], finish(pending))
                    pending = (step, diff, event)
                else:
                    if pending is not None:  # the codec and dense paths reuse its buffers
                        send(pending[0], finish(pending))
                        pending = None
                    if delta.patches:
                        frame = self._encode_packed(bases, step, pieces, stable, stats)
                    elif self._host_bases():  # packed on the device, kept on the host
                        stage = self._stage_of(n)
                        stage.zero_()  # padding stays zero, as in a device base (in-place receivers hold none)
                        self._pack_into(stage, step, pieces, stable, stats)
                        bases.images[step.ordinal][:n].copy_(stage, non_blocking=True)
                        bases.sums[step.ordinal] = None
                        frame = (DENSE, n, None, stage.clone(), n // word)  # the stage is reused next bucket
                    else:
                        self._pack_into(bases.images[step.ordinal], step, pieces, stable, stats)
                        bases.sums[step.ordinal] = None
                        frame = (DENSE, n, None, bases.images[step.ordinal][:n], n // word)
                    send(step, frame)
                if delta.patches:
                    stats.extra["encode_s"] = stats.extra.get("encode_s", 0.0) + time.perf_counter() - t0
            if pending is not None:
                t0 = time.perf_counter()
                send(pending[0], finish(pending))
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
            patch_buckets=float(tally["patches"]), direct_buckets=float(tally["direct"]), changed_fraction=tally["changed"] / words if words else 0.0,
            base_bytes=float(bases.nbytes), base_on_host=float(self._host_bases() or self.device.type == "cpu"),
        )
        if delta.patches:
            stats.extra.update(host)
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

    def _start_diff(self, bases: Bases, step: Any, pieces: PieceReader, parity: int, stable: bool) -> tuple[BucketDiff, Any]:
        """Queue the one-pass diff of a bucket's source tensors against its base image (no pack;
        a piece not yet in the wire dtype is converted into the scratch buffer first): one launch
        for the whole bucket when the sources stay valid until it runs (`stable`, or converted
        into the scratch buffer), else one per piece, queued before the next piece is
        requested (a gathered tensor is freed then). Two buckets' patches are in flight at once,
        in the two halves of the second buffer."""
        key, n, word = step.ordinal, step.bucket.nbytes, step.word_bytes
        image = bases.images[key][:n]
        if bases.sums.get(key) is None:
            bases.sums[key] = codec.checksum(image, word)
        half = self._buffers[1].numel() // 16 * 8
        region = self._buffers[1][half * (parity % 2) :][:half]
        diff = BucketDiff(region, n, word, self._scatter_below(n, word))
        dtype = word_dtype(word)
        image_words = image.view(dtype)
        rows: list[tuple[int, int, int]] = []
        for e in step.bucket.entries:
            src, own = pieces.source(e)
            kept = stable and own  # a converted shard is a temporary, freed at the next tensor
            if e.is_whole and not own:
                converted = self._entry_view(self._buffers[0], e)
                converted.copy_(src)
                src, kept = converted, True
            first = e.bucket_offset // word
            if kept and diff.fused:  # no views: the table needs only where the words are
                rows.append((src.data_ptr(), e.chunk_size // word, first))
            else:
                new = (flat_bytes(src) if e.is_whole else src).view(dtype)
                diff.add(new, image_words[first : first + new.numel()], first)
        if rows:
            diff.add_pieces(rows, image_words, bases.tables.setdefault(key, {}))
        return diff, diff.seal()

    def _finish_diff(
        self, bases: Bases, step: Any, diff: BucketDiff, event: Any, host: dict[str, float] | None = None
    ) -> tuple[int, int, torch.Tensor | None, torch.Tensor, int]:
        """(kind, bytes, checksum of the result, payload, changed words) of a queued diff; a bucket
        with more changed words than a scatter patch may carry goes dense and is encoded by the
        codec next time."""
        key, n, word = step.ordinal, step.bucket.nbytes, step.word_bytes
        if event is not None:
            t0 = time.perf_counter()
            self._wait_event(event, f"the diff of bucket {step.bucket.index}")
            if host is not None:
                host["host_wait_s"] += time.perf_counter() - t0
        size, delta_sum, num_changed = diff.finish()
        if num_changed > diff.cap * self._margins(diff.scatter_below)[1]:  # near the limit: the codec next time (it never overflows)
            bases.calm.discard(key)
        return self._frame_of(bases, key, n, word, size, delta_sum, num_changed, diff.out)

    def _encode_packed(
        self, bases: Bases, step: Any, pieces: PieceReader, stable: bool, stats: SendStats
    ) -> tuple[int, int, torch.Tensor | None, torch.Tensor, int]:
        """A bucket that changed a lot last time (or has no history): pack it and let the codec
        choose (its bitmask index is smaller than int32 positions when many words change); the
        one-pass diff takes over once the changed words fit a scatter patch (`delta_scatter_below`).
        Padding between entries is zeroed, so it never differs from the base (in-place receivers
        hold no padding)."""
        key, n, word = step.ordinal, step.bucket.nbytes, step.word_bytes
        kept = bases.images[key][:n]
        image = kept
        if self._host_bases():  # the base crosses to the device and back
            image = self._stage_of(n)
            image.copy_(kept, non_blocking=True)
        if bases.sums.get(key) is None:
            bases.sums[key] = codec.checksum(image, word)
        scratch, out = self._buffers[0][:n], self._buffers[1]
        scratch.zero_()
        self._pack_into(scratch, step, pieces, stable, stats)
        size = codec.encode_into_base(image, scratch, word, out)  # the image becomes `new` either way
        if image is not kept:
            kept.copy_(image, non_blocking=True)
        num_changed, delta_sum = header_fields(out[:size]) if size is not None else (n // word, 0)
        below = self._scatter_below(n, word)
        if size is not None and num_changed <= capacity(n, word, below) * self._margins(below)[0]:
            bases.calm.add(key)
        frame = self._frame_of(bases, key, n, word, size, delta_sum, num_changed, out)
        if frame[0] == DENSE and image is not kept:
            frame = (DENSE, n, None, image.clone(), frame[4])  # sent from the device; the stage is reused
        return frame

    def _scatter_below(self, n: int, word: int) -> float:
        """`delta_scatter_below`, lowered so that a bucket of `n` bytes fits half the second buffer
        (two buckets' patches are in flight at once)."""
        half = self._buffers[1].numel() // 16 * 8
        fit = max(0, half - 64) // (4 + word) / max(1, n // word)
        return max(min(self.delta_scatter_below, fit), 1e-9)

    @staticmethod
    def _margins(below: float) -> tuple[float, float]:
        """(join, leave) fractions of a scatter patch's capacity under limit `below` (see _JOIN_AT)."""
        return (_JOIN_AT, _LEAVE_AT) if below > SCATTER_BELOW else (1.0, 1.0)

    def _stage_of(self, n: int) -> torch.Tensor:
        """The device buffer a host-kept base is staged in (one bucket, allocated once)."""
        if self._stage is None or self._stage.numel() < n:
            self._stage = torch.empty(self.bucket_size_bytes, dtype=torch.uint8, device=self.device)
        return self._stage[:n]

    def _frame_of(
        self, bases: Bases, key: int, n: int, word: int, size: int | None, delta_sum: Any, num_changed: int, out: torch.Tensor
    ) -> tuple[int, int, torch.Tensor | None, torch.Tensor, int]:
        if size is None:
            bases.sums[key] = None
            return DENSE, n, None, bases.images[key][:n], n // word
        result = bases.sums[key] + delta_sum
        bases.sums[key] = result
        return PATCH, size, result, out[:size].clone(), num_changed

    def _frame_header(self, kind: int, size: int, checksum: torch.Tensor | None, payload: torch.Tensor | None = None) -> torch.Tensor:
        """(kind, bytes, checksum, the patch's own 32-byte header) of one bucket, one int64 row
        (FRAME_WORDS) on the transport's device, written without a host sync (which would wait
        for the queued diff kernels). The patch header rides along so that a receiver decodes the
        patch without reading its payload back: it never waits on the host for a payload."""
        header = torch.empty((1, FRAME_WORDS), dtype=torch.int64, device=self.device)
        put_int64s_(header[0], [kind, size] + [0] * (FRAME_WORDS - 2))
        if checksum is not None:
            header[0, 2].copy_(checksum.reshape(()))
        if kind == PATCH and payload is not None:
            header[0, 3:].copy_(payload[: PATCH_HEADER_BYTES].view(torch.int64))
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
