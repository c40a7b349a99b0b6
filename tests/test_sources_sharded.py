"""Each sharded source built from a sharded model alone: no training engine, no training step.

A verl / NeMo-RL / torchtitan user shards the model themselves and takes the source:
- `FSDP2Source` over a tiny Qwen2-MoE (tied embeddings, fused experts, a persistent router buffer)
  that torch's own `fully_shard` sharded over 2 real gloo ranks;
- `MegatronSource` over a megatron-core `GPTModel` (tiny Qwen2) built at TP=2 and at PP=2 on
  2 real gloo ranks, filled from the HF weights by the exporter's own loader.

On every rank: `metadata()` names every HF checkpoint tensor with its wire dtype and global shape,
`iter_weights()` yields the unsharded model's tensors bit for bit (in the wire dtype), and for
many senders each rank's pieces are exactly its bytes of those tensors, the owners covering each
tensor once. Megatron-FSDP and Megatron-FSDP2 need CUDA: their sources are only imported here.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests._trainer_mp import cases_in_one_run, run_ranks

pytestmark = pytest.mark.timeout(300)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _check(source: Any, reference: dict[str, torch.Tensor], rank: int, walks: bool) -> dict[str, Any]:
    """Compare a source with the unsharded reference on this rank: names, wire dtypes, shapes, the
    walk (when this rank yields it) and this rank's pieces, every comparison on the wire bytes."""
    specs = source.metadata()
    wire = {s.name: getattr(torch, s.dtype) for s in specs}
    out: dict[str, Any] = {
        "names": [s.name for s in specs], "reference": list(reference),
        "dtypes": {s.name: s.dtype for s in specs},
        "bad_shapes": [s.name for s in specs if s.name in reference and tuple(s.shape) != tuple(reference[s.name].shape)],
        "sender": [source.is_sender, source.sender_index, source.num_senders, getattr(source, "sends", True)],
    }
    walked = []
    for name, t in source.iter_weights():  # a collective walk: every rank walks it to its end
        if walks and (t.dtype != wire[name] or not torch.equal(_bits(t), _bits(reference[name].to(wire[name])))):
            walked.append(name)
    out["bad_weights"] = walked
    owners = source.owners()
    bad_pieces, mine = [], []
    source.begin_pieces()
    try:
        for s in specs:
            shards = owners.get(s.name)
            if shards is None:  # replicated: every rank holds all of it
                want = _bits(reference[s.name].to(wire[s.name]))
            else:
                own = [sh for sh in shards if sh.sender == source.sender_index]
                if not own:
                    continue
                if not getattr(source, "sends", True):
                    source.assist_piece(s.name)  # a TP helper walks its sender's gathers
                    continue
                want = _bits(reference[s.name].to(wire[s.name]))[own[0].start : own[0].stop]
            mine.append(s.name)
            piece = source.local_piece(s.name)
            if piece.dtype != wire[s.name] or not torch.equal(_bits(piece), want):
                bad_pieces.append(s.name)
    finally:
        source.end_pieces()
    out["bad_pieces"], out["mine"] = bad_pieces, mine
    gaps = []
    for s in specs:  # every owned tensor's shards tile it once, in order
        shards = sorted(owners.get(s.name, []), key=lambda sh: sh.start)
        if shards and ([sh.start for sh in shards] != [0, *[sh.stop for sh in shards[:-1]]] or shards[-1].stop != s.nbytes):
            gaps.append(s.name)
    out["gaps"], out["replicated"] = gaps, [s.name for s in specs if s.name not in owners]
    return out


# --- FSDP2: torch's fully_shard, then the source ----------------------------------------------------


def _fsdp2_worker(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from ckpt_engine.sources.fsdp2 import FSDP2Source
    from tests.test_fsdp2_shards import tiny_moe
    from tests.test_trainer_megatron_ep import hf_checkpoint_state

    model = tiny_moe(tie=True)
    reference = {k: v for k, v in hf_checkpoint_state(model, model.config.model_type).items() if k != "lm_head.weight"}
    group = dist.new_group(list(range(world_size)))  # the model's own group, not the default one
    mesh = DeviceMesh.from_group(group, "cpu")
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    source = FSDP2Source(model, dtype=torch.bfloat16)  # the group is the mesh's
    out = _check(source, reference, rank, walks=True)
    out["group"] = dist.get_process_group_ranks(source.process_group)
    out["group_is_mesh"] = source.process_group is mesh.get_group()
    explicit = FSDP2Source(model, process_group=group, dtype="float32", keep_fp32=())
    out["explicit"] = _check(explicit, reference, rank, walks=True)
    with pytest.raises(ValueError, match="sharded with fully_shard"):
        FSDP2Source(tiny_moe(tie=True))
    return out


def test_fsdp2_source_from_a_sharded_model_is_bit_exact() -> None:
    """FSDP2Source over a model torch's fully_shard sharded (2 gloo ranks, no engine, no step):
    names, wire dtypes (bf16, fp32 router), the gathering walk and each rank's row pieces are the
    unsharded model's, bit for bit; a tensor with rows on one rank only is owned by it alone."""
    ranks = run_ranks(_fsdp2_worker, 2, preload=("torch.distributed.fsdp", "transformers.models.qwen2_moe.modeling_qwen2_moe"))
    for rank, r in enumerate(ranks):
        for case in (r, r["explicit"]):
            assert case["names"] == case["reference"], rank  # every HF tensor once, in HF order, tied head dropped
            assert case["bad_shapes"] == case["bad_weights"] == case["bad_pieces"] == case["gaps"] == [], (rank, case)
            assert case["sender"] == [rank == 0, rank, 2, True]
        assert r["group"] == [0, 1] and r["group_is_mesh"]
        dtypes = r["dtypes"]
        assert dtypes["model.layers.0.mlp.gate.weight"] == "float32" and dtypes["model.embed_tokens.weight"] == "bfloat16"
        assert set(r["explicit"]["dtypes"].values()) == {"float32"}
        assert "model.layers.0.mlp.gate.e_score_correction_bias" in r["replicated"]  # a buffer: never sharded
    assert set(ranks[0]["mine"]) | set(ranks[1]["mine"]) == set(ranks[0]["names"])
    assert set(ranks[0]["mine"]) != set(ranks[1]["mine"])  # each rank sends its own, not everything


# --- Megatron: a GPTModel built at TP=2 or PP=2, then the source -----------------------------------


def _megatron_worker(rank: int, world_size: int, tp: int, pp: int) -> dict[str, Any]:
    from megatron.core import parallel_state as ps

    from ckpt_engine.sources.megatron import MegatronSource
    from ckpt_engine.trainer.engines.common import hf_model_from_config
    from ckpt_engine.trainer.engines.megatron import MegatronConfig, build_gpt_model
    from ckpt_engine.trainer.engines.megatron_load import load_hf
    from tests.test_trainer_megatron import hf_config

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    try:
        cfg = hf_config("qwen2")
        torch.manual_seed(0)
        hf = hf_model_from_config(cfg, torch.float32)
        with torch.no_grad():  # non-trivial norms, so a swapped norm would show
            for n, p in hf.named_parameters():
                if "norm" in n:
                    p.add_(torch.randn_like(p) * 0.1)
        reference = {k: v.clone() for k, v in hf.state_dict().items()}
        model = build_gpt_model(cfg, MegatronConfig())  # what a Megatron user builds; no engine, no optimizer
        source = MegatronSource(model, cfg, dtype=torch.bfloat16)
        load_hf(source.exporter, reference)
        return _check(source, reference, rank, walks=source.is_sender)
    finally:
        ps.destroy_model_parallel()


def test_megatron_source_from_a_gpt_model_is_bit_exact() -> None:
    """MegatronSource over a GPTModel at TP=2 (one sender, the other TP rank its helper) and at
    PP=2 (one sender per stage): names, bf16 wire, rank 0's walk and each sender's whole-tensor
    pieces are the HF model's, bit for bit."""
    cases = {"tp2": {"tp": 2, "pp": 1}, "pp2": {"tp": 1, "pp": 2}}
    r0, r1 = run_ranks(cases_in_one_run, worker=_megatron_worker, cases=cases, preload=("megatron.core",))
    for case in cases:
        a, b = r0[case], r1[case]
        for r in (a, b):
            assert sorted(r["names"]) == sorted(r["reference"]), case
            assert r["bad_shapes"] == r["bad_weights"] == r["bad_pieces"] == r["gaps"] == [], (case, r)
            assert set(r["dtypes"].values()) == {"bfloat16"}, case
    assert r0["tp2"]["sender"] == [True, 0, 1, True] and r1["tp2"]["sender"] == [False, 0, 1, False]
    assert sorted(r0["tp2"]["mine"]) == sorted(r0["tp2"]["names"]) and r1["tp2"]["mine"] == []
    assert r0["pp2"]["sender"] == [True, 0, 2, True] and r1["pp2"]["sender"] == [False, 1, 2, True]
    assert sorted(r0["pp2"]["mine"] + r1["pp2"]["mine"]) == sorted(r0["pp2"]["names"]) and r1["pp2"]["mine"]


def test_every_source_imports_without_the_trainer() -> None:
    """Each source imports on CPU (Megatron-FSDP(2) say why they cannot run only when used) and
    none of them imports the demo trainer, in a fresh interpreter."""
    pytest.importorskip("megatron.core")
    code = (
        "import sys\n"
        "for m in ('fsdp2', 'megatron', 'megatron_fsdp', 'megatron_fsdp2'):\n"
        "    __import__(f'ckpt_engine.sources.{m}')\n"
        "print(sorted(n for n in sys.modules if n.startswith('ckpt_engine.trainer')))\n"
    )
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"
