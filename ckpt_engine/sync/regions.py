"""The controller's side of region delivery (issue 27): each engine rank receives only what it holds.

At join every engine states its ranks' receive plans (`RolloutAdapter.receive_plans`). Per sync,
`RegionDelivery.prepare` checks them against the sync's tensors (a bad plan is refused by engine,
rank and tensor before anything pauses), cuts the receiver sets (`planning/receive_sets.py`) and
plans each set's buckets; all of it is cached while the plan, the plans and the bucket settings
stay. `send` streams every set through its own group (`pipeline/region_groups.py`), joined once
per layout and dropped with the weight-sync group. Region delivery is used when some rank states a
plan and every engine takes regions (`capabilities.regions`); otherwise every rank receives whole
tensors, as before (logged once with the reason). With many senders, trainer rank 0 announces the
layout to the other senders (`announcement`); each plans the sets alike (`plan_sets`), checks the
digest and sends its rows of every piece (`sender_tensors`). How many sets stream side by side
(`parallel_sets`: the `region_slot_memory_mb` budget over one set's slots) is rank 0's to decide
and travels in the announcement, so every sender's waves match.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import msgpack
import torch

from ckpt_engine.rollout_adapters.capabilities import lacking
from ckpt_engine.delta.request import DeltaRequest
from ckpt_engine.manifest import BucketManifest
from ckpt_engine.pipeline.region_groups import DEFAULT_PARALLEL_SETS, RegionGroups, parallel_sets, send_regions
from ckpt_engine.manifest import TensorSpec
from ckpt_engine.planning.ownership import OwnerMap
from ckpt_engine.planning.receive_sets import ReceiverSet, RegionLayout
from ckpt_engine.planning.region_wire import RegionAssignment
from ckpt_engine.planning.regions import ReceivePlan, ReceivePlanError
from ckpt_engine.rollout_adapters.base import ManifestRejectedError, RolloutAdapter
from ckpt_engine.sources.base import WatchedWeights, WeightSource
from ckpt_engine.sources.sharded import ShardedWeightSource, piece_names
from ckpt_engine.engine import CheckpointEngine, Rendezvous, SendStats

__all__ = ["RegionDelivery", "RegionSync", "plan_sets", "sender_tensors"]

MAX_LAYOUT_BYTES = 900_000
"""The layout travels to the other senders in one announcement (at most 1 MiB)."""


def plan_sets(
    layout: RegionLayout, engine: CheckpointEngine, specs: Sequence[TensorSpec], senders: int, owners: OwnerMap | None,
) -> tuple[dict[int, BucketManifest], str]:
    """Every set's bucket manifest and the digest of them all (with the layout's): a pure function,
    so every sender plans alike."""
    by_name = {s.name: s for s in specs}
    manifests = {
        s.index: engine.plan([p.spec for p in s.pieces], num_senders=senders, owners=s.owners(by_name, owners)) for s in layout.sets
    }
    digest = hashlib.sha256("/".join([layout.digest, *(m.digest for m in manifests.values())]).encode()).hexdigest()
    return manifests, digest


def sender_tensors(
    source: ShardedWeightSource, sets: Sequence[ReceiverSet], manifests: dict[int, BucketManifest], *, stable: bool,
) -> dict[str, torch.Tensor]:
    """This sender's piece (`local_piece`) of every tensor some set has it send, in one walk."""
    names: dict[str, None] = {}
    for s in sets:
        by_vname = {p.spec.name: p.name for p in s.pieces}
        for vname in piece_names(manifests[s.index], source.sender_index):
            names.setdefault(by_vname[vname])
    source.begin_pieces()
    try:
        return {n: (t if stable else t.clone()) for n in names for t in (source.local_piece(n),)}
    finally:
        source.end_pieces()

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RegionSync:
    """One plan's region delivery: the layout, each set's manifest, each receiver rank's assignment."""

    layout: RegionLayout
    manifests: dict[int, BucketManifest]
    digest: str
    """Of the layout and the sets' manifests: the delta chain's plan identity."""
    assignments: list[bytes]
    """Encoded `RegionAssignment` per receiver rank (rank order)."""
    received_bytes: list[int]
    """Bytes each receiver rank takes in a dense sync."""
    sent_bytes: list[int]
    """Bytes each sender puts on the wire in a dense sync: its share of every set's pieces, each
    piece once per set it travels to (a piece several ranks hold travels once to their set; a
    tensor no rank holds, not at all)."""
    owners: OwnerMap | None = None
    """The senders' shards of the whole tensors (many senders)."""


class RegionDelivery:
    """Held by a WeightSyncSession: the engines' plans, the cached layout and the sender's groups."""

    def __init__(self, slot_memory_bytes: int | None = None) -> None:
        self.slot_memory_bytes = slot_memory_bytes
        """The senders' budget for receiver sets side by side (None: `DEFAULT_PARALLEL_SETS`)."""
        self.width = DEFAULT_PARALLEL_SETS
        """This sync's sets side by side (`parallel_sets`)."""
        self.plans: list[ReceivePlan | None] = []
        self.owners: list[tuple[str, int]] = []
        """(engine name, its rank) of each receiver rank."""
        self.active: RegionSync | None = None
        """This sync's region delivery (None: whole tensors to every rank)."""
        self._key: tuple[object, ...] | None = None
        self._cached: RegionSync | None = None
        self._groups: RegionGroups | None = None
        self._said: str | None = None
        self._wrong: str | None = None
        """Why the plans stated at the last join are refused (a wrong count), until the next join."""
        self.rdzv: Rendezvous | None = None

    def joined(self, rollouts: Sequence[RolloutAdapter], plans: dict[str, list[ReceivePlan | None]], rendezvous: Rendezvous) -> None:
        """The engines (re)joined group `rendezvous` and stated their plans (by engine name);
        groups of an earlier weight-sync group are gone."""
        self.drop_groups()
        self.rdzv = rendezvous
        self.plans, self.owners = [], []
        wrong = [(r, plans[r.name]) for r in rollouts if not isinstance(plans[r.name], (list, tuple)) or len(plans[r.name]) != r.world_size]
        if wrong:  # refused at this join and at every sync until the next one (issue 45)
            self._wrong = "; ".join(
                f"engine {r.name!r}: receive_plans() returned {_count(got)} for its {r.world_size} rank(s); it must return a list "
                "of one plan (or None) per rank" for r, got in wrong
            )
            raise ValueError(self._wrong)
        self._wrong = None
        for r in rollouts:
            self.plans += list(plans[r.name])
            self.owners += [(r.name, i) for i in range(r.world_size)]

    def prepare(
        self, rollouts: Sequence[RolloutAdapter], manifest: BucketManifest, engine: CheckpointEngine, senders: int, source: WeightSource,
    ) -> RegionSync | None:
        """This sync's region delivery, or None; a plan that does not fit the tensors is refused
        (ManifestRejectedError naming the engine, its rank and the tensor) before anything pauses."""
        self.active = None
        if self._wrong is not None:
            raise ValueError(f"{self._wrong} (stated at join; nothing was paused or sent)")
        if all(p is None for p in self.plans):
            return None
        owners = source.owners() if senders > 1 and isinstance(source, ShardedWeightSource) else None
        why = self._refusal(rollouts, senders, source)
        if why is not None:
            self._whole(why)
            return None
        key = (manifest.digest, engine.bucket_size_bytes, engine.solo_bytes, tuple(map(_plan_key, self.plans)))
        if key != self._key or self._cached is None:
            self._cached, self._key = self._build(manifest, engine, senders, owners), key
        if senders > 1 and len(msgpack.packb(self._cached.layout.to_wire(), use_bin_type=True)) > MAX_LAYOUT_BYTES:
            self._whole(f"the layout is too large to announce to the other senders (more than {MAX_LAYOUT_BYTES} bytes)")
            return None
        self.active = self._cached
        width = parallel_sets(self.slot_memory_bytes, engine.num_buffers, engine.bucket_size_bytes, len(self.active.layout.sets))
        if width != self.width:
            logger.info("region delivery: %d receiver set(s) side by side (of %d)", width, len(self.active.layout.sets))
        self.width = width
        return self.active

    def _whole(self, why: str) -> None:
        if why != self._said:
            logger.warning("receive plans stated, but every rank receives whole tensors: %s", why)
            self._said = why

    def _refusal(self, rollouts: Sequence[RolloutAdapter], senders: int, source: WeightSource) -> str | None:
        if senders > 1 and isinstance(source, ShardedWeightSource) and source.collective_pieces:
            return "the source's pieces are collective with TP helpers, which walk them in the whole-tensor plan's order"
        whole = lacking(rollouts, "regions")
        return f"engine(s) {', '.join(whole)} take no region delivery" if whole else None

    def announcement(self) -> dict[str, object] | None:
        """What the other senders need of this sync's region delivery (None: none)."""
        if self.active is None:
            return None
        return {"layout": self.active.layout.to_wire(), "digest": self.active.digest, "width": self.width}

    def _build(self, manifest: BucketManifest, engine: CheckpointEngine, senders: int, owners: OwnerMap | None) -> RegionSync:
        try:
            layout = RegionLayout.build(manifest.specs, self.plans)
        except ReceivePlanError as exc:
            raise self._rejected(exc) from None
        manifests, digest = plan_sets(layout, engine, manifest.specs, senders, owners)
        assignments = [
            RegionAssignment.of(digest, manifest.digest, r, layout.sets_of(r), manifests).to_wire() for r in range(len(self.plans))
        ]
        received = [layout.bytes_for(r) for r in range(len(self.plans))]
        logger.info(
            "region delivery: %d receiver set(s); per rank %s of %d bytes", len(layout.sets), received, manifest.total_bytes
        )
        sent = [sum(per) for per in zip(*(m.bytes_per_sender() for m in manifests.values()))] if manifests else [0] * senders
        return RegionSync(layout, manifests, digest, assignments, received, sent, owners)

    def _rejected(self, exc: ReceivePlanError) -> ManifestRejectedError:
        text = str(exc)
        if text.startswith("receiver rank "):
            head, _, rest = text.partition(": ")
            rank = int(head.removeprefix("receiver rank "))
            name, local = self.owners[rank]
            return ManifestRejectedError(name, [f"rank {local}: {rest}"])
        return ManifestRejectedError(self.owners[0][0] if self.owners else "?", [text], engines=sorted({n for n, _ in self.owners}))

    def validate(self, rollout: RolloutAdapter, manifest: BucketManifest, encoded: bytes) -> None:
        """The engine's validate, with its ranks' assignments when this sync delivers regions."""
        if self.active is None:
            rollout.validate(manifest, encoded)
            return
        mine = [a for a, (owner, _) in zip(self.active.assignments, self.owners) if owner == rollout.name]
        rollout.validate_regions(manifest, encoded, mine)

    def received_bytes(self, rollouts: Sequence[RolloutAdapter], model_bytes: int) -> dict[str, list[int]]:
        """Bytes per engine rank of a dense sync (the model's bytes each without region delivery)."""
        if self.active is None:
            return {r.name: [model_bytes] * r.world_size for r in rollouts}
        out: dict[str, list[int]] = {}
        for nbytes, (name, _) in zip(self.active.received_bytes, self.owners):
            out.setdefault(name, []).append(nbytes)
        return out

    def sent_bytes(self) -> list[int] | None:
        """Each sender's bytes of a dense sync of this sync's region delivery (None: no region
        delivery, the plan's buckets travel whole)."""
        return list(self.active.sent_bytes) if self.active is not None else None

    def send(
        self, engine: CheckpointEngine, manifest: BucketManifest, weights: Iterable[tuple[str, torch.Tensor]], *, stable: bool,
        delta: DeltaRequest | None, make_engine: Callable[[], CheckpointEngine], source: WeightSource,
    ) -> SendStats:
        """The one sender's side: walk the source once, then every set through its group (made
        by `make_engine`); without region delivery, `engine.send_weights` as ever."""
        sync, rendezvous = self.active, self.rdzv
        fresh = not stable and source.fresh_tensors  # held as yielded: no clone, one batched pack per bucket
        if sync is None or rendezvous is None:
            extra = {"delta": delta} if delta is not None else {}
            return engine.send_weights(manifest, WatchedWeights(weights, fresh=True) if fresh else weights, stable=stable, **extra)
        if sync.owners is not None and isinstance(source, ShardedWeightSource):  # many senders: this rank's rows
            tensors = sender_tensors(source, sync.layout.sets, sync.manifests, stable=stable)
        else:
            tensors = {name: (t if stable or fresh else t.clone()) for name, t in weights}
        groups = self._groups
        if groups is None or groups.digest != sync.digest or groups.rdzv != rendezvous or groups.width != self.width:
            self.drop_groups()
            sets = [(s.index, s.members) for s in sync.layout.sets]
            groups = self._groups = RegionGroups(rendezvous, 0, sync.digest, sets, make_engine, width=self.width)
        try:
            groups.join()
            shapes = {s.name: s.shape for s in manifest.specs}
            return send_regions(groups, sync.layout.sets, sync.manifests, tensors, shapes, owners=sync.owners, delta=delta)
        except BaseException:
            self.drop_groups()  # closing the sender's sides wakes receivers blocked on them
            raise

    def drop_groups(self) -> None:
        groups, self._groups = self._groups, None
        if groups is not None:
            groups.close()


def _count(plans: object) -> str:
    return f"{len(plans)} plan(s)" if isinstance(plans, (list, tuple)) else f"a {type(plans).__name__}, not a list"


def _plan_key(plan: ReceivePlan | None) -> object:
    if plan is None:
        return None
    return tuple(sorted((n, rs) for n, rs in plan.holds.items()))
