"""Rank functions for multi-sender and delta transfers: shards of a deterministic model."""

from __future__ import annotations

from itertools import chain
from typing import Any

import torch

from ckpt_engine.engine import Rendezvous
from ckpt_engine.planning.ownership import row_shards
from ckpt_engine.registry import CheckpointEngineRegistry
from ckpt_engine.delta.request import DeltaRequest
from ckpt_engine.sources.base import spec_of
from roundtrip import mixed_state, same_bits


def even_rows(rows: int, senders: int) -> list[int]:
    """FSDP2's dim-0 split: ceil-sized shards, the last ones short or empty."""
    per = -(-rows // senders) if rows else 0
    out = []
    for s in range(senders):
        out.append(max(0, min(per, rows - s * per)))
    return out


_chains: dict[tuple[float, int], tuple[dict[str, torch.Tensor], Any, Any, list[dict[str, torch.Tensor]]]] = {}


def model_state(version: int, *, lr: float = 0.0, base_seed: int = 0) -> dict[str, torch.Tensor]:
    """Version 0: a mixed-dtype state; later versions: real AdamW steps of the float tensors
    (bf16 wire), so consecutive versions differ the way RL training makes them differ. Versions
    of one (lr, seed) chain are computed once per process, step by step."""
    if not version or not lr:
        return _base_state(base_seed)
    key = (lr, base_seed)
    if key not in _chains:
        sd = _base_state(base_seed)
        params = {k: v.clone().float().requires_grad_(True) for k, v in sd.items() if v.is_floating_point() and v.numel() and v.dim()}
        opt = torch.optim.AdamW(params.values(), lr=lr, weight_decay=0.0)
        _chains[key] = (sd, params, (opt, torch.Generator().manual_seed(100)), [sd])
    sd, params, (opt, g), done = _chains[key]
    while len(done) <= version:
        for p in params.values():
            p.grad = torch.randn(p.shape, generator=g) * 1e-3
        opt.step()
        nxt = dict(sd)
        for k, p in params.items():
            nxt[k] = p.detach().to(sd[k].dtype, copy=True)  # a snapshot: later steps must not change it
        done.append(nxt)
    return done[version]


def _base_state(base_seed: int) -> dict[str, torch.Tensor]:
    sd = mixed_state(base_seed, num_small=40)
    sd["wide"] = torch.randn(37, 300, generator=torch.Generator().manual_seed(5)) * 0.02  # rows split unevenly
    sd["router"] = torch.randn(3, 300, generator=torch.Generator().manual_seed(6))
    sd["nan_zero"] = torch.tensor([float("nan"), -0.0, 0.0, float("inf"), 1.0] * 20)
    return sd


def wire(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """bf16 wire for float tensors except the router (kept fp32), as trainers export."""
    return {k: (v.bfloat16() if v.is_floating_point() and k != "router" and v.dtype == torch.float32 else v).contiguous() for k, v in sd.items()}


def shard_rank(
    rank: int, rdzv: Rendezvous, *, bucket_size: int = 16 * 1024, versions: int = 3, lr: float = 0.0,
    delta: str = "off", corrupt: int | None = None, engine_kwargs: dict[str, Any] | None = None, full_every: int = 0,
    in_place: bool = False, touch: int | None = None, corrupt_skip: int = 0, corrupt_count: int = 1,
) -> dict[str, Any]:
    """Senders each send their dim-0 row block of every tensor of >= 2 dims (the rest whole, balanced
    by the planner); receivers check every tensor bit for bit after each version. With `delta`,
    version 0 seeds the bases and later versions travel as patches (`full_every`: a dense seed every
    that many syncs). `corrupt`: the sync (version) in which the first sender corrupts a patch
    (its first, or the one after `corrupt_skip` others: receivers have then applied earlier ones),
    and `corrupt_count` patches from there (their bucket indices in the sender's "tampered").
    `in_place`: receivers offer their own tensors as destinations (the loader's tensors are then
    the delta base); `touch`: before that sync, receivers change one word of their "wide" tensor
    outside any sync. After a failed sync a receiver reports whether its tensors still hold the
    previous version ("kept")."""
    senders = rdzv.num_senders
    dev = torch.device(f"cuda:{rank % torch.cuda.device_count()}") if rdzv.backend == "nccl" else torch.device("cpu")
    engine = CheckpointEngineRegistry.new(
        rdzv.backend, bucket_size_bytes=bucket_size, timeout_s=rdzv.timeout_s, device=dev, **(engine_kwargs or {})
    )
    tampered: list[int] = []
    if corrupt is not None and rank == 0:
        state = {"armed": False, "skip": corrupt_skip, "left": corrupt_count}

        def tamper(index: int, msg: torch.Tensor) -> None:
            if state["armed"] and msg.numel() > 40:  # a payload, not a frame header
                if state["skip"]:
                    state["skip"] -= 1
                    return
                msg[40] ^= 0x10
                tampered.append(index)
                state["left"] -= 1
                state["armed"] = state["left"] > 0

        engine._tamper_hook = tamper  # type: ignore[method-assign]
    engine.init_process_group(rdzv, rank)
    out: dict[str, Any] = {"bad": [], "errors": [], "stats": [], "tampered": tampered}
    base_id = None
    mine: dict[str, torch.Tensor] | None = None
    for version in range(versions):
        sd = {k: v.to(dev) for k, v in wire(model_state(version, lr=lr)).items()}
        specs = [spec_of(n, t) for n, t in sd.items()]
        owners = {s.name: row_shards(s, even_rows(s.shape[0], senders)) for s in specs if len(s.shape) >= 2}
        manifest = engine.plan(specs, num_senders=senders, owners=owners)
        request = None
        if delta != "off":
            patches = base_id is not None and not (full_every and version % full_every == 0)
            request = DeltaRequest(patches, base_id if patches else None, 1000 + version)
        if corrupt is not None and rank == 0:
            state["armed"] = version == corrupt
        try:
            if rank < senders:
                own = []
                for b in manifest.sender_buckets(rank):
                    for e in b.entries:
                        if own and own[-1][0] == e.name:
                            continue
                        full = sd[e.name].reshape(-1).view(torch.uint8)
                        start = next(x.chunk_offset for bb in manifest.sender_buckets(rank) for x in bb.entries if x.name == e.name)
                        size = sum(x.chunk_size for bb in manifest.sender_buckets(rank) for x in bb.entries if x.name == e.name)
                        sharded = e.name in owners
                        piece = full[start : start + size].view(sd[e.name].dtype) if sharded and size != e.nbytes else sd[e.name]
                        own.append((e.name, piece))
                stats = engine.send_weights(manifest, own, delta=request)
                out["stats"].append(dict(stats.extra, bytes=stats.bytes))
            elif in_place:
                if mine is None:
                    mine = {n: torch.zeros_like(t) for n, t in sd.items()}
                if touch is not None and version == touch:
                    mine["wide"].view(torch.int16).reshape(-1)[7] += 1
                for n, t in chain.from_iterable(engine.receive_buckets(manifest, mine, delta=request)):
                    if t.data_ptr() != mine[n].data_ptr() or not t.numel():
                        mine[n].copy_(t)
                out["bad"] += [f"v{version} {n}" for n in sd if not same_bits(mine[n], sd[n])]
                out["stats"].append(dict(getattr(engine, "last_delta_stats", {})))
            else:
                got = {n: t.clone() for n, t in chain.from_iterable(engine.receive_buckets(manifest, delta=request))}
                out["bad"] += [f"v{version} {n}" for n in sd if n not in got or not same_bits(got[n], sd[n])]
                out["stats"].append(dict(getattr(engine, "last_delta_stats", {})))
            base_id = request.new_id if request is not None else None
        except Exception as exc:
            out["errors"].append(f"v{version}: {type(exc).__name__}: {exc}")
            if mine is not None and version:
                before = {k: v.to(dev) for k, v in wire(model_state(version - 1, lr=lr)).items()}
                out["kept"] = [n for n in before if not same_bits(mine[n], before[n])]
            engine.finalize()
            if version + 1 < versions:
                raise RuntimeError(f"a failed sync needs a new group; this helper stops here: {out['errors']}") from exc
            break
        out["base_bytes"] = engine.delta_base_bytes
    engine.finalize()
    out["tensors"] = len(sd)
    return out
