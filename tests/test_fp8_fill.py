"""A replayed FP8 walk writes each bucket into the sender's slot itself (issue 41), with the bytes of
the packed path.

Real processes and a gloo group: one sender, one receiver, several syncs of the same stable source
whose values change in place between them (an optimizer step). The first sync records the walk
and packs; the second makes each bucket's fill (checked as the sender checks) and fills; later
ones replay the fills. The receiver compares every tensor of every sync with the eager recipe's
bytes. The grouped kernel is CUDA's; here `EagerGroups` stands in (the eager recipe run when a
launch runs, into the slot at the fill's offsets). The model has weights the grouped kernel does
not take (quantized alone), a tensor larger than a bucket (chunks: a bucket the sender does not
offer) and unquantized tensors between weights; a weight whose scales open the next bucket comes
from the bucket size. A changed source (a replaced tensor, the same one on new memory) must fall
back to the packed path for the rest of that walk, and fill again two syncs later; with
`fill_slots` off every walk replays and the sender packs.
"""

from __future__ import annotations

from itertools import chain
from typing import Any

import pytest
import torch

import ckpt_engine.sources.fp8 as wire
from ckpt_engine.engine import Rendezvous
from ckpt_engine.registry import CheckpointEngineRegistry
from ckpt_engine.sources.base import StateDictSource, WatchedWeights
from ranks import run_ranks
from test_fp8_walk_paths import EagerGroups, _eager

SYNCS = 6
BUCKET = 2 * 10240 + 256
"""Two experts' codes and one's scales a bucket (256-byte alignment): where a bucket starts with an
expert, the next one's codes end it and their scales open the next bucket."""
CHANGED = "model.layers.1.mlp.experts.3.up_proj.weight"


def _model() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    sd: dict[str, torch.Tensor] = {"model.embed_tokens.weight": (torch.randn(64, 128, generator=g) * 0.02).bfloat16()}
    for layer in range(2):
        p = f"model.layers.{layer}."
        sd[p + "input_layernorm.weight"] = torch.randn(160, generator=g).bfloat16()
        sd[p + "self_attn.o_proj.weight"] = (torch.randn(64, 200, generator=g) * 0.02).bfloat16()  # 200 columns: alone
        for i in range(10):
            sd[p + f"mlp.experts.{i}.up_proj.weight"] = (torch.randn(64, 160, generator=g) * 0.02).bfloat16()
        sd[p + "mlp.gate.weight"] = (torch.randn(8, 160, generator=g) * 0.02).bfloat16()
        if layer == 0:
            sd[p + "self_attn.q_proj.weight"] = (torch.randn(300, 256, generator=g) * 0.02).bfloat16()  # chunks
    sd["model.norm.weight"] = torch.randn(160, generator=g).bfloat16()
    return sd


def _step(model: dict[str, torch.Tensor], k: int, change: str | None) -> None:
    """Sync k's values, the same on both ranks; the change (if any) before sync 3."""
    if k == 3 and change == "replaced":
        model[CHANGED] = model[CHANGED].clone()
    elif k == 3 and change == "moved":
        model[CHANGED].data = model[CHANGED].data.clone()
    for t in model.values():
        t.mul_(-1.5)


LEND = {"solo_bytes": 16384, "group_max_tensors": 64}
"""Buckets posted a message per entry, as NCCL posts them, and the embedding (16 KiB) in a bucket of
its own: the tensors sent as they are travel from their own memory (`Ask.lend`)."""


def _rank(rank: int, rdzv: Rendezvous, *, change: str | None) -> dict[str, Any]:
    kernel = EagerGroups()
    wire._group_kernel = lambda w: kernel  # this process's walks take the grouped path, as on CUDA
    kwargs = LEND if change == "lent" else {}
    engine = CheckpointEngineRegistry.new(rdzv.backend, bucket_size_bytes=BUCKET, timeout_s=rdzv.timeout_s, **kwargs)
    engine.init_process_group(rdzv, rank)
    model = _model()
    manifest = engine.plan(wire.Fp8WireSource(StateDictSource(model)).metadata())
    walks: list[dict[str, int]] = []
    bad: list[str] = []
    try:
        for k in range(SYNCS):
            _step(model, k, change)
            if rank == 0:
                src = wire.Fp8WireSource(StateDictSource(model))
                src.fill_slots = change != "no fills"  # nothing but the sender reads this walk
                engine.send_weights(manifest, WatchedWeights(src.iter_weights(), fresh=True), stable=False)
                walks.append(dict(vars(src.last_walk)))
                continue
            expected = dict(_eager(model))
            seen = set()
            for name, t in chain.from_iterable(engine.receive_buckets(manifest)):
                seen.add(name)
                want = expected[name]
                if t.dtype != want.dtype or t.shape != want.shape or not torch.equal(t.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)):
                    bad.append(f"sync {k}: {name}")
            bad += [f"sync {k}: {n} not received" for n in sorted(set(expected) - seen)]
        whole = sum(all(e.is_whole for e in b.entries) for b in manifest.buckets)
        return {"walks": walks, "bad": bad, "buckets": len(manifest.buckets), "whole": whole}
    finally:
        engine.finalize()


@pytest.mark.parametrize("change", [None, "replaced", "moved", "no fills", "lent"])
def test_a_replayed_walk_fills_the_send_buffer_with_the_packed_bytes(change: str | None) -> None:
    sender, receiver = run_ranks(_rank, 2, change=change)
    assert receiver["bad"] == []
    walks, whole = sender["walks"], receiver["whole"]
    if change == "lent":  # every filled walk lends what is sent as it is (embedding, 3 norms, 2 router gates)
        assert all(w["filled"] == whole and w["lent"] == 6 for w in walks[1:]), walks
        change = None
    else:  # one packed message a bucket: everything copied into the slot
        assert all(w["lent"] == 0 for w in walks), walks
    assert 3 < whole < receiver["buckets"]  # buckets of whole entries, and buckets of chunks between them
    quantized = 2 * 11 + 1
    assert all(w["grouped"] + w["alone"] == quantized for w in walks), walks
    assert walks[0]["filled"] == 0 and walks[0]["grouped"] > 0  # the first walk records (and the sender packs)
    if change == "no fills":  # `fill_slots` off (a check must see every tensor): replayed and packed
        assert all(w["filled"] == 0 for w in walks) and all(w["replayed"] == w["launches"] > 0 for w in walks[1:]), walks
        return
    assert walks[1]["filled"] == whole and walks[1]["replayed"] == 0  # the second makes the fills
    if change is None:
        assert all(w["filled"] == whole and w["replayed"] == w["launches"] > 0 for w in walks[2:]), walks
    else:  # sync 3 fills up to the changed tensor's bucket, packs the rest; 4 records anew, 5 makes the fills again
        assert walks[2]["filled"] == whole and 0 < walks[3]["filled"] < whole, walks
        assert walks[4]["filled"] == 0 and walks[5]["filled"] == whole and walks[5]["replayed"] == 0, walks
