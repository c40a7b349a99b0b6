"""Region delivery at the engine level (real processes, real gloo groups): TP=2 and EP=2 receivers
from 1 and 2 senders hold exactly their slices, bit for bit, after a dense and two delta syncs,
and take in only their share; a corrupt region patch is caught, named, and leaves the old weights."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ckpt_engine.delta.request import DeltaRequest
from ckpt_engine.pipeline.region_assembly import RegionAssembly
from ckpt_engine.pipeline.region_groups import RegionGroups, receive_regions, send_regions
from ckpt_engine.planning.receive_sets import cut_region
from ckpt_engine.engine import Rendezvous, TransferError
from tamper import GlooEngine
from ranks import run_ranks
from regionranks import layout, moe_specs, owners, qwen2_specs, weights

BUCKET = 16 << 10  # small buckets: the larger pieces split over several


class _Tampered(GlooEngine):
    """Flips one bit of a patch frame of the third sync."""

    syncs = 0

    def _tamper_hook(self, bucket_index: int, message: torch.Tensor) -> None:
        if self.syncs == 2 and bucket_index == 0 and message.numel() > 64:
            message[48] ^= 0x04


def _rank(rank: int, rdzv: Rendezvous, kind: str, senders: int, receivers: int, corrupt: bool) -> dict[str, Any]:
    specs = qwen2_specs() if kind == "tp" else moe_specs()
    by_name = {s.name: s for s in specs}
    lay = layout(kind, specs, receivers)
    own = owners(specs, senders)
    engines: list[GlooEngine] = []

    def make() -> GlooEngine:
        cls = _Tampered if corrupt and rank == 0 else GlooEngine
        engines.append(cls(bucket_size_bytes=BUCKET, timeout_s=30, solo_bytes=0))
        return engines[-1]

    planner = GlooEngine(bucket_size_bytes=BUCKET, timeout_s=30, solo_bytes=0)
    manifests = {s.index: planner.plan([p.spec for p in s.pieces], num_senders=senders, owners=s.owners(by_name, own)) for s in lay.sets}
    groups = RegionGroups(rdzv, rank, lay.digest, [(s.index, s.members) for s in lay.sets], make)
    groups.join()
    out: dict[str, Any] = {"errors": [], "ok": [], "slot_memories": len({e.transport.buffers[0].data_ptr() for e in engines})}
    receiver = rank - senders
    held = lay.held[receiver] if receiver >= 0 else {}
    tensors = {n: torch.zeros(cut_region(torch.empty(by_name[n].shape, device="meta"), rs[0]).shape) for n, rs in held.items()}
    asm = RegionAssembly(held, (p for s in lay.sets_of(receiver) for p in s.pieces), by_name) if receiver >= 0 else None
    for v in range(3):
        for e in engines:
            if isinstance(e, _Tampered):
                e.syncs = v
        w = weights(specs, v)
        delta = DeltaRequest(v > 0, v if v > 0 else None, v + 1)
        if rank < senders:
            local = dict(w)
            for name, shards in (own or {}).items():
                for sh in shards:
                    if sh.sender == rank:
                        row = by_name[name].nbytes // by_name[name].shape[0]
                        local[name] = w[name][sh.start // row : sh.stop // row]
            shapes = {s.name: s.shape for s in specs}
            try:
                stats = send_regions(groups, lay.sets, manifests, local, shapes, owners=own, delta=delta)
                out["sent_bytes"] = stats.bytes
            except Exception as exc:
                out["errors"].append(f"v{v}: {exc}")
            continue
        assert asm is not None
        before = {n: t.clone() for n, t in tensors.items()}
        got = 0
        try:
            for items in receive_regions(groups, manifests, asm, tensors, delta=delta):
                for name, region, t in items:
                    assert region == held[name][0], (name, region)
                    tensors[name].copy_(t)
                    got += t.numel() * t.element_size()
        except TransferError as exc:
            out["errors"].append(f"v{v}: {exc}")
            out["kept_old"] = all(torch.equal(before[n], tensors[n]) for n in tensors)
            break
        out["received_bytes"] = got
        bad = [n for n, rs in held.items() if not torch.equal(tensors[n], cut_region(w[n], rs[0]).contiguous())]
        out["ok"].append(not bad)
        out.setdefault("bad", []).extend(bad[:3])
    out["model_bytes"] = sum(s.nbytes for s in specs)
    out["held_bytes"] = sum(t.numel() * 4 for t in tensors.values())
    out["shapes"] = {n: list(t.shape) for n, t in tensors.items() if "layers.0." in n or "lm_head" in n}
    groups.close()
    return out


@pytest.mark.parametrize("kind", ["tp", "ep"])
@pytest.mark.parametrize("senders", [1, 2])
def test_receivers_hold_their_slices_bit_for_bit(kind: str, senders: int) -> None:
    res = run_ranks(_rank, senders + 2, num_senders=senders, timeout_s=90, kind=kind, senders=senders, receivers=2, corrupt=False)
    for r in res[:senders]:
        assert r["slot_memories"] == 2  # sets {0} and {1} stream side by side, each from its own slots; {0, 1} reuses one
    for r in res[senders:]:
        assert r["slot_memories"] == 1  # a receiver's sets share one set of slots
    for r in res[:senders]:
        assert r["errors"] == []
    for r in res[senders:]:
        assert r["errors"] == [] and r["ok"] == [True, True, True], r.get("bad")
        # TP=2: half of nearly everything; EP=2: half of the experts, the rest whole
        assert r["held_bytes"] <= (0.55 if kind == "tp" else 0.72) * r["model_bytes"]
        assert r["received_bytes"] == r["held_bytes"]
    if kind == "tp":
        shapes = res[senders]["shapes"]
        assert shapes["model.layers.0.self_attn.q_proj.weight"] == [32, 64]
        assert shapes["model.layers.0.self_attn.k_proj.weight"] == [16, 64]  # one KV head: both ranks hold it
        assert shapes["model.layers.0.self_attn.o_proj.weight"] == [64, 32]
        assert shapes["model.layers.0.mlp.down_proj.weight"] == [64, 48]
        assert shapes["lm_head.weight"] == [80, 64]
    else:
        assert "model.layers.0.mlp.experts.0.up_proj.weight" in res[senders]["shapes"]
        assert "model.layers.0.mlp.experts.2.up_proj.weight" in res[senders + 1]["shapes"]
        assert "model.layers.0.mlp.experts.2.up_proj.weight" not in res[senders]["shapes"]


def test_corrupt_region_patch_is_named_and_leaves_old_weights() -> None:
    res = run_ranks(_rank, 3, timeout_s=90, kind="tp", senders=1, receivers=2, corrupt=True)
    failed = [r for r in res[1:] if r["errors"]]
    assert failed, res
    for r in failed:
        assert "checksum mismatch" in r["errors"][0] or "malformed patch" in r["errors"][0]
        assert "receiver set" in r["errors"][0] and " holding " in r["errors"][0], r["errors"][0]  # names the bucket's regions
        assert r["kept_old"] and r["ok"] == [True, True]
