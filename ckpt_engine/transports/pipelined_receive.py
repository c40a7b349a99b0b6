"""The receiver's loop of the pipelined broadcast (dense buckets).

Each sender's next bucket is posted into the buffer a consumed bucket frees, so every sender's
stream stays `num_buffers` deep. On accelerators buckets are consumed in manifest order (events
order the loader after each receive); on host work with several senders, whichever sender's next
bucket has landed first is consumed first (`receive_order.py`), so a slow sender does not hold
back the others' refills. A tensor is yielded when its last byte has landed, whichever senders
its chunks came from.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ckpt_engine.transports.collectives import WorkList, coalesced_broadcast
from ckpt_engine.transports.copy_plan import BucketReceive, ReceivePlan, coalesce, optional_layout
from ckpt_engine.transports.receive_order import ReadyFirst
from ckpt_engine.transports.schedule import Schedule
from ckpt_engine.transports.wire_views import align8, flat_bytes, has_wire_layout, torch_dtype
from ckpt_engine.checksum import bucket_checksum
from ckpt_engine.delta.request import DeltaRequest
from ckpt_engine.transports.base import TransferError
from ckpt_engine.manifest import BucketManifest, TensorMeta

__all__ = ["ReceiveLoopMixin"]


class ReceiveLoopMixin:
    """Mixed into PipelinedBroadcastEngine; uses its buffers, groups, streams and events."""

    _recv_plan: ReceivePlan | None = None
    _chunked: tuple[str, list[TensorMeta]] | None = None
    receive_plan_builds = 0
    """How many receive plans this engine has made (tests check reuse and rebuilds)."""

    def receive_buckets(
        self,
        manifest: BucketManifest,
        destinations: Mapping[str, torch.Tensor] | None = None,
        *,
        delta: DeltaRequest | None = None,
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        self._require_group()
        if self.is_sender:
            raise RuntimeError(f"receive_buckets() runs on receiver ranks, not on a sender (rank {self.rank})")
        if delta is not None:
            yield from self._receive_delta(manifest, destinations, delta)
            return
        self._reset_delta()  # a sync outside delta framing: the bases are stale; free their memory
        sched = self._schedule(manifest)
        views = self._bucket_views(manifest)
        steps = sched.steps
        works: list[Any] = [None] * len(steps)
        if self._assembly_digest != manifest.digest:
            self._assembly, self._assembly_digest = {}, manifest.digest
        plan = self._receive_plan_for(manifest, views, destinations)
        remaining = dict(plan.chunk_bytes)
        # Per bucket, entries received outside the buffer: index -> the loader's destination, or
        # None for a chunk received straight into its reassembly tensor.
        landed: dict[int, dict[int, torch.Tensor | None]] = {}

        def destination(e: TensorMeta) -> torch.Tensor | None:
            dest = destinations.get(e.name) if destinations is not None else None
            return dest if dest is not None and has_wire_layout(dest, e, self.device) else None

        def post(k: int) -> Any:
            step = steps[k]
            bucket, slot, gid = step.bucket, step.slot, step.gid
            e = bucket.entries[0] if bucket.entries else None
            if self._is_direct(bucket):
                assert e is not None
                landed[k] = {0: None}
                return self._post_receive(slot, self._assembly_of(e, destinations)[e.chunk_offset : e.chunk_offset + e.chunk_size], gid)
            if e is not None and self._is_direct_whole(bucket) and (dest := destination(e)) is not None:
                landed[k] = {0: dest}  # alone in its bucket: lands in the loader's own tensor
                return self._post_receive(slot, flat_bytes(dest), gid)
            if self._is_grouped(bucket):
                land: dict[int, torch.Tensor | None] = {}
                targets: list[torch.Tensor] = []
                for i, (m, view) in enumerate(zip(bucket.entries, views[k])):
                    if m.chunk_size == 0:
                        continue
                    if not m.is_whole:
                        land[i] = None
                        targets.append(self._assembly_of(m, destinations)[m.chunk_offset : m.chunk_offset + m.chunk_size])
                    elif (dest := destination(m)) is not None:
                        land[i] = dest
                        targets.append(flat_bytes(dest))
                    else:
                        targets.append(flat_bytes(view))
                landed[k] = land
                return self._post_receive_group(slot, targets, gid)
            nbytes = plan.nbytes.get(k)
            if nbytes is None:
                nbytes = plan.nbytes[k] = bucket.nbytes  # a property summing every entry: once per plan
            return self._post_receive(slot, self._message(slot, nbytes), gid)

        try:
            for k in sched.first_posts:
                works[k] = post(k)
            for k in self._consume_order(sched, works):
                step = steps[k]
                bucket, slot = step.bucket, step.slot
                self._finish_receive(slot, works[k], k if self.num_senders == 1 else f"{k} from sender {bucket.sender}")
                works[k] = None
                land = landed.pop(k, {})
                if self.verify:
                    self._check_bucket(k, self._message(slot, plan.nbytes[k]), plan.nbytes[k])
                if land:
                    out: list[tuple[str, torch.Tensor]] = []
                    for i, (e, view) in enumerate(zip(bucket.entries, views[k])):
                        if e.is_whole:
                            out.append((e.name, land.get(i) if land.get(i) is not None else view))
                            continue
                        done = self._chunk_landed(e, None if i in land else view, remaining, destinations)
                        if done is not None:
                            out.append((e.name, done))
                else:  # read from the buffer: the plan's copies, no Python per tensor
                    out = self._replay_bucket(plan, k, bucket, views[k], remaining, destinations)
                yield out
                # The loader has issued its copies of bucket k: the slot may be refilled.
                if self._comm_stream is not None:
                    self._free[slot].record(self._current_stream())
                if step.refill is not None:
                    works[step.refill] = post(step.refill)
        except BaseException:
            works.clear()  # pending work handles keep the group (and its sockets) alive
            self.abort()
            raise
        if self._comm_stream is not None:
            done = self._new_event()
            done.record(self._current_stream())
            self._wait_event(done, "loading the last bucket")

    def _receive_plan_for(
        self, manifest: BucketManifest, views: list[list[torch.Tensor]], destinations: Mapping[str, torch.Tensor] | None
    ) -> ReceivePlan:
        """This sync's receive plan: the last one while it matches (see `ReceivePlan.matches`; the
        destinations checked are those of chunked tensors, the only ones a packed bucket's plan
        writes to), else a new one whose buckets fill in as they are consumed."""
        chunked = self._chunked_entries(manifest)
        anchors: list[torch.Tensor | None] = []
        for e in chunked:
            dest = destinations.get(e.name) if destinations is not None else None
            anchors.append(dest if dest is not None and has_wire_layout(dest, e, self.device) else None)
        plan = self._recv_plan
        if plan is None or not plan.matches(manifest.digest, views, self._assembly, anchors):
            plan = self._recv_plan = ReceivePlan(manifest.digest, views, self._assembly, anchors, optional_layout(anchors))
            plan.chunk_bytes = {e.name: e.nbytes for e in chunked}
            self.receive_plan_builds += 1
        return plan

    def _chunked_entries(self, manifest: BucketManifest) -> list[TensorMeta]:
        """One entry per tensor that travels in chunks (split over buckets or senders), once per plan."""
        if self._chunked is None or self._chunked[0] != manifest.digest:
            seen: dict[str, TensorMeta] = {}
            for b in manifest.buckets:
                for e in b.entries:
                    if not e.is_whole:
                        seen.setdefault(e.name, e)
            self._chunked = (manifest.digest, list(seen.values()))
        return self._chunked[1]

    def _replay_bucket(
        self, plan: ReceivePlan, k: int, bucket: Any, views: list[torch.Tensor], remaining: dict[str, int],
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
                asm = self._assembly_of(e, destinations)
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
        the previous bucket's refill is posted). Manifest order with one sender or on
        accelerators; otherwise the first landed head of any sender, within `timeout_s` each."""
        if self._comm_stream is not None or sched.num_senders == 1:
            yield from range(len(sched.steps))
            return
        heads = ReadyFirst(sched.by_sender)
        while heads:
            k = heads.next_ready(lambda i: self._step_ready(i, works[i]), self.timeout_s)
            if k is None:
                waiting = ", ".join(f"{i} from sender {sched.steps[i].bucket.sender}" for i in heads.heads())
                k = heads.heads()[0]
                self._broken = True
                raise TransferError(
                    f"rank {self.rank}: bucket {k} from sender {sched.steps[k].bucket.sender} failed: "
                    f"no sender's next bucket ({waiting}) arrived within {self.timeout_s}s"
                )
            yield k

    def _step_ready(self, k: int, work: Any) -> bool:
        """Whether bucket k's receive has finished (host work only), so `_finish_receive` will not
        block; a failed receive counts as finished and raises there."""
        return work is not None and work.is_completed()

    def _chunk_landed(
        self, e: TensorMeta, view: torch.Tensor | None, remaining: dict[str, int], destinations: Mapping[str, torch.Tensor] | None
    ) -> torch.Tensor | None:
        """A chunk of a tensor split over buckets has arrived (copied into its reassembly tensor
        from `view`, or already received there when `view` is None): the whole tensor once its
        last chunk is in, else None."""
        asm = self._assembly_of(e, destinations)
        if view is not None:
            asm[e.chunk_offset : e.chunk_offset + e.chunk_size].copy_(view)
        remaining[e.name] -= e.chunk_size
        return asm.view(torch_dtype(e.dtype)).view(e.shape) if remaining[e.name] == 0 else None

    def _assembly_of(self, e: TensorMeta, destinations: Mapping[str, torch.Tensor] | None) -> torch.Tensor:
        """Where a chunked tensor is reassembled: in its destination when the loader offers one
        with the wire layout (no extra memory, no final copy); otherwise in a reassembly tensor
        kept across syncs of one plan (a fresh host allocation of a large tensor costs a page fault
        per 4 KiB on every sync; the CUDA caching allocator would reuse it anyway)."""
        dest = destinations.get(e.name) if destinations is not None else None
        if dest is not None and has_wire_layout(dest, e, self.device):
            return flat_bytes(dest)
        asm = self._assembly.get(e.name)
        if asm is None:
            asm = self._assembly[e.name] = torch.empty(e.nbytes, dtype=torch.uint8, device=self.device)
        return asm

    def _post_receive(self, slot: int, msg: torch.Tensor, gid: int) -> Any:
        return self._broadcast_on(gid, slot, msg)

    def _post_receive_group(self, slot: int, targets: list[torch.Tensor], gid: int) -> Any:
        group = self._groups[gid]
        if self._comm_stream is None:
            return WorkList([group.broadcast(t, 0) for t in targets])
        stream = self._streams[gid]
        with self._stream_ctx(stream):
            stream.wait_event(self._free[slot])
            work = coalesced_broadcast(group, targets)
            self._ready[slot].record(stream)
        return work

    def _finish_receive(self, slot: int, work: Any, k: int | str) -> None:
        if self._comm_stream is None:
            self._wait_work(work, f"bucket {k}")
        else:
            self._current_stream().wait_event(self._ready[slot])

    def _check_bucket(self, k: int, msg: torch.Tensor, nbytes: int) -> None:
        data = msg[: align8(nbytes)]
        expected = msg[data.numel() :].view(torch.int64).tolist()
        actual = bucket_checksum(data).tolist()
        if expected != actual:
            self._broken = True
            raise TransferError(f"rank {self.rank}: bucket {k} failed its checksum (sent {expected}, received {actual})")
