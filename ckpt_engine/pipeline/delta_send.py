"""The sending side of a delta sync (receiving: delta_receive.py; what each rank keeps between
syncs: delta_bases.py).

A sender keeps a base image of each bucket it sends (its wire bytes at the last sync, in device
memory: 1/S of the model on each of S senders). Per bucket, one pass: a bucket that changed little
last time is diffed against its base straight from the source tensors (`delta.direct`), any other
is packed first and diffed the same way; a patch is kept when smaller than the bucket, and the base
becomes the new bytes either way. The frame (header: kind, bytes, checksum of the result, a seal of
kind and bytes; then the payload) leaves at once, so the next bucket is encoded while this one
travels. The payload is exactly as long as the sealed header says: receivers post what a sealed
header announces and refuse one whose seal does not match (delta_receive.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch

from ckpt_engine.copies import batched_copy_, put_int64s_
from ckpt_engine.delta import codec
from ckpt_engine.delta.direct import SCATTER_BELOW, BucketDiff, capacity
from ckpt_engine.delta.layout import PATCH_HEADER_BYTES, Row, header_fields, word_dtype
from ckpt_engine.delta.request import DeltaRequest
from ckpt_engine.manifest import BucketManifest
from ckpt_engine.pipeline.fault_hooks import FaultHooks
from ckpt_engine.pipeline.delta_bases import DENSE, FRAME_WORDS, PATCH, SEAL_WORD, Bases, bases_for, frame_seal, frames_of
from ckpt_engine.pipeline.options import PipelineOptions
from ckpt_engine.pipeline.piece_reader import PieceReader, Seen
from ckpt_engine.pipeline.plan_state import PlanState
from ckpt_engine.pipeline.schedule import Step
from ckpt_engine.pipeline.wire_views import SourceMismatch, entry_view, flat_bytes
from ckpt_engine.engine import SendStats
from ckpt_engine.transports.transport import Transport

__all__ = ["DeltaSender", "Frame"]

# Above the default limit, a bucket moves to the one-pass diff when its changed words last time
# were at most _JOIN_AT of what a scatter patch may carry, and back to the codec above _LEAVE_AT: a
# diff that overflows the patch sends the whole bucket, so the change rate may grow a little
# before it would (measured when the codec still wrote a bitmask index: a CPU sender, 7B one layer
# at lr 1e-6, 5.9x raw with the margin, 4.95x without, on a noisy 2-core box).
_JOIN_AT = 0.75
_LEAVE_AT = 0.9


class Frame(NamedTuple):
    """One bucket as it leaves: kind, payload bytes, checksum of the result (a patch's), the
    payload, and the changed words it stands for."""

    kind: int
    size: int
    result: torch.Tensor | None
    payload: torch.Tensor
    changed: int


class DeltaSender:
    """Frames a sender's buckets as patches against its bases, or dense."""

    def __init__(self, transport: Transport, options: PipelineOptions, hooks: FaultHooks, *, scatter_below: float) -> None:
        self.t = transport
        self.opts = options
        self.hooks = hooks
        self.scatter_below = scatter_below
        self.last_stats: dict[str, float] = {}

    def send(
        self, state: PlanState, manifest: BucketManifest, weights: Iterable[tuple[str, torch.Tensor]], *, stable: bool, delta: DeltaRequest
    ) -> SendStats:
        """Encode and send bucket by bucket: a bucket's frame leaves as soon as it is encoded, so
        receivers check bucket k while this rank encodes k + 1. The diff kernels of bucket k + 1
        are queued before bucket k's changed count is read, so the device never idles on that
        host round trip."""
        assert self.t.rank is not None
        link = frames_of(self.t)
        t_start = time.perf_counter()
        sched = state.schedule
        mine, stats = state.own_steps(self.t.rank)
        it = iter(weights)
        works: list[Any] = []
        keep: list[torch.Tensor] = []  # what the queued broadcasts read, alive until drained
        tally = {"wire": 0, "changed": 0, "words": 0, "patches": 0, "direct": 0}
        host = {"host_walk_s": 0.0, "host_finish_s": 0.0, "host_wait_s": 0.0, "host_send_s": 0.0}  # where the host's time goes

        def send(step: Step, frame: Frame) -> None:
            t_send = time.perf_counter()
            tally["wire"] += frame.size
            tally["changed"] += frame.changed
            tally["patches"] += frame.kind == PATCH
            announced = self.hooks._tamper_size_hook(step.bucket.index, frame.kind, frame.size)
            seal = frame_seal(frame.kind, announced, step.bucket.index, delta.new_id)
            header = self._frame_header(frame.kind, announced, seal, frame.result, frame.payload)
            self.hooks._tamper_header_hook(step.bucket.index, header)
            self.hooks._tamper_hook(step.bucket.index, frame.payload)
            payload = _exactly(frame.payload, announced)
            keep.extend((header, payload))
            works.append(link.post(step.bucket.sender, header))
            works.append(link.post(step.bucket.sender, payload))
            host["host_send_s"] += time.perf_counter() - t_send

        def finish(pending: tuple[Step, BucketDiff, Any]) -> Frame:
            t_finish = time.perf_counter()
            frame = self._finish_diff(bases, *pending, host)
            host["host_finish_s"] += time.perf_counter() - t_finish
            return frame

        try:
            keys = [(s.ordinal, s.bucket.nbytes) for s in mine]
            bases = state.bases = bases_for(state.bases, manifest, delta, keys, inplace=False, rank=self.t.rank, device=self.t.device)
            pieces = PieceReader(it, sched, self.t.rank, self.t.device, stats, state.known if stable else None)
            pending: tuple[Step, BucketDiff, Any] | None = None
            for i, step in enumerate(mine):
                n, word = step.bucket.nbytes, step.word_bytes
                tally["words"] += n // word
                t0 = time.perf_counter()
                if delta.patches and step.ordinal in bases.calm and n // word < 2**31:
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
                    else:
                        self._pack_into(bases.images[step.ordinal], step, pieces, stable, stats)
                        bases.sums[step.ordinal] = None
                        frame = Frame(DENSE, n, None, bases.images[step.ordinal][:n], n // word)
                    send(step, frame)
                if delta.patches:
                    stats.extra["encode_s"] = stats.extra.get("encode_s", 0.0) + time.perf_counter() - t0
            if pending is not None:
                t0 = time.perf_counter()
                send(pending[0], finish(pending))
                stats.extra["encode_s"] = stats.extra.get("encode_s", 0.0) + time.perf_counter() - t0
            if next(it, None) is not None:
                raise SourceMismatch("the weight source yielded more tensors than its metadata lists")
            link.drain(works, "delta payloads")
            bases.sync_id = delta.new_id
        except BaseException:
            works.clear()
            self.t.abort()
            state.bases.sync_id = None
            raise
        finally:
            keep.clear()
        words = tally["words"]
        stats.extra.update(
            wire_bytes=float(tally["wire"]), table_bytes=float(24 * len(mine)), dense_bytes=float(sum(s.bucket.nbytes for s in mine)),
            patch_buckets=float(tally["patches"]), direct_buckets=float(tally["direct"]), changed_fraction=tally["changed"] / words if words else 0.0,
            base_bytes=float(bases.nbytes),
        )
        if delta.patches:
            stats.extra.update(host)
        stats.total_s = time.perf_counter() - t_start
        self.last_stats = dict(stats.extra)
        return stats

    def _pack_into(self, target: torch.Tensor, step: Step, pieces: PieceReader, stable: bool, stats: SendStats) -> None:
        """Copy the bucket's pieces into `target` (the base image, or the scratch buffer)."""
        dsts, srcs = [], []
        for e in step.bucket.entries:
            dst = entry_view(target, e)
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

    def _start_diff(self, bases: Bases, step: Step, pieces: PieceReader, parity: int, stable: bool) -> tuple[BucketDiff, Any]:
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
        buffers = self.t.buffers
        half = buffers[1].numel() // 16 * 8
        region = buffers[1][half * (parity % 2) :][:half]
        diff = BucketDiff(region, n, word, self._scatter_below(n, word))
        dtype = word_dtype(word)
        image_words = image.view(dtype)
        cache = bases.tables.setdefault(key, {})
        entries = step.bucket.entries
        run = cache.get("run") if stable and diff.fused else None
        reused = False
        rows: list[Row] = []
        owned: list[tuple[int, torch.Tensor, Row]] = []  # (entry index, tensor, row) of the source's own whole tensors
        i = 0
        while i < len(entries):
            if run is not None and i == run.lo and pieces.same_as_last(entries[run.lo : run.hi], run.seen):
                rows.extend(run.rows)  # the very tensors of last time, where they were: no walk
                i, reused = run.hi, True
                continue
            e = entries[i]
            src, own = pieces.source(e)
            kept = stable and own  # a converted shard is a temporary, freed at the next tensor
            if e.is_whole and not own:
                converted = entry_view(buffers[0], e)
                converted.copy_(src)
                src, kept = converted, True
            first = e.bucket_offset // word
            if kept and diff.fused:  # no views: the table needs only where the words are
                rows.append((src.data_ptr(), e.chunk_size // word, first))
                if own and e.is_whole:
                    owned.append((i, src, rows[-1]))
            else:
                new = (flat_bytes(src) if e.is_whole else src).view(dtype)
                diff.add(new, image_words[first : first + new.numel()], first)
            i += 1
        if not reused:
            cache["run"] = _longest_run(owned) if stable and diff.fused else None
        if rows:
            diff.add_pieces(rows, image_words, cache)
        return diff, diff.seal()

    def _finish_diff(self, bases: Bases, step: Step, diff: BucketDiff, event: Any, host: dict[str, float]) -> Frame:
        """The frame of a queued diff; a bucket with more changed words than a scatter patch may
        carry goes dense and is encoded by the codec next time."""
        key, n, word = step.ordinal, step.bucket.nbytes, step.word_bytes
        if event is not None:
            t0 = time.perf_counter()
            self.t.wait_event(event, f"the diff of bucket {step.bucket.index}")
            host["host_wait_s"] += time.perf_counter() - t0
        size, delta_sum, num_changed = diff.finish()
        if num_changed > diff.cap * _margins(diff.scatter_below)[1]:  # near the limit: the codec next time (it never overflows)
            bases.calm.discard(key)
        return _frame_of(bases, key, n, word, size, delta_sum, num_changed, diff.out)

    def _encode_packed(self, bases: Bases, step: Step, pieces: PieceReader, stable: bool, stats: SendStats) -> Frame:
        """A bucket that changed a lot last time (or has no history): pack it and let the codec
        diff the packed image (dense when its patch would not be smaller); the diff straight from
        the source takes over once the changed words fit a scatter patch (`delta_scatter_below`).
        Padding between entries is zeroed, so it never differs from the base (in-place receivers
        hold no padding)."""
        key, n, word = step.ordinal, step.bucket.nbytes, step.word_bytes
        image = bases.images[key][:n]
        if bases.sums.get(key) is None:
            bases.sums[key] = codec.checksum(image, word)
        scratch, out = self.t.buffers[0][:n], self.t.buffers[1]
        scratch.zero_()
        self._pack_into(scratch, step, pieces, stable, stats)
        size = codec.encode_into_base(image, scratch, word, out)  # the image becomes `new` either way
        num_changed, delta_sum = header_fields(out[:size]) if size is not None else (n // word, 0)
        below = self._scatter_below(n, word)
        if size is not None and num_changed <= capacity(n, word, below) * _margins(below)[0]:
            bases.calm.add(key)
        return _frame_of(bases, key, n, word, size, delta_sum, num_changed, out)

    def _scatter_below(self, n: int, word: int) -> float:
        """`delta_scatter_below`, lowered so that a bucket of `n` bytes fits half the second buffer
        (two buckets' patches are in flight at once)."""
        half = self.t.buffers[1].numel() // 16 * 8
        fit = max(0, half - 64) // (4 + word) / max(1, n // word)
        return max(min(self.scatter_below, fit), 1e-9)

    def _frame_header(
        self, kind: int, size: int, seal: int, checksum: torch.Tensor | None, payload: torch.Tensor
    ) -> torch.Tensor:
        """(kind, bytes, checksum, the patch's own 32-byte header, the seal of kind and bytes:
        `frame_seal`) of one bucket, one int64 row (FRAME_WORDS) on the transport's device,
        written without a host sync (which would wait for the queued diff kernels). The patch
        header rides along so that a receiver decodes the patch without reading its payload back:
        it never waits on the host for a payload."""
        header = torch.empty((1, FRAME_WORDS), dtype=torch.int64, device=self.t.device)
        put_int64s_(header[0], [kind, size] + [0] * (SEAL_WORD - 2) + [seal])
        if checksum is not None:
            header[0, 2].copy_(checksum.reshape(()))
        if kind == PATCH and payload.numel() >= PATCH_HEADER_BYTES:
            header[0, 3:SEAL_WORD].copy_(payload[:PATCH_HEADER_BYTES].view(torch.int64))
        return header


class _Run(NamedTuple):
    """The longest stretch of a bucket's entries that were the source's own whole tensors at the
    last sync: entries[lo:hi], the tensors as `PieceReader.remember` keeps them, and their rows of
    the one-launch diff. A 30B MoE bucket is hundreds of expert tensors, and walking them one by
    one cost more host time than the bucket's diff kernel; a bucket's first and last entries are
    often pieces of tensors split over two buckets, so the stretch, not the bucket, is kept."""

    lo: int
    hi: int
    seen: Seen
    rows: list[Row]


def _longest_run(owned: list[tuple[int, torch.Tensor, Row]]) -> _Run | None:
    """The longest stretch of consecutive entry indices in `owned` (None under two entries)."""
    best: tuple[int, int] = (0, 0)
    lo = 0
    for k in range(1, len(owned) + 1):
        if k == len(owned) or owned[k][0] != owned[k - 1][0] + 1:
            if k - lo > best[1] - best[0]:
                best = (lo, k)
            lo = k
    a, b = best
    if b - a < 2:
        return None
    return _Run(owned[a][0], owned[b - 1][0] + 1, PieceReader.remember([t for _i, t, _r in owned[a:b]]), [r for _i, _t, r in owned[a:b]])


def _margins(below: float) -> tuple[float, float]:
    """(join, leave) fractions of a scatter patch's capacity under limit `below` (see _JOIN_AT)."""
    return (_JOIN_AT, _LEAVE_AT) if below > SCATTER_BELOW else (1.0, 1.0)


def _frame_of(bases: Bases, key: int, n: int, word: int, size: int | None, delta_sum: Any, num_changed: int, out: torch.Tensor) -> Frame:
    if size is None:
        bases.sums[key] = None
        return Frame(DENSE, n, None, bases.images[key][:n], n // word)
    result = bases.sums[key] + delta_sum
    bases.sums[key] = result
    return Frame(PATCH, size, result, out[:size].clone(), num_changed)


def _exactly(payload: torch.Tensor, size: int) -> torch.Tensor:
    """`payload` as exactly `size` bytes (what the frame header announced and every receiver will
    post): cut, or padded with zeros. Only a tampered header makes them differ; the receivers'
    checks then fail the sync instead of the collective tearing on mismatched sizes."""
    size = max(0, size)
    if payload.numel() == size:
        return payload
    if payload.numel() > size:
        return payload[:size]
    out = torch.zeros(size, dtype=torch.uint8, device=payload.device)
    out[: payload.numel()].copy_(payload)
    return out
