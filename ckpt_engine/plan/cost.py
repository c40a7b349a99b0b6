"""Predicted time of one sync, stage by stage, with the bottleneck named.

A sync is a pipeline over buckets: the sender exports (gathers) weights, encodes them into
buckets (pack copies, delta encoding), the transport broadcasts each bucket, and every receiver
loads it; with two or more buffers these overlap, so the body of a sync costs its slowest stage
plus one bucket's worth of every other stage (fill and drain). Finalize and pause are serial.

Transfer follows NCCL's ring broadcast: ``bytes / rate + messages x (latency + ring fill)``,
where the rate is the narrowest of the sender's egress, every receiver node's NIC ingress and the
NVLink fan-out inside a node. Several senders split the bytes, but each receiver still has to
take in every byte, so no number of senders beats receiver ingress.

With ``receive="shard"`` (receive plans, issue 27) each engine GPU takes in only its 1/N of the
bytes, over its own NIC. ckpt-engine streams the receiver sets of one wave side by side (sets that
share no receiver, at most ``PARALLEL_SETS`` at once) and the waves one after another, so an
engine of N GPUs takes ceil(N / PARALLEL_SETS) waves of one shard each.

With ``backend="nixl"`` the transfer is one-sided pulls instead (`pull.py`): per-link reads, no
ring, each sender's link carrying its bytes once per receiver that reads them; every bucket packed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ckpt_engine.plan.cluster import Links, RolloutLayout, TrainerLayout
from ckpt_engine.plan.delta import delta_wire_bytes
from ckpt_engine.plan.model_shapes import ModelBytes
from ckpt_engine.plan.params import Calibration
from ckpt_engine.plan.pull import first_sync_s, pull_transfer

__all__ = ["BACKENDS", "EXPORTS", "LOADERS", "RECEIVES", "STAGES", "STRATEGIES", "Prediction", "SyncSetup", "broadcast_s", "predict"]

STRATEGIES = ("single", "all-senders")
BACKENDS = ("nccl", "nixl")
"""``nccl``: a broadcast transport (NCCL's ring; hccl and gloo alike); ``nixl``: one-sided pulls."""
LOADERS = ("inplace", "copy", "ref", "vllm")
EXPORTS = ("none", "gather", "host")
RECEIVES = ("full", "shard")
STAGES = ("export", "encode", "transfer", "load", "overhead", "finalize", "pause")
PARALLEL_SETS = 8
"""Receiver sets a sender streams side by side by default (`pipeline/region_groups.py`
DEFAULT_PARALLEL_SETS); `checkpoint_engine.region_slot_memory_mb` sets more (`parallel_sets`)."""
PIPELINED = ("export", "encode", "transfer", "load")


@dataclass(frozen=True)
class SyncSetup:
    """Everything a prediction depends on.

    ``export``: ``none`` = the sender holds whole tensors (a state dict), ``gather`` = a sharded
    trainer gathers them (FSDP all-gather / Megatron TP-PP-EP gather), ``host`` = weights wait in
    host memory and are copied in (H2D). ``loader``: ``inplace`` / ``copy`` = ckpt-engine's bench
    receivers, ``ref`` = the reference receiver (Python per tensor), ``vllm`` = vLLM's
    ``load_weights`` plus pause and finalize. ``packed``: None = decided like the nccl backend
    (buckets of more than ``group_max_tensors`` tensors, transient sources and deltas are packed).
    """

    model: ModelBytes
    trainer: TrainerLayout
    rollout: RolloutLayout
    links: Links
    strategy: str = "single"
    delta: float | None = None
    bucket_bytes: int = 1 << 30
    num_buffers: int = 2
    loader: str = "copy"
    export: str = "gather"
    packed: bool | None = None
    group_max_tensors: int = 64
    senders: int | None = None
    num_buckets: int | None = None
    receive: str = "full"
    overlap_export: bool = True
    parallel_sets: int = PARALLEL_SETS
    backend: str = "nccl"

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"--backend {self.backend!r}: use one of {', '.join(BACKENDS)}")
        if self.backend == "nixl" and self.delta is not None:
            raise ValueError("--delta with --backend nixl: the nixl backend does not send patches (delta: on is refused, auto syncs dense)")
        if self.receive not in RECEIVES:
            raise ValueError(f"--receive {self.receive!r}: use one of {', '.join(RECEIVES)}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"--strategy {self.strategy!r}: use one of {', '.join(STRATEGIES)}")
        if self.loader not in LOADERS:
            raise ValueError(f"--loader {self.loader!r}: use one of {', '.join(LOADERS)}")
        if self.export not in EXPORTS:
            raise ValueError(f"--export {self.export!r}: use one of {', '.join(EXPORTS)}")
        if self.bucket_bytes < 1 << 20:
            raise ValueError(f"--bucket-mb must be >= 1, got {self.bucket_bytes / 2**20:g}")
        if self.num_buffers < 1:
            raise ValueError(f"--buffers must be >= 1, got {self.num_buffers}")
        if self.parallel_sets < 1:
            raise ValueError(f"--parallel-sets must be >= 1, got {self.parallel_sets}")
        if self.senders is not None and not 1 <= self.senders <= self.trainer.num_shards:
            raise ValueError(f"--senders must be in [1, {self.trainer.num_shards}] (the trainer's distinct shards), got {self.senders}")
        if self.delta is not None and not 0.0 <= self.delta <= 1.0:
            raise ValueError(f"--delta must be a changed fraction in [0, 1], got {self.delta!r}")

    @property
    def num_senders(self) -> int:
        if self.strategy == "single":
            return 1
        return self.senders if self.senders is not None else self.trainer.num_shards


@dataclass
class Prediction:
    """Seconds per stage (``pipelined`` ones overlap), the total, the bottleneck and the facts used."""

    stages: dict[str, float]
    total_s: float
    bottleneck: str
    wire_bytes: int
    num_buckets: int
    num_senders: int
    receiver_ingress_s: float
    notes: list[str] = field(default_factory=list)
    detail: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, object]:
        return {
            "stages_s": self.stages,
            "total_s": self.total_s,
            "bottleneck": self.bottleneck,
            "wire_bytes": self.wire_bytes,
            "num_buckets": self.num_buckets,
            "num_senders": self.num_senders,
            "receiver_ingress_s": self.receiver_ingress_s,
            "notes": self.notes,
            "detail": self.detail,
        }


def broadcast_s(nbytes: float, num_msgs: int, rate_bps: float, cal: Calibration, fill_s: float = 0.0) -> float:
    """NCCL broadcast of ``nbytes`` in ``num_msgs`` messages: bandwidth term + per-message cost."""
    return nbytes / rate_bps + num_msgs * (cal.msg_latency_s + fill_s)


def _copy_rate(setup: SyncSetup, cal: Calibration, trainer_side: bool) -> float:
    gpu = setup.trainer.gpu if trainer_side else setup.rollout.gpu
    return gpu.hbm_gbs * 1e9 * cal.copy_eff / 2


def _export_s(setup: SyncSetup, cal: Calibration, senders: int) -> float:
    m, t, links = setup.model, setup.trainer, setup.links
    if setup.export == "none":
        return 0.0
    if setup.export == "host":
        return m.total_bytes / senders / (links.pcie_gbs * 1e9)
    shards = t.num_shards
    one_node = links.same_node or t.num_gpus <= links.gpus_per_node
    rate = links.nvlink_gbs * 1e9 * cal.export_eff if one_node else links.nic_gbs * 1e9 * cal.nic_eff
    # each sender owns 1/senders of the bytes and holds 1/shards of them: it gathers the rest
    gather = m.total_bytes / senders * (1 - senders / shards)
    walk = m.num_tensors * cal.export_tensor_s / (1 if t.fsdp or senders == 1 else senders)
    units = m.num_layers + 1 if gather > 0 else 0
    return gather / rate + units * cal.export_unit_s + walk


def _transfer(setup: SyncSetup, cal: Calibration, wire: float, senders: int, buckets: int) -> tuple[float, float]:
    """(transfer seconds, receiver-ingress lower bound in seconds)."""
    links, r = setup.links, setup.rollout
    nv = links.nvlink_gbs * 1e9 * cal.nvlink_eff
    nic = links.nic_gbs * 1e9 * cal.nic_eff
    per_node = min(r.num_gpus, links.gpus_per_node)
    if setup.receive == "shard":  # a GPU takes its shard over its own link, wave after wave
        gpu_bytes = wire / r.gpus_per_engine
        waves = math.ceil(r.gpus_per_engine / setup.parallel_sets)
        ingress_s = waves * gpu_bytes / (nv if links.same_node else nic)
        bandwidth_s = max(wire / senders / (nv if links.same_node else nic), ingress_s)
        return bandwidth_s + (buckets + waves) * cal.msg_latency_s, ingress_s
    gpu_bytes, node_bytes = wire, wire
    if links.same_node:
        egress, node_ingress_s = nv, 0.0
        fill = (r.num_gpus - 1) * cal.ring_chunk_bytes / nv
    else:
        egress = nic
        node_ingress_s = node_bytes / (per_node * nic)  # each receiver node takes in its bytes once
        nodes = links.nodes(r.num_gpus)
        fill = (nodes - 1) * cal.ring_chunk_bytes / nic + (r.num_gpus - nodes) * cal.ring_chunk_bytes / nv
    ingress_s = max(gpu_bytes / nv, node_ingress_s)  # NVLink fan-out to every GPU of the node
    bandwidth_s = max(wire / senders / egress, ingress_s)
    return bandwidth_s + buckets * (cal.msg_latency_s + fill), ingress_s


def _load_s(setup: SyncSetup, cal: Calibration, wire: float, packed: bool, kept: float) -> tuple[float, float]:
    """(load seconds, of which device copies) on one receiver GPU."""
    m = setup.model
    per_tensor = {"inplace": 0.0, "copy": 0.0, "ref": cal.load_tensor_s, "vllm": cal.vllm_load_tensor_s}[setup.loader]
    if setup.delta is not None:  # scatter the changed values into the weights: read delta, read+write targets
        copy_bytes = (wire / setup.rollout.gpus_per_engine + 2 * kept * setup.delta) * 2
    elif setup.loader == "inplace" and not packed:
        copy_bytes = 0.0
    else:
        copy_bytes = kept
    copy_s = copy_bytes / _copy_rate(setup, cal, trainer_side=False)
    return m.num_tensors * per_tensor + copy_s, copy_s


def predict(setup: SyncSetup, cal: Calibration) -> Prediction:
    """Predicted seconds of one sync for ``setup`` under ``cal``."""
    m, r = setup.model, setup.rollout
    senders = setup.num_senders
    dense = m.total_bytes
    delta = delta_wire_bytes(dense, m.itemsize, setup.delta, m.num_tensors) if setup.delta is not None else None
    wire = delta.wire_bytes if delta is not None else dense
    per_sender = wire / senders
    buckets = setup.num_buckets if setup.num_buckets is not None else max(1, math.ceil(per_sender / setup.bucket_bytes))
    tensors_per_bucket = m.num_tensors / (senders * buckets)
    packed = setup.packed
    if setup.backend == "nixl":
        packed = True  # every bucket is packed into a registered slot
    if packed is None:
        packed = tensors_per_bucket > setup.group_max_tensors or setup.export != "none" or delta is not None
    notes: list[str] = []

    export_s = _export_s(setup, cal, senders)
    encode_copy_s = per_sender / _copy_rate(setup, cal, trainer_side=True) if packed else 0.0
    encode_s = encode_copy_s + (m.num_tensors / senders * cal.packed_tensor_s if packed else 0.0)
    if m.dtype == "fp8":  # the sender quantizes its bf16 weights on its GPU (an upper bound: all of them)
        encode_s += 2 * dense / senders / (setup.trainer.gpu.hbm_gbs * 1e9 * cal.quantize_eff)
    if delta is not None:  # read new and old weights, write the delta
        encode_copy_s += (2 * dense / senders + per_sender) / (_copy_rate(setup, cal, trainer_side=True) * 2)
        encode_s = encode_copy_s + m.num_tensors / senders * cal.packed_tensor_s
        notes.append(f"delta {setup.delta:g}: {delta.encoding} index, wire = {delta.ratio(dense):.3f} x dense")
    pull = None
    if setup.backend == "nixl":
        pull = pull_transfer(wire, senders, buckets, setup.receive, r, setup.links, setup.parallel_sets, cal)
        transfer_s, ingress_s = pull.seconds, pull.ingress_s
    else:
        transfer_s, ingress_s = _transfer(setup, cal, wire, senders, buckets)
    kept = dense / r.gpus_per_engine
    load_s, load_copy_s = _load_s(setup, cal, wire, packed, kept)
    engine = setup.loader == "vllm"
    finalize_s = kept / _copy_rate(setup, cal, trainer_side=False) if engine else 0.0
    pause_s = cal.pause_s if engine else 0.0

    piped = {"export": export_s, "encode": encode_s, "transfer": transfer_s, "load": load_s}
    groups = list(piped.values())
    if not setup.overlap_export:
        groups = [export_s + encode_s + transfer_s, load_s]
        notes.append("the sender gathers, then sends, each bucket: export and transfer do not overlap")
    slowest = max(groups)
    if setup.num_buffers >= 2:
        # fill + drain: one bucket's worth of every other stage; a receiver sees every sender's buckets
        share = 1 / buckets if setup.num_buckets is not None else min(1.0, setup.bucket_bytes / per_sender)
        body = slowest + (sum(groups) - slowest) * share / senders
    else:
        body = sum(groups)
        notes.append("1 buffer: stages run one after another")
    overhead_s = buckets * cal.bucket_overhead_s + cal.copy_interference * (encode_copy_s + load_copy_s)
    stages = {**piped, "overhead": overhead_s, "finalize": finalize_s, "pause": pause_s}
    total = body + overhead_s + finalize_s + pause_s
    bottleneck = max(stages, key=lambda k: stages[k])

    weights_gb = dense / r.gpus_per_engine / 2**30
    if weights_gb > r.gpu.mem_gib * 0.9:
        notes.append(f"weights need {weights_gb:.0f} GiB per rollout GPU > 90 % of {r.gpu.name}'s {r.gpu.mem_gib:g} GiB: use more GPUs per engine or fp8")
    if senders > 1 and transfer_s <= ingress_s * 1.05:
        notes.append("transfer is at receiver ingress: more senders cannot help")
    detail = {"packed": float(packed), "tensors_per_bucket": tensors_per_bucket, "bytes_per_sender": per_sender}
    if pull is not None:
        detail.update(pull_link_gbs=pull.link_gbs, pull_egress_s=pull.egress_s, first_sync_extra_s=first_sync_s(cal))
        if pull.egress_s > pull.ingress_s * 1.05:
            notes.append(
                f"the pulls are bound by the senders' links ({pull.egress_s:.3g} s against {pull.ingress_s:.3g} s of receiver ingress): "
                "each receiver reads a sender's bytes itself (no broadcast tree), so more senders or --receive shard help"
            )
        notes.append(f"nixl: the first sync of a plan pays {first_sync_s(cal):.2f} s more (slot registration, offers, a process's first NIXL agent)")
    return Prediction(stages, total, bottleneck, int(wire), buckets, senders, ingress_s, notes, detail)
