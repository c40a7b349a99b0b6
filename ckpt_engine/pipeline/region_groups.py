"""Region delivery over a weight-sync group: one pipelined engine per receiver set.

Each receiver set of a `RegionLayout` (`planning/receive_sets.py`) gets a group of its own (the
senders and the set's members, the main rendezvous token suffixed by the layout digest and set
index), joined in index order at a layout's first sync, before any byte moves, and kept while
the layout stays. A sender streams each set's pieces through that set's engine, a plain pipelined
sync of virtual tensors; a receiver takes its own sets in index order. Sets that share no
receiver stream side by side (`waves`, up to `width` at once: `parallel_sets` turns a memory
budget into that width), so where each receiver's ingress is the bound every link stays busy.
With a delta request nothing reaches the loader until every set's patches checked out.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch

from ckpt_engine.delta.request import DeltaRequest
from ckpt_engine.manifest import BucketManifest
from ckpt_engine.pipeline.region_assembly import RegionAssembly, RegionItem
from ckpt_engine.planning.ownership import OwnerMap
from ckpt_engine.planning.receive_sets import Piece, ReceiverSet, cut_region
from ckpt_engine.pipeline.engine import PipelinedEngine
from ckpt_engine.engine import CheckpointEngine, Rendezvous, SendStats, TransferError
from ckpt_engine.transports.process_groups import ProcessGroupTransport

__all__ = ["DEFAULT_PARALLEL_SETS", "RegionGroups", "parallel_sets", "receive_regions", "send_regions", "waves"]

logger = logging.getLogger(__name__)

DEFAULT_PARALLEL_SETS = 8
"""Sets a sender streams at once without a memory budget (`region_slot_memory_mb` unset): each
takes its own slot memory on the sender."""


def parallel_sets(budget_bytes: int | None, num_buffers: int, bucket_size_bytes: int, num_sets: int) -> int:
    """The sets a sender streams side by side: as many as `budget_bytes` of slot memory holds
    (each set takes `num_buffers` x `bucket_size_bytes`), at least 1 (a budget below one set's
    slots streams one set at a time, what a sync without region delivery takes anyway) and at most
    `num_sets`; None: `DEFAULT_PARALLEL_SETS`.

    Every sender of a sync must use the same width (their waves must match, or two senders could
    each wait in a set the other has not reached): trainer rank 0 computes it and announces it."""
    if num_buffers < 1 or bucket_size_bytes < 1:
        raise ValueError(f"num_buffers and bucket_size_bytes must be >= 1, got {num_buffers} and {bucket_size_bytes}")
    if budget_bytes is None:
        width = DEFAULT_PARALLEL_SETS
    elif budget_bytes < 0:
        raise ValueError(f"region slot memory budget must be >= 0 bytes, got {budget_bytes}")
    else:
        width = budget_bytes // (num_buffers * bucket_size_bytes)
    return max(1, min(width, num_sets))


def waves(sets: Sequence[tuple[int, tuple[int, ...]]], width: int = DEFAULT_PARALLEL_SETS) -> list[list[int]]:
    """The sets' streaming order: waves one after another, the sets of a wave side by side.

    A set goes into the first wave after the last one holding any of its members (and with
    room), so every receiver's sets stay in index order, one per wave: a receiver taking its
    sets by index meets the senders wave by wave, whatever sets it does not see."""
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    last: dict[int, int] = {}
    out: list[list[int]] = []
    for k, members in sorted(sets):
        w = 1 + max((last.get(m, -1) for m in members), default=-1)
        while w < len(out) and len(out[w]) >= width:
            w += 1
        if w == len(out):
            out.append([])
        out[w].append(k)
        for m in members:
            last[m] = w
    return out


class RegionGroups:
    """This rank's engines of one layout's receiver sets (a sender: every set; a receiver: its own).

    `width`: the sets a sender streams side by side (`parallel_sets`; the same on every sender).
    A receiver needs none: it takes its sets one after another in index order, which is the order
    of the waves holding them at any width."""

    def __init__(
        self, rendezvous: Rendezvous, rank: int, digest: str, sets: Sequence[tuple[int, tuple[int, ...]]],
        make_engine: Callable[[], CheckpointEngine], *, width: int = DEFAULT_PARALLEL_SETS,
    ) -> None:
        self.rdzv = rendezvous
        self.width = width
        self.rank = rank
        self.digest = digest
        self.sets = dict(sets)
        self.make_engine = make_engine
        self.engines: dict[int, CheckpointEngine] = {}
        self._slots: dict[int, list[torch.Tensor]] = {}
        """Slot memory per pool, shared by the sets of a pool: a receiver's sets stream one after
        another (one pool), a sender's sets of one wave side by side (pool = place in its wave),
        each drained (and on a receiver its loader's copies waited for) before the next starts."""
        senders = rendezvous.num_senders
        self.receiver = rank - senders if rank >= senders else None
        self.mine = sorted(k for k, members in self.sets.items() if self.receiver is None or self.receiver in members)
        self.waves = waves(list(self.sets.items()), width) if self.receiver is None else [[k] for k in self.mine]
        self._pool = {k: i for wave in self.waves for i, k in enumerate(wave)}

    def join(self) -> None:
        """Join every set of this rank, in index order (collective over each set's members and the senders)."""
        senders = self.rdzv.num_senders
        for k in self.mine:
            if k in self.engines:
                continue
            members = self.sets[k]
            sub = dataclasses.replace(self.rdzv, token=f"{self.rdzv.token}/regions/{self.digest[:16]}/{k}", world_size=senders + len(members))
            engine = self.make_engine()
            shares = isinstance(engine, PipelinedEngine) and isinstance(engine.transport, ProcessGroupTransport)
            pool = self._pool.get(k, 0)
            if shares and pool in self._slots:
                engine.transport.add_slots(self._slots[pool])  # type: ignore[attr-defined]
            try:
                engine.init_process_group(sub, self.rank if self.receiver is None else senders + members.index(self.receiver))
            except BaseException:
                engine.finalize()
                raise
            if shares and pool not in self._slots:
                self._slots[pool] = list(engine.transport.buffers)  # type: ignore[attr-defined]
            self.engines[k] = engine
        logger.debug("rank %d joined %d receiver set group(s) of layout %s", self.rank, len(self.mine), self.digest[:12])

    def engine(self, k: int) -> CheckpointEngine:
        engine = self.engines.get(k)
        if engine is None:
            raise RuntimeError(f"receiver set {k} of layout {self.digest[:12]} was not joined; call join() first")
        return engine

    def abort(self) -> None:
        for engine in self.engines.values():
            engine.abort()

    def close(self) -> None:
        engines, self.engines, self._slots = self.engines, {}, {}
        for engine in engines.values():
            try:
                engine.finalize()
            except Exception as exc:  # tearing down a broken group may itself fail
                logger.warning("receiver set group teardown: %s", exc)


def _local_piece(tensor: torch.Tensor, piece: Piece, rows: tuple[int, int] | None) -> torch.Tensor:
    """This sender's part of `piece`: the piece of a whole tensor, or of its row block [r0, r1)."""
    if rows is None:
        return cut_region(tensor, piece.region)
    r0, r1 = rows
    region = piece.region
    if region is None or region.dim != 0:
        return cut_region(tensor, region)
    lo, hi = max(r0, region.start), min(r1, region.start + region.length)
    return tensor.narrow(0, lo - r0, hi - lo)


def _rows(owners: OwnerMap | None, name: str, sender: int, tensor: torch.Tensor, shape: tuple[int, ...]) -> tuple[tuple[int, int] | None, torch.Tensor]:
    """(this sender's row block of `name`, its tensor shaped as rows) or (None, the whole tensor)."""
    shards = owners.get(name) if owners is not None else None
    if shards is None:
        return None, tensor
    rows = shape[0] if shape else 1
    row_bytes = sum(s.nbytes for s in shards) // rows
    for sh in shards:
        if sh.sender == sender:
            r0, r1 = sh.start // row_bytes, sh.stop // row_bytes
            return (r0, r1), tensor.reshape(r1 - r0, *shape[1:])
    return (0, 0), tensor


def send_regions(
    groups: RegionGroups, sets: Sequence[ReceiverSet], manifests: Mapping[int, BucketManifest], tensors: Mapping[str, torch.Tensor],
    shapes: Mapping[str, tuple[int, ...]], *, owners: OwnerMap | None = None, delta: DeltaRequest | None = None,
) -> SendStats:
    """Sender: every set's pieces through its engine, wave by wave (`RegionGroups.waves`; a
    wave's sets side by side, one thread each). `tensors`: this sender's tensor of each name (the
    whole tensor, or with `owners` its dim-0 row block, any shape); `shapes`: the global shapes."""
    sender = groups.rank
    by_index = {s.index: s for s in sets}
    cuda = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

    def one(s: ReceiverSet) -> SendStats:
        if cuda is not None:
            torch.cuda.set_device(cuda)  # a wave's thread works on the caller's device
        manifest = manifests[s.index]
        by_vname = {p.spec.name: p for p in s.pieces}

        def walk() -> Iterator[tuple[str, torch.Tensor]]:
            last = None
            for e in (e for b in manifest.sender_buckets(sender) for e in b.entries):
                if e.name == last:
                    continue  # the next chunk of the same piece
                last = e.name
                p = by_vname[e.name]
                rows, local = _rows(owners, p.name, sender, tensors[p.name], shapes[p.name])
                yield e.name, _local_piece(local, p, rows)

        return groups.engine(s.index).send_weights(manifest, walk(), stable=True, delta=delta)

    total = SendStats()
    changed = 0.0  # changed_fraction weighted by each set's dense bytes
    wall = 0.0
    for wave in groups.waves:
        mine = [by_index[k] for k in wave if k in by_index]
        t0 = time.perf_counter()
        if len(mine) <= 1:
            results = [one(s) for s in mine]
        else:
            with ThreadPoolExecutor(len(mine), thread_name_prefix="region-set") as pool:
                futures = [pool.submit(one, s) for s in mine]
                errors = [f.exception() for f in futures]  # waits for every set of the wave
                first = next((e for e in errors if e is not None), None)
                if first is not None:
                    raise first
                results = [f.result() for f in futures]
        wall += time.perf_counter() - t0
        for s, stats in zip(mine, results):
            for f in ("bytes", "tensors", "buckets", "export_s", "pack_s"):
                setattr(total, f, getattr(total, f) + getattr(stats, f))
            for key, value in stats.extra.items():
                if isinstance(value, (int, float)) and isinstance(total.extra.get(key, 0), (int, float)):
                    total.extra[key] = total.extra.get(key, 0) + value
            changed += float(stats.extra.get("changed_fraction", 1.0)) * float(stats.extra.get("dense_bytes", manifests[s.index].wire_bytes))
    total.total_s = wall
    if "changed_fraction" in total.extra:
        total.extra["changed_fraction"] = changed / max(1.0, float(total.extra.get("dense_bytes", 1.0)))
    return total


def receive_regions(
    groups: RegionGroups, manifests: Mapping[int, BucketManifest], assembly: RegionAssembly,
    destinations: Mapping[str, torch.Tensor] | None = None, delta: DeltaRequest | None = None,
) -> Iterator[list[RegionItem]]:
    """Receiver: the items of its regions, per bucket as they land (dense), or all at once after
    every set's patches checked out (delta: the loader's tensors are not written before that)."""
    landing = assembly.start(destinations if delta is None else None)
    direct = assembly.destinations(destinations) if delta is None else None
    held: list[RegionItem] = []
    failure: TransferError | None = None
    try:
        for k in groups.mine:
            engine, manifest = groups.engine(k), manifests[k]
            buckets = engine.receive_buckets(manifest, direct, delta=delta) if delta is not None else engine.receive_buckets(manifest, direct)
            try:
                for bucket in buckets:
                    out = [item for vname, t in bucket for item in landing.land(vname, t)]
                    if delta is not None:
                        held += out
                    elif out:
                        yield out
            except TransferError as exc:
                named = TransferError(f"receiver set {k} (ranks {list(groups.sets[k])}){_pieces_of(manifest, str(exc))}: {exc}")
                if delta is None:
                    raise named from exc
                # Every frame of this set was taken (the senders finished it): take the other sets'
                # too, so no sender waits, then fail with nothing loaded.
                failure = failure if failure is not None else named
    except BaseException:
        groups.abort()  # peers blocked in another set's collective fail fast
        raise
    if failure is not None:
        groups.abort()
        raise failure
    if held:
        yield held


def _pieces_of(manifest: BucketManifest, error: str) -> str:
    """The regions of the bucket an error names ("bucket K"), for the message."""
    m = re.search(r"bucket (\d+)", error)
    if m is None or int(m.group(1)) >= len(manifest.buckets):
        return ""
    names = sorted({e.name for e in manifest.buckets[int(m.group(1))].entries})
    return f", bucket {m.group(1)} holding {', '.join(names[:4])}" + (f" and {len(names) - 4} more" if len(names) > 4 else "")
