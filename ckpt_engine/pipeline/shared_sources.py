"""A sync whose receiver copies straight out of a stable sender's own tensors: one copy per byte.

Where the transport lets a receiver map the sender's memory (`SourceSharing`), a stable sender
walks its source once per sync, checks every tensor against the manifest and offers them all
(handles travel only when the tensors moved). The receiver yields views of them bucket by bucket
for the loader to copy from, then says the copies are done; only then does `send_weights` return.
A source that is not stable, or a tensor that cannot be mapped where it lies, sends the sync
through the slots instead.
"""

from __future__ import annotations

import itertools
import operator
import time
from collections.abc import Generator, Iterable, Iterator, Mapping

import torch

from ckpt_engine.copies import copy_large_alone_
from ckpt_engine.manifest import BucketManifest, TensorMeta
from ckpt_engine.pipeline.piece_reader import take_known
from ckpt_engine.pipeline.plan_state import PlanState, SharedBucket, SharedPlan, SharedWalk
from ckpt_engine.pipeline.wire_views import SourceMismatch, has_wire_layout
from ckpt_engine.sources.wire import torch_dtype
from ckpt_engine.engine import SendStats, TransferError
from ckpt_engine.transports.shared_tensors import placement
from ckpt_engine.transports.transport import SourceSharing, Transport

__all__ = ["SharedSources"]

_NAME = operator.itemgetter(0)
_TENSOR = operator.itemgetter(1)


def _firsts(manifest: BucketManifest) -> list[list[TensorMeta]]:
    """Per bucket, the entries that start a tensor (a tensor in chunks is handled once, whole)."""
    return [[e for e in b.entries if e.chunk_offset == 0] for b in manifest.buckets]


class SharedSources:
    """Both ends of the one-copy sync over a transport's `SourceSharing`."""

    def __init__(self, transport: Transport, sharing: SourceSharing) -> None:
        self.t = transport
        self.sharing = sharing

    # --- sender ----------------------------------------------------------------------------------
    def send(
        self, state: PlanState, manifest: BucketManifest, weights: Iterable[tuple[str, torch.Tensor]], stable: bool
    ) -> tuple[SendStats | None, Iterable[tuple[str, torch.Tensor]]]:
        """Offer this sync's tensors and wait until the receiver has copied them: (stats, ()).
        Where they cannot be offered: (None, the weights for the slotted path), the receiver told.
        A walk whose tensors lie where and as the last one's did is checked in a few C-level passes
        and offers the same list again (`SharedWalk`)."""
        if not stable:
            self.sharing.offer(None)
            return None, weights
        t_start = time.perf_counter()
        assert self.t.rank is not None
        _, stats = state.own_steps(self.t.rank)
        it = iter(weights)
        last, state.shared_walk = state.shared_walk, None
        if last is not None:
            # The last walk's tensors offered before this walk is read: the receiver's copies start
            # while it is checked (the old tensors stay held by `last` until the receiver is done).
            self.sharing.offer(last.offered, last.placement if last.all_offered else None, provisional=True)
            self.sharing.wait_looked()
            try:
                items = list(it)
                placed = placement(list(map(_TENSOR, items))) if list(map(_NAME, items)) == last.names else None
            except BaseException as exc:
                self.sharing.judge(False, f"the weight source failed: {type(exc).__name__}: {exc}"[:2000])
                raise
            stands = placed is not None and placed == last.placement
            self.sharing.judge(stands)
            if stands:
                stats.export_s = time.perf_counter() - t_start
                stats = self._wait(stats, t_start)
                state.shared_walk = last  # kept only past an offer the receiver took: the transport then holds its memory
                stats.extra["walk_replayed"] = True
                return stats, ()
            it = iter(items)
        try:
            walked, offered = self._walk(state, manifest, it)
        except BaseException:  # the receiver waits for this sync's offer: it is told at once
            self.t.abort()
            raise
        if offered is None:
            self.sharing.offer(None)
            return None, itertools.chain(walked, it)
        stats = self._offer(stats, offered, t_start)
        # read after the offer: sharing a host tensor may have moved it into shared memory
        state.shared_walk = SharedWalk(list(map(_NAME, walked)), placement(list(map(_TENSOR, walked))), offered, len(offered) == len(walked))
        return stats, ()

    def _walk(
        self, state: PlanState, manifest: BucketManifest, it: Iterator[tuple[str, torch.Tensor]]
    ) -> tuple[list[tuple[str, torch.Tensor]], list[torch.Tensor] | None]:
        """Walk the source against the manifest: (what was walked, the tensors to offer), or None to
        offer where a tensor cannot be shared (the rest of `it` then goes through the slots)."""
        walked: list[tuple[str, torch.Tensor]] = []
        offered: list[torch.Tensor] = []
        known = state.known
        for entries in _firsts(manifest):
            for e in entries:
                name, t, own = take_known(
                    it, e, known, lambda t: has_wire_layout(t, e, self.t.device) and (e.nbytes == 0 or self.sharing.can_share(t))
                )
                walked.append((name, t))
                if not own:
                    return walked, None
                if e.nbytes:
                    offered.append(t)
        if next(it, None) is not None:
            raise SourceMismatch("the weight source yielded more tensors than its metadata lists")
        return walked, offered

    def _offer(self, stats: SendStats, offered: list[torch.Tensor], t_start: float) -> SendStats:
        """Offer the walked tensors and wait until the receiver has copied them."""
        stats.export_s = time.perf_counter() - t_start
        try:
            self.sharing.offer(offered)
        except BaseException:
            self.t.abort()
            raise
        return self._wait(stats, t_start)

    def _wait(self, stats: SendStats, t_start: float) -> SendStats:
        """Wait until the receiver has copied what was offered."""
        try:
            self.sharing.wait_taken()
        except BaseException:
            self.t.abort()
            raise
        stats.total_s = time.perf_counter() - t_start
        stats.extra["one_copy"] = True
        return stats

    # --- receiver --------------------------------------------------------------------------------
    def receive(
        self, state: PlanState, manifest: BucketManifest, destinations: Mapping[str, torch.Tensor] | None, repeatable: bool,
    ) -> Generator[list[tuple[str, torch.Tensor]], None, bool]:
        """Yield every bucket's tensors out of the sender's memory; then tell the sender. Returns False
        where the sender offered nothing (the sync goes through the slots).

        A provisional offer (`SourceSharing.offer`) is copied at once where the caller's loads may be
        `repeatable` (each lands whole where the same name's load would: a load into the live
        tensors), and its buckets are yielded again from the sender's own offer if its walk moved;
        else nothing is yielded before the sender's verdict."""
        try:
            offered, provisional = self.sharing.take()
            if offered is not None and provisional:
                if repeatable:
                    yield from self._buckets(state, manifest, offered, destinations)
                    if self.sharing.verdict():
                        self.sharing.taken()
                        return True
                    self.t.device_sync_point()  # the copies out of the moved tensors are done before their mappings go
                elif self.sharing.verdict():
                    yield from self._buckets(state, manifest, offered, destinations)
                    self.sharing.taken()
                    return True
                offered, _ = self.sharing.take()  # the sender's own offer of this sync's walk
            if offered is None:
                return False
            yield from self._buckets(state, manifest, offered, destinations)
        except BaseException as exc:
            self._fail(exc)
            raise
        self.sharing.taken()
        return True

    def _buckets(
        self, state: PlanState, manifest: BucketManifest, offered: list[torch.Tensor], destinations: Mapping[str, torch.Tensor] | None,
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        plan = state.shared_plan
        if plan is None or plan.offered is not offered:
            plan = state.shared_plan = self._plan(manifest, offered)
        for bucket in plan.buckets:
            yield self._copy_into(bucket, destinations) if destinations is not None else bucket

    def _fail(self, exc: BaseException) -> None:
        """Tell the sender (it stops waiting at once) and break the group, as a failed receive does."""
        try:
            self.sharing.taken(f"rank {self.t.rank}: {type(exc).__name__}: {exc}"[:2000])
        except Exception:  # the store itself may be gone; the sender then times out
            pass
        self.t.abort()

    def _plan(self, manifest: BucketManifest, offered: list[torch.Tensor]) -> SharedPlan:
        """Check the mapped tensors against the manifest (once per plan and offer)."""
        firsts = _firsts(manifest)
        expected = sum(1 for entries in firsts for e in entries if e.nbytes)
        if len(offered) != expected:
            raise TransferError(f"rank {self.t.rank}: the sender offered {len(offered)} tensors, the manifest has {expected} with bytes")
        src = iter(offered)
        buckets: list[SharedBucket] = []
        for entries in firsts:
            out = SharedBucket()
            for e in entries:
                dtype = torch_dtype(e.dtype)
                if e.nbytes == 0:
                    out.append((e.name, torch.empty(e.shape, dtype=dtype, device=self.t.device)))
                    continue
                t = next(src)
                if t.dtype != dtype or tuple(t.shape) != e.shape or not t.is_contiguous():
                    raise TransferError(
                        f"rank {self.t.rank}: the sender offered {e.name} as {t.dtype} {tuple(t.shape)}, the manifest says {e.dtype} {e.shape}"
                    )
                out.append((e.name, t))
            buckets.append(out)
        return SharedPlan(offered, buckets)

    def _copy_into(self, bucket: list[tuple[str, torch.Tensor]], destinations: Mapping[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        """Copy each tensor with a wire-layout destination there (the destination is yielded, and the
        loader's copy onto itself is skipped); the others are yielded as the sender's views."""
        out: list[tuple[str, torch.Tensor]] = []
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        for name, src in bucket:
            dest = destinations.get(name)
            if dest is None or not dest.is_contiguous() or dest.device != src.device or dest.dtype != src.dtype or dest.shape != src.shape:
                out.append((name, src))
                continue
            dsts.append(dest)
            srcs.append(src)
            out.append((name, dest))
        copy_large_alone_(dsts, srcs)
        return out
