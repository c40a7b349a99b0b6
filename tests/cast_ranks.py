"""Rank function for delta syncs whose patches the trainer's cast records (`delta_base="cast"`).

Senders hold fp32 masters stepped by torch's AdamW and write their bf16 weights only through the
engine's CastRecorder; receivers step the same chain themselves to know what every sync must
deliver, and compare bit for bit.
"""

from __future__ import annotations

from typing import Any

import torch

from ckpt_engine.delta.request import DeltaRequest
from ckpt_engine.transports.base import Rendezvous
from ckpt_engine.planning.ownership import row_shards
from ckpt_engine.transports.registry import CheckpointEngineRegistry
from ckpt_engine.sources.sharded import ShardedStateDictSource, iter_pieces
from ckpt_engine.sources.base import spec_of
from multisender import even_rows
from roundtrip import same_bits

TOUCHED = "w.0"


def _masters() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """fp32 masters sent as bf16, and tensors sent in their own dtype (an fp32 router, a step count)."""
    g = torch.Generator().manual_seed(11)
    masters = {f"w.{i}": torch.randn(17 + i, 40 + 3 * i, generator=g) * 0.02 for i in range(6)}
    masters["big"] = torch.randn(50_000, generator=g) * 0.02  # larger than a bucket: chunks
    masters["norm"] = torch.ones(64)
    masters["odd"] = torch.randn(7, 3, generator=g)  # word counts that are not whole vectors
    masters["nan_zero"] = torch.tensor([float("nan"), -0.0, 0.0, float("inf"), float("-inf"), 1.0] * 10)
    kept = {"router": torch.randn(3, 40, generator=g), "steps": torch.zeros(4, dtype=torch.int64)}
    return masters, kept


class _Chain:
    """The trainer's state and optimizer; `step()` is one real AdamW step (the gradients are keyed
    by the step, so every process computes the same chain)."""

    def __init__(self, lr: float, device: torch.device) -> None:
        masters, kept = _masters()
        self.masters = {k: v.to(device) for k, v in masters.items()}
        self.kept = {k: v.to(device) for k, v in kept.items()}
        params = [*self.masters.values(), self.kept["router"]]
        self.opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
        self.steps = 0

    def step(self) -> None:
        self.steps += 1
        g = torch.Generator().manual_seed(1000 + self.steps)
        for p in [*self.masters.values(), self.kept["router"]]:
            p.grad = (torch.randn(p.shape, generator=g) * 1e-3).to(p.device)
        with torch.no_grad():
            self.opt.step()
        self.kept["steps"] += 1

    def wire(self) -> dict[str, torch.Tensor]:
        return {**{k: v.to(torch.bfloat16) for k, v in self.masters.items()}, **{k: v.clone() for k, v in self.kept.items()}}


def _spans(manifest: Any, rank: int) -> dict[str, list[int]]:
    """Per tensor, the byte range [lo, hi) this sender sends."""
    spans: dict[str, list[int]] = {}
    for b in manifest.sender_buckets(rank):
        for e in b.entries:
            lo_hi = spans.setdefault(e.name, [e.chunk_offset, e.chunk_offset])
            lo_hi[1] = e.chunk_offset + e.chunk_size
    return spans


def _pieces_and_pairs(manifest: Any, rank: int, owners: dict, weights: dict[str, torch.Tensor], chain: _Chain) -> tuple[list, dict]:
    """What this sender's source yields ((name, piece) in order) and the recorder's (master, weight)
    pairs for the bf16 ones."""
    pieces, pairs = [], {}
    for name, (lo, hi) in _spans(manifest, rank).items():
        t = weights[name]
        whole = name not in owners or (lo, hi) == (0, t.numel() * t.element_size())
        piece = t if whole else t.reshape(-1)[lo // t.element_size() : hi // t.element_size()]
        pieces.append((name, piece))
        if name in chain.masters:
            m = chain.masters[name]
            pairs[name] = (m if whole else m.reshape(-1)[lo // 2 : hi // 2], piece)
    return pieces, pairs


def cast_rank(
    rank: int, rdzv: Rendezvous, *, versions: int = 5, lr: float = 1e-5, bucket_size: int = 16 * 1024, in_place: bool = False,
    double_cast: int | None = None, steps_then: int = 2, touch: int | None = None, corrupt: int | None = None, bind: bool = True,
    idle: int | None = None, walk: bool = False, move: int | None = None, engine_kwargs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Version 0 is a dense seed; each later version is one optimizer step (`steps_then` at `double_cast`,
    none at `idle`) cast through the recorder, then a patch sync. `touch`: after that version's cast the sender
    changes one word of TOUCHED with a torch op (the receivers expect it too). `corrupt`: the
    sender flips a byte of a patch in that sync. `bind=False`: the sender never binds a recorder.
    `walk`: the sender's source is a ShardedStateDictSource walk, which names its anchors (the
    sender may then skip the walk at later syncs); `move`: before that version the sender moves
    its TOUCHED weight to new memory (and binds again), so no walk may be replayed."""
    senders = rdzv.num_senders
    dev = torch.device(f"cuda:{rank % torch.cuda.device_count()}") if rdzv.backend == "nccl" else torch.device("cpu")
    engine = CheckpointEngineRegistry.new(rdzv.backend, bucket_size_bytes=bucket_size, timeout_s=rdzv.timeout_s, device=dev,
                                          delta_base="cast", **(engine_kwargs or {}))
    armed = {"on": False}
    if corrupt is not None and rank == 0:
        def tamper(index: int, msg: torch.Tensor) -> None:
            if armed["on"] and msg.numel() > 40:  # a payload, not a frame header
                msg[40] ^= 0x10
                armed["on"] = False

        engine._tamper_hook = tamper  # type: ignore[method-assign]
    engine.init_process_group(rdzv, rank)
    chain = _Chain(lr, dev)
    weights = chain.wire()  # the trainer's bf16 weights (and kept tensors), written in place from now on
    specs = [spec_of(n, t) for n, t in weights.items()]
    owners = {s.name: row_shards(s, even_rows(s.shape[0], senders)) for s in specs if len(s.shape) >= 2}
    manifest = engine.plan(specs, num_senders=senders, owners=owners)
    out: dict[str, Any] = {"bad": [], "errors": [], "stats": [], "kept": []}
    pieces: list[tuple[str, torch.Tensor]] = []
    rec = None
    if rank < senders:
        spans = _spans(manifest, rank)
        pieces, pairs = _pieces_and_pairs(manifest, rank, owners, weights, chain)
        rec = engine.cast_recorder(manifest)
        if bind:
            rec.bind(pairs)
    mine = {n: torch.zeros_like(t) for n, t in weights.items()} if in_place else None
    base_id = None
    for version in range(versions):
        if version:
            for _ in range(steps_then if version == double_cast else 0 if version == idle else 1):
                chain.step()
                if rank < senders:
                    if bind:
                        rec.cast_()
                    else:
                        for k, m in chain.masters.items():
                            weights[k].copy_(m)
                    for k in chain.kept:
                        weights[k].copy_(chain.kept[k])
        expect = chain.wire()
        if version == touch:
            expect[TOUCHED].view(torch.int16).reshape(-1)[3] += 1
            if rank < senders:
                weights[TOUCHED].view(torch.int16).reshape(-1)[3] += 1
        request = DeltaRequest(base_id is not None, base_id, 100 + version)
        armed["on"] = version == corrupt
        if rank < senders and version == move:
            weights[TOUCHED] = weights[TOUCHED].clone()  # the trainer reallocated a weight
            pieces, pairs = _pieces_and_pairs(manifest, rank, owners, weights, chain)
            rec.bind(pairs)
        try:
            if rank < senders:
                source = iter_pieces(ShardedStateDictSource(weights, rank, senders), manifest) if walk else pieces
                stats = engine.send_weights(manifest, source, stable=True, delta=request)
                out["stats"].append(dict(stats.extra))
                for n, piece in pieces:  # this sender's own bytes of each tensor are the trainer's cast
                    lo, hi = spans[n]
                    want = expect[n].reshape(-1).view(torch.uint8)[lo:hi]
                    got = piece.reshape(-1).view(torch.uint8)
                    if piece.shape == expect[n].shape:  # a whole tensor this sender sends a part of
                        got = got[lo:hi]
                    if not same_bits(got, want):
                        out["bad"].append(f"v{version} {n} (sender)")
            elif in_place:
                for n, t in engine.receive_weights(manifest, mine, delta=request):
                    if t.data_ptr() != mine[n].data_ptr():
                        mine[n].copy_(t)
                out["bad"] += [f"v{version} {n}" for n in expect if not same_bits(mine[n], expect[n])]
                out["stats"].append(dict(engine.last_delta_stats))
            else:
                got = {n: t.clone() for n, t in engine.receive_weights(manifest, delta=request)}
                out["bad"] += [f"v{version} {n}" for n in expect if n not in got or not same_bits(got[n], expect[n])]
                out["stats"].append(dict(engine.last_delta_stats))
            base_id = request.new_id
            last = expect
        except Exception as exc:
            out["errors"].append(f"v{version}: {type(exc).__name__}: {exc}")
            if mine is not None:
                out["kept"] = [n for n in last if not same_bits(mine[n], last[n])]
            break
    out["base_bytes"] = engine.delta_base_bytes
    out["bound_buckets"] = len(rec.bound_keys()) if rec is not None else 0
    engine.finalize()
    return out


def fsdp2_shadows_rank(rank: int, world_size: int, device: str) -> dict:
    """One FSDP2 rank (a world of one) whose shadows are bound to a recorder of every bf16 tensor
    it exports; two optimizer steps at lr 1e-6 cast through it (on CUDA Triton's kernel and the
    torch merge, on a CPU numba's pass and merge). Returns what the caller checks."""
    from ckpt_engine.delta import codec
    from ckpt_engine.delta.recorder import CastBucket, CastRecorder, CastSlice
    from ckpt_engine.trainer_adapters.fsdp2 import FSDP2TrainEngine
    from tests._trainer_mp import world_group
    from tests.test_trainer_fsdp2 import build_model, engine_config, lm_loss

    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    engine = FSDP2TrainEngine(build_model().to(dev), config=engine_config(wire_dtype="bfloat16", lr=1e-6), process_group=world_group(), device=dev)
    slices, at = [], 0
    for spec in engine.metadata():
        if spec.dtype == "bfloat16":
            nbytes = 2 * int(torch.Size(spec.shape).numel())
            slices.append(CastSlice(spec.name, tuple(spec.shape), "bfloat16", 0, 0, nbytes, at))
            at += nbytes
    rec = CastRecorder([CastBucket(0, at, 2, tuple(slices))], dev, 0.25)
    assert engine.record_casts(lambda: rec, pieces=True) and not engine.record_casts(lambda: rec, pieces=False)
    names = [s.name for s in slices]
    assert all(engine.local_piece(n) is engine._cast_shadows.piece(n) for n in names)
    rec.synced(1, {0})
    before = torch.cat([engine.local_piece(n).reshape(-1).view(torch.int16) for n in names]).clone()
    g = torch.Generator().manual_seed(3)
    for _ in range(2):
        ids = torch.randint(0, 128, (2, 16), generator=g).to(dev)
        engine.forward_backward({"input_ids": ids}, lm_loss)
        engine.optimizer_step()
    after = torch.cat([engine.local_piece(n).reshape(-1).view(torch.int16) for n in names])
    masters = torch.cat([engine._master_piece(n).reshape(-1).to(torch.bfloat16).view(torch.int16) for n in names])
    size, delta, count = rec.take(0, 1).finish()
    out = {"cast_exact": bool(torch.equal(after, masters)), "changed": int((before != after).sum()), "count": count, "words": before.numel()}
    if size is not None:
        patch = codec.decode(rec._states[0].out[:size], at, 2)
        image = before.clone()
        image[patch.positions.long()] = patch.values.view(torch.int16)
        out["patch_exact"] = bool(torch.equal(image, after))
        out["sum_exact"] = bool(torch.equal(codec.checksum(before.view(torch.uint8), 2) + delta, codec.checksum(after.view(torch.uint8), 2)))
    return out
