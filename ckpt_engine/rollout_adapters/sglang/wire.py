"""The sender of SGLang's own weight wire, as a transport of the weight-sync session.

SGLang receives weights only in its own format: the trainer is rank 0 of a plain torch.distributed
group that the servers join through `/init_weights_update_group`, and every
`/update_weights_from_distributed` request (names, dtypes, shapes) is matched by broadcasts from
rank 0: with `flattened` (SGLang's `load_format="flattened_bucket"`) one per bucket, the tensors'
bytes concatenated without padding as its `FlattenedTensorBucket` lays them out; else one per
tensor. Our pipelined bucket wire (aligned offsets, chunked tensors, checksums) is not something
SGLang can read, so this transport plans whole tensors in buckets of `bucket_size_bytes` (a larger
tensor travels alone) and packs bucket k+1 while the servers load bucket k. The `SglangRollout`
adapters post the matching requests (`sglang.py`); the session drives both like any other sync.
While a broadcast waits, the sender watches what the adapters saw fail (`sglang/failures.py`): a
server that dies or fails mid-stream stops the sync at once, by name, not after `timeout_s`.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from ckpt_engine.delta.request import DeltaRequest
from ckpt_engine.manifest import Bucket, BucketManifest, TensorMeta, TensorSpec, dtype_itemsize, make_manifest
from ckpt_engine.planning.ownership import OwnerMap
from ckpt_engine.rollout_adapters.sglang import failures
from ckpt_engine.rollout_adapters.sglang.rollout import custom_process_group, group_name_of
from ckpt_engine.engine import CheckpointEngine, Rendezvous, SendStats

__all__ = ["SglangWireEngine", "plan_flat_buckets"]

logger = logging.getLogger(__name__)


def plan_flat_buckets(specs: Sequence[TensorSpec], bucket_size_bytes: int) -> list[list[TensorSpec]]:
    """Whole tensors in order, grouped up to `bucket_size_bytes`; a larger tensor goes alone."""
    buckets: list[list[TensorSpec]] = []
    current: list[TensorSpec] = []
    size = 0
    for spec in specs:
        if current and size + spec.nbytes > bucket_size_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(spec)
        size += spec.nbytes
    if current:
        buckets.append(current)
    return buckets


def _flat_manifest(specs: Sequence[TensorSpec], bucket_size_bytes: int) -> BucketManifest:
    """`plan_flat_buckets` as a manifest. Its offsets only place each tensor for validation (each
    aligned for its dtype); on the wire a bucket's tensors are concatenated without padding."""
    buckets, largest = [], bucket_size_bytes
    for i, group in enumerate(plan_flat_buckets(specs, bucket_size_bytes)):
        metas, offset = [], 0
        for s in group:
            item = dtype_itemsize(s.dtype)
            offset = -(-offset // item) * item
            metas.append(TensorMeta(s.name, s.dtype, s.shape, 0, s.nbytes, offset))
            offset += s.nbytes
        largest = max(largest, offset)
        buckets.append(Bucket(i, tuple(metas)))
    return make_manifest(tuple(buckets), largest, 1)


class SglangWireEngine(CheckpointEngine):
    """Rank 0 of an SGLang weight-update group (registered as the `sglang` transport); sender only.

    `flattened` picks the wire: one broadcast per bucket (SGLang's `flattened_bucket`) or one per
    tensor; it travels to the adapters in the join options."""

    def __init__(
        self, *, bucket_size_bytes: int, num_buffers: int = 2, timeout_s: float = 300.0, verify: bool = False,
        flattened: bool = True,
    ) -> None:
        super().__init__(bucket_size_bytes=bucket_size_bytes, num_buffers=num_buffers, timeout_s=timeout_s, verify=verify)
        if not isinstance(flattened, bool):
            raise ValueError(f"flattened must be a bool, got {flattened!r}")
        self.flattened = flattened
        self._group: Any = None
        self._group_name = ""

    def prepare(self) -> dict[str, Any]:
        return {"device": "cpu", "bytes": 0}

    def plan(self, specs: Sequence[TensorSpec], *, num_senders: int = 1, owners: OwnerMap | None = None) -> BucketManifest:
        if num_senders != 1:
            raise ValueError(f"SGLang's wire has one sender, got {num_senders}")
        return _flat_manifest(specs, self.bucket_size_bytes)

    def init_process_group(self, rendezvous: Rendezvous, rank: int) -> None:
        """Join the group the servers join through `/init_weights_update_group`, as rank 0, then
        the probe broadcast every member makes once the group stands."""
        if rank != 0:
            raise ValueError(f"the SGLang wire's sender is rank 0, got {rank}")
        timeout = datetime.timedelta(seconds=rendezvous.timeout_s)
        store = torch.distributed.TCPStore(
            rendezvous.host, rendezvous.port, rendezvous.world_size, is_master=False, timeout=timeout, wait_for_workers=False
        )
        _, group = custom_process_group(
            rendezvous.host, rendezvous.port, 0, rendezvous.world_size, group_name_of(rendezvous), "gloo",
            rendezvous.timeout_s, store=store,
        )
        group.broadcast(torch.zeros(1), 0).wait(timeout)
        self._group, self._group_name = group, group_name_of(rendezvous)
        failures.clear(self._group_name)
        self.rank, self.world_size = 0, rendezvous.world_size

    def send_weights(
        self, manifest: BucketManifest, weights: Iterable[tuple[str, torch.Tensor]], *, stable: bool = False,
        delta: DeltaRequest | None = None,
    ) -> SendStats:
        """Per bucket: cast and pack its tensors, then broadcast them (each broadcast waits for the
        servers, whose adapters post the bucket's request once the previous one loaded)."""
        if self._group is None:
            raise RuntimeError("call init_process_group() first")
        if delta is not None:
            raise ValueError("SGLang takes no patches")
        t0 = time.perf_counter()
        it = iter(weights)
        stats = SendStats()
        broadcasts = 0
        for bucket in manifest.buckets:
            t = time.perf_counter()
            tensors = []
            for e in bucket.entries:
                name, tensor = next(it)
                if name != e.name:
                    raise ValueError(f"the weight source yielded {name!r} where its metadata put {e.name!r}")
                tensors.append(tensor.detach().to(torch.device("cpu"), getattr(torch, e.dtype)).contiguous())
            payloads = [torch.cat([x.reshape(-1).view(torch.uint8) for x in tensors])] if self.flattened else tensors
            stats.pack_s += time.perf_counter() - t
            for payload in payloads:
                self._wait(self._group.broadcast(payload, 0), bucket.index)
                broadcasts += 1
            stats.buckets += 1
            stats.tensors += len(tensors)
            stats.bytes += sum(e.chunk_size for e in bucket.entries)
        stats.total_s = time.perf_counter() - t0
        stats.extra["broadcasts"] = broadcasts
        return stats

    def _wait(self, work: Any, bucket: int) -> None:
        """Wait for one broadcast, at most `timeout_s`, and stop at once when an engine's request
        for it failed (the engine will never take the bytes)."""
        deadline = time.monotonic() + self.timeout_s
        pause = 1e-4
        while not work.is_completed():
            failed = failures.failures(self._group_name)
            if failed:
                self._abandon()
                detail = "; ".join(f"{name}: {why}" for name, why in sorted(failed.items()))
                raise RuntimeError(f"SGLang engine(s) {', '.join(sorted(failed))} failed while bucket {bucket} streamed: {detail}")
            if time.monotonic() > deadline:
                self._abandon()
                raise TimeoutError(f"the broadcast of bucket {bucket} to the SGLang servers did not finish within {self.timeout_s:g}s")
            time.sleep(pause)
            pause = min(2 * pause, 0.005)
        work.wait()  # the group's own error (a server's connection closed), if any

    def _abandon(self) -> None:
        """Leave a group whose broadcast is still pending, and fail the sync now.

        Aborting the group, and destroying it (its destructor joins the gloo worker still inside
        that broadcast), both block until gloo's own timeout ends the broadcast. So a daemon thread
        takes the only reference and does both: were this thread to drop the last reference (the
        abort ending first), the sync would wait out `timeout_s` after all."""
        holder, self._group = [self._group], None
        failures.clear(self._group_name)
        if holder[0] is not None:
            threading.Thread(target=_abort_and_drop, args=(holder,), name="sglang-wire-abort", daemon=True).start()

    def receive_buckets(
        self, manifest: BucketManifest, destinations: Mapping[str, torch.Tensor] | None = None, *, delta: DeltaRequest | None = None,
        repeatable: bool = False,
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        raise RuntimeError("SGLang's servers receive through their own routes; this transport only sends")

    def finalize(self) -> None:
        group, self._group = self._group, None
        failures.clear(self._group_name)
        if group is not None:
            _abort(group)


def _abort_and_drop(holder: list[Any]) -> None:
    """Abort the group in `holder` and drop the last reference to it here, on this thread."""
    group = holder.pop()
    _abort(group)
    del group  # ~ProcessGroupGloo: waits for the pending broadcast to time out, off the sync's thread


def _abort(group: Any) -> None:
    try:
        group.abort()
    except Exception as exc:
        logger.warning("abort of the SGLang weight group failed: %s", exc)
