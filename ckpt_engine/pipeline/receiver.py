"""The receiver of one sync: post each sender's buckets, check each as it lands, hand it to the loader.

Each sender's next bucket is posted into the slot a consumed bucket frees, so every sender's stream
stays `num_buffers` deep. With streams, buckets are consumed in manifest order; on host work with
several senders, whichever sender's next bucket landed first is consumed first
(`receive_order.py`). A tensor is yielded when its last byte has landed, whichever senders its
chunks came from; a delta sync yields only once every frame is verified (`delta_receive.py`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ckpt_engine.checksum import bucket_checksum
from ckpt_engine.delta.request import DeltaRequest
from ckpt_engine.manifest import Bucket, BucketManifest, TensorMeta
from ckpt_engine.pipeline.assembly import assembly_of, chunk_landed
from ckpt_engine.pipeline.copy_plan import BucketReceive, ReceivePlan, coalesce, optional_layout
from ckpt_engine.pipeline.delta_receive import DeltaReceiver
from ckpt_engine.pipeline.options import PipelineOptions
from ckpt_engine.pipeline.plan_state import PlanState
from ckpt_engine.pipeline.receive_order import ReadyFirst
from ckpt_engine.pipeline.schedule import Schedule
from ckpt_engine.pipeline.shared_sources import SharedSources
from ckpt_engine.delta.layout import align8
from ckpt_engine.pipeline.wire_views import flat_bytes, has_wire_layout, message
from ckpt_engine.sources.wire import torch_dtype
from ckpt_engine.staged import StagedVersion
from ckpt_engine.engine import TransferError
from ckpt_engine.transports.transport import Transport

__all__ = ["Receiver"]


class Receiver:
    """A receiver rank's side of every sync."""

    def __init__(self, transport: Transport, options: PipelineOptions) -> None:
        self.t = transport
        self.opts = options
        self.delta = DeltaReceiver(transport, options)
        sharing = transport.source_sharing
        self.shared = SharedSources(transport, sharing) if sharing is not None else None
        """The one-copy path where this receiver maps a stable sender's own tensors."""
        self.receive_plan_builds = 0
        """How many receive plans this receiver has made (tests check reuse and rebuilds)."""

    def receive(
        self, state: PlanState, manifest: BucketManifest, destinations: Mapping[str, torch.Tensor] | None, delta: DeltaRequest | None,
        repeatable: bool = False,
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """One sync (see CheckpointEngine.receive_buckets)."""
        if delta is not None:
            yield from self.delta.receive(state, manifest, destinations, delta)
            return
        state.drop_delta()  # a sync outside delta framing: the bases are stale; free their memory
        t, opts, device = self.t, self.opts, self.t.device
        t.begin_receive()
        if self.shared is not None and (yield from self.shared.receive(state, manifest, destinations, repeatable)):
            return
        sched = state.schedule
        views = state.bucket_views(manifest, t.buffers, opts.bucket_size_bytes, False)
        steps = sched.steps
        works: list[Any] = [None] * len(steps)
        plan = self._receive_plan_for(state, manifest, views, destinations)
        remaining = dict(plan.chunk_bytes)
        # Per bucket, entries received outside the buffer: index -> the loader's destination, or
        # None for a chunk received straight into its reassembly tensor.
        landed: dict[int, dict[int, torch.Tensor | None]] = {}

        def destination(e: TensorMeta) -> torch.Tensor | None:
            dest = destinations.get(e.name) if destinations is not None else None
            return dest if dest is not None and has_wire_layout(dest, e, device) else None

        def post(k: int) -> Any:
            step = steps[k]
            bucket, slot, gid = step.bucket, step.slot, step.bucket.sender  # each sender streams over its own group
            e = bucket.entries[0] if bucket.entries else None
            if opts.is_direct(bucket, t):
                assert e is not None
                landed[k] = {0: None}
                return t.post(gid, slot, assembly_of(state, e, destinations, device)[e.chunk_offset : e.chunk_offset + e.chunk_size])
            if e is not None and opts.is_direct_whole(bucket, t) and (dest := destination(e)) is not None:
                landed[k] = {0: dest}  # alone in its bucket: lands in the loader's own tensor
                return t.post(gid, slot, flat_bytes(dest))
            if opts.is_grouped(bucket, t):
                land: dict[int, torch.Tensor | None] = {}
                targets: list[torch.Tensor] = []
                for i, (m, view) in enumerate(zip(bucket.entries, views[k])):
                    if m.chunk_size == 0:
                        continue
                    if not m.is_whole:
                        land[i] = None
                        targets.append(assembly_of(state, m, destinations, device)[m.chunk_offset : m.chunk_offset + m.chunk_size])
                    elif (dest := destination(m)) is not None:
                        land[i] = dest
                        targets.append(flat_bytes(dest))
                    else:
                        targets.append(flat_bytes(view))
                landed[k] = land
                return t.post_group(gid, slot, targets)
            nbytes = plan.nbytes.get(k)
            if nbytes is None:
                nbytes = plan.nbytes[k] = bucket.nbytes  # a property summing every entry: once per plan
            return t.post(gid, slot, message(t.slot(slot), nbytes, opts.verify))

        try:
            for k in sched.first_posts:
                works[k] = post(k)
            for k in self._consume_order(sched, works):
                step = steps[k]
                bucket, slot = step.bucket, step.slot
                label = str(k) if t.num_senders == 1 else f"{k} from sender {bucket.sender}"
                t.finish(k, bucket.sender, slot, works[k], label)
                works[k] = None
                land = landed.pop(k, {})
                if opts.verify:
                    self._check_bucket(k, message(t.slot(slot), plan.nbytes[k], True), plan.nbytes[k])
                if land:
                    out: list[tuple[str, torch.Tensor]] = []
                    for i, (e, view) in enumerate(zip(bucket.entries, views[k])):
                        if e.is_whole:
                            dest = land.get(i)
                            out.append((e.name, dest if dest is not None else view))
                            continue
                        done = chunk_landed(state, e, None if i in land else view, remaining, destinations, device)
                        if done is not None:
                            out.append((e.name, done))
                else:  # read from the buffer: the plan's copies, no Python per tensor
                    out = self._replay_bucket(state, plan, k, bucket, views[k], remaining, destinations)
                yield out
                # The loader has issued its copies of bucket k: the slot may be refilled.
                t.release(slot)
                if step.refill is not None:
                    works[step.refill] = post(step.refill)
            t.end_receive()
        except BaseException:
            works.clear()  # pending work handles keep the group (and its sockets) alive
            t.abort()
            state.bases.sync_id = None
            raise
        t.wait_compute("loading the last bucket")

    def receive_staged(
        self, state: PlanState, manifest: BucketManifest, destinations: Mapping[str, torch.Tensor] | None, delta: DeltaRequest
    ) -> StagedVersion:
        """A patch sync, staged (see CheckpointEngine.receive_staged)."""
        return self.delta.receive_staged(state, manifest, destinations, delta)

    def _receive_plan_for(
        self, state: PlanState, manifest: BucketManifest, views: list[list[torch.Tensor]], destinations: Mapping[str, torch.Tensor] | None
    ) -> ReceivePlan:
        """This sync's receive plan: the last one while it matches (see `ReceivePlan.matches`; the
        destinations checked are those of chunked tensors, the only ones a packed bucket's plan
        writes to), else a new one whose buckets fill in as they are consumed."""
        chunked = state.chunked_entries(manifest)
        anchors: list[torch.Tensor | None] = []
        for e in chunked:
            dest = destinations.get(e.name) if destinations is not None else None
            anchors.append(dest if dest is not None and has_wire_layout(dest, e, self.t.device) else None)
        plan = state.recv_plan
        if plan is None or not plan.matches(manifest.digest, views, state.assembly, anchors):
            plan = state.recv_plan = ReceivePlan(manifest.digest, views, state.assembly, anchors, optional_layout(anchors))
            plan.chunk_bytes = {e.name: e.nbytes for e in chunked}
            self.receive_plan_builds += 1
        return plan

    def _replay_bucket(
        self, state: PlanState, plan: ReceivePlan, k: int, bucket: Bucket, views: list[torch.Tensor], remaining: dict[str, int],
        destinations: Mapping[str, torch.Tensor] | None,
    ) -> list[tuple[str, torch.Tensor]]:
        """Bucket k, read from its buffer: its whole tensors, and every tensor whose last chunk it
        brings (chunks copied into their reassembly tensors in one batched copy)."""
        rb = plan.buckets.get(k)
        if rb is None:
            whole: list[tuple[str, torch.Tensor]] = []
            dsts: list[torch.Tensor] = []
            srcs: list[torch.Tensor] = []
            chunks: list[tuple[str, int, torch.Tensor]] = []
            for e, view in zip(bucket.entries, views):
                if e.is_whole:
                    whole.append((e.name, view))
                    continue
                asm = assembly_of(state, e, destinations, self.t.device)
                dsts.append(asm[e.chunk_offset : e.chunk_offset + e.chunk_size])
                srcs.append(view)
                chunks.append((e.name, e.chunk_size, asm.view(torch_dtype(e.dtype)).view(e.shape)))
            rb = plan.buckets[k] = BucketReceive(whole, *coalesce(dsts, srcs), chunks)
        if rb.chunk_dsts:
            torch._foreach_copy_(rb.chunk_dsts, rb.chunk_srcs)
        out = list(rb.whole)
        for name, size, full in rb.chunks:
            remaining[name] -= size
            if remaining[name] == 0:
                out.append((name, full))
        return out

    def _consume_order(self, sched: Schedule, works: list[Any]) -> Iterator[int]:
        """Manifest indices in the order the receive loop consumes them, drawn lazily (each after
        the previous bucket's refill is posted). Manifest order with one sender or on streams;
        otherwise the first landed head of any sender, within `timeout_s` each."""
        if self.t.uses_streams or sched.num_senders == 1:
            yield from range(len(sched.steps))
            return
        heads = ReadyFirst(sched.by_sender)
        while heads:
            k = heads.next_ready(lambda i: self.t.landed(works[i]), self.opts.timeout_s)
            if k is None:
                waiting = ", ".join(f"{i} from sender {sched.steps[i].bucket.sender}" for i in heads.heads())
                k = heads.heads()[0]
                self.t.broken = True
                raise TransferError(
                    f"rank {self.t.rank}: bucket {k} from sender {sched.steps[k].bucket.sender} failed: "
                    f"no sender's next bucket ({waiting}) arrived within {self.opts.timeout_s}s"
                )
            yield k

    def _check_bucket(self, k: int, msg: torch.Tensor, nbytes: int) -> None:
        data = msg[: align8(nbytes)]
        expected = msg[data.numel() :].view(torch.int64).tolist()
        actual = bucket_checksum(data).tolist()
        if expected != actual:
            self.t.broken = True
            raise TransferError(f"rank {self.t.rank}: bucket {k} failed its checksum (sent {expected}, received {actual})")
