"""FSDP2TrainEngine on 2 real gloo ranks: parity with unsharded training, names, dtypes, sync, checkpoints.

The unsharded reference replays exactly what data-parallel FSDP2 computes: each rank's micro-batch
through the same model, gradients summed then halved (FSDP2's reduce-scatter average), the same
fp64 grad norm and clipping, the same AdamW. With one thread per process (tests/_trainer_mp.py),
the weights must match bit for bit.
"""

from __future__ import annotations

import copy
import math
import os
import tempfile

import pytest
import torch

from tests._trainer_mp import run_ranks, world_group

pytestmark = pytest.mark.timeout(300)

STEPS = 3
MICRO = 2  # sequences per rank per step
SEQ = 12


def tiny_config(kind: str = "qwen2", tie: bool = False):  # noqa: ANN201 - transformers config
    from transformers import Qwen2Config, Qwen3MoeConfig

    if kind == "qwen2":
        return Qwen2Config(
            vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tie, attn_implementation="eager",
        )
    return Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=64, tie_word_embeddings=tie, attn_implementation="eager",
    )


def build_model(kind: str = "qwen2", tie: bool = False, seed: int = 0) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(kind, tie), dtype=torch.float32)


def batches(world_size: int, seed: int = 1234) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (world_size * MICRO, SEQ), generator=g) for _ in range(STEPS * 2)]


def lm_loss(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    ids = batch["input_ids"]
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def engine_config(**kw):  # noqa: ANN201
    from ckpt_engine.trainer.engines.fsdp2 import FSDP2Config

    base = dict(lr=3e-3, weight_decay=0.01, max_grad_norm=1.0, warmup_steps=1, total_steps=8, wire_dtype=None)
    base.update(kw)
    return FSDP2Config(**base)


def collect(engine) -> dict[str, torch.Tensor]:  # noqa: ANN001
    return {n: t.detach().clone() for n, t in engine.source.iter_weights()}


def reference_step(model: torch.nn.Module, opt, sched, cfg, micro: list[torch.Tensor]) -> tuple[float, float]:  # noqa: ANN001
    """What FSDP2 over len(micro) ranks computes, without parallelism."""
    losses = []
    for ids in micro:
        loss = lm_loss(model(input_ids=ids, use_cache=False).logits, {"input_ids": ids})
        loss.backward()
        losses.append(loss.item())
    params = [p for p in model.parameters() if p.grad is not None]
    for p in params:
        p.grad.div_(len(micro))
    sq = torch.zeros((), dtype=torch.float64)
    for p in params:
        sq += torch.linalg.vector_norm(p.grad, dtype=torch.float64).square()
    norm = math.sqrt(sq.item())
    coef = cfg.max_grad_norm / (norm + 1e-6)
    if coef < 1.0:
        torch._foreach_mul_([p.grad for p in params], coef)
    opt.step()
    opt.zero_grad(set_to_none=True)
    sched.step()
    return sum(losses) / len(losses), norm


def make_reference(model: torch.nn.Module, cfg):  # noqa: ANN001, ANN201
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, cfg.lr_factor)


def train(engine, data: list[torch.Tensor], rank: int, steps: range) -> list[float]:  # noqa: ANN001
    losses = []
    for s in steps:
        ids = data[s][rank * MICRO : (rank + 1) * MICRO]
        losses.append(engine.forward_backward({"input_ids": ids}, lm_loss)["loss"])
        engine.optimizer_step()
        engine.lr_scheduler_step()
    return losses


# --- parity ---------------------------------------------------------------------------------------


def _parity_worker(rank: int, world_size: int) -> dict:
    from ckpt_engine.trainer.engines.fsdp2 import FSDP2TrainEngine

    model = build_model()
    ref = copy.deepcopy(model)
    cfg = engine_config()
    engine = FSDP2TrainEngine(model, config=cfg, process_group=world_group())
    initial = collect(engine)
    data = batches(world_size)
    losses, norms = [], []
    for s in range(STEPS):
        ids = data[s][rank * MICRO : (rank + 1) * MICRO]
        losses.append(engine.forward_backward({"input_ids": ids}, lm_loss)["loss"])
        norms.append(engine.optimizer_step())
        engine.lr_scheduler_step()
    exported = collect(engine)
    out = {"losses": losses, "norms": norms, "names": [s.name for s in engine.source.metadata()], "is_sender": engine.source.is_sender,
           "lr": engine.lr}
    if rank == 0:
        ref_init = {k: v.clone() for k, v in ref.state_dict().items()}
        opt, sched = make_reference(ref, cfg)
        ref_losses, ref_norms = [], []
        for s in range(STEPS):
            micro = [data[s][r * MICRO : (r + 1) * MICRO] for r in range(world_size)]
            loss, norm = reference_step(ref, opt, sched, cfg, micro)
            ref_losses.append(loss)
            ref_norms.append(norm)
        out.update(ref_losses=ref_losses, ref_norms=ref_norms, ref_names=list(ref.state_dict()), ref_lr=opt.param_groups[0]["lr"])
        out["tensors"] = {**{f"exp/{k}": v for k, v in exported.items()}, **{f"ref/{k}": v for k, v in ref.state_dict().items()},
                          **{f"init/{k}": v for k, v in initial.items()}, **{f"refinit/{k}": v for k, v in ref_init.items()}}
    return out


def test_fsdp2_training_matches_unsharded_bit_for_bit(worker_runs: dict) -> None:
    r0, r1 = _part(worker_runs, "parity")
    assert r0["is_sender"] and not r1["is_sender"]
    assert r0["names"] == r1["names"] == r0["ref_names"]  # HF checkpoint names, state-dict order
    assert not any("_fsdp" in n or "_orig_mod" in n or "_checkpoint_wrapped" in n for n in r0["names"])
    t = r0["tensors"]
    for name in r0["names"]:
        assert torch.equal(t[f"init/{name}"], t[f"refinit/{name}"]), f"initial {name}"
        assert t[f"exp/{name}"].dtype == torch.float32
        assert torch.equal(t[f"exp/{name}"], t[f"ref/{name}"]), f"after {STEPS} steps: {name}"
        assert not torch.equal(t[f"exp/{name}"], t[f"init/{name}"]) or "norm" in name, f"{name} did not train"
    assert r0["losses"] == pytest.approx(r0["ref_losses"], rel=1e-6, abs=1e-6)
    assert r0["losses"] == r1["losses"]
    assert r0["norms"] == pytest.approx(r0["ref_norms"], rel=1e-9)
    assert any(n > 1.0 for n in r0["norms"]), "clipping was never exercised"
    assert r0["lr"] == r0["ref_lr"]


# --- wire dtype, MoE checkpoint names, tied embeddings --------------------------------------------


def _unfused_reference(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The HF checkpoint form of an in-memory transformers-5 MoE model, written out by hand."""
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name.removesuffix("gate_up_proj")
            for e in range(t.shape[0]):
                gate, up = t[e].chunk(2, dim=0)
                out[f"{base}{e}.gate_proj.weight"], out[f"{base}{e}.up_proj.weight"] = gate, up
        elif name.endswith("mlp.experts.down_proj"):
            base = name.removesuffix("down_proj")
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e]
        elif not (name == "lm_head.weight" and model.config.tie_word_embeddings):
            out[name] = t
    return out


def _moe_worker(rank: int, world_size: int) -> dict:
    from ckpt_engine.trainer.engines.fsdp2 import FSDP2TrainEngine

    model = build_model("qwen3_moe", tie=True)
    ref = copy.deepcopy(model)
    engine = FSDP2TrainEngine(model, config=engine_config(wire_dtype="bfloat16"), process_group=world_group())
    specs = engine.source.metadata()
    exported = collect(engine)
    out = {"specs": [[s.name, s.dtype, list(s.shape)] for s in specs]}
    if rank == 0:
        expected = _unfused_reference(ref)
        out["expected_names"] = list(expected)
        out["tensors"] = {**{f"exp/{k}": v for k, v in exported.items()}, **{f"ref/{k}": v for k, v in expected.items()}}
    return out


def test_fsdp2_moe_checkpoint_names_bf16_wire_keep_fp32_router_tied(worker_runs: dict) -> None:
    r0, r1 = _part(worker_runs, "moe")
    assert r0["specs"] == r1["specs"]
    names = [s[0] for s in r0["specs"]]
    assert names == r0["expected_names"]
    assert "lm_head.weight" not in names  # tied: HF checkpoints hold embed_tokens only
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in names
    assert not any("gate_up_proj" in n or n.endswith("experts.down_proj") for n in names)
    t = r0["tensors"]
    for name, dtype, shape in r0["specs"]:
        want = "float32" if name.endswith("mlp.gate.weight") else "bfloat16"
        assert dtype == want, name
        got = t[f"exp/{name}"]
        assert str(got.dtype) == f"torch.{want}" and list(got.shape) == shape, name
        assert torch.equal(got, t[f"ref/{name}"].to(got.dtype)), name


# --- sync into a reference rollout process ---------------------------------------------------------


def _sync_worker(rank: int, world_size: int, ref: dict) -> dict:
    from ckpt_engine.config import CheckpointEngineConfig
    from ckpt_engine.rollout_adapters.torch_ref import TorchRefRollout
    from ckpt_engine.sync.api import sync_rollout_weights
    from ckpt_engine.trainer.engines.fsdp2 import FSDP2TrainEngine

    model = build_model(tie=True)
    engine = FSDP2TrainEngine(model, config=engine_config(wire_dtype="bfloat16"), process_group=world_group())
    data = batches(world_size)
    train(engine, data, rank, range(2))
    expected = collect(engine)
    rollouts = [TorchRefRollout("ref0", ref["host"], ref["port"], None, 120, token=ref["token"])] if rank == 0 else None
    cfg = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.05, timeout_s=60, verify=True)
    try:
        report = sync_rollout_weights(engine.source, rollouts, version=7, config=cfg)
        out: dict = {"report": None if report is None else {"version": report.version, "tensors": report.tensors}}
        if rank == 0:
            assert rollouts is not None
            got = {n: rollouts[0].get_tensor(n) for n in expected}
            out["tensors"] = {**{f"exp/{k}": v for k, v in expected.items()}, **{f"got/{k}": v for k, v in got.items()}}
        return out
    finally:
        if rollouts:
            from ckpt_engine.sync.api import _sessions

            for s in list(_sessions.values()):
                s.close()
            for r in rollouts:
                r.close()


def test_fsdp2_sync_into_torch_ref_rollout_bit_exact():
    from refengines import spawn_engine

    with tempfile.TemporaryDirectory() as d:
        tiny_config(tie=True).save_pretrained(d)
        ref = spawn_engine("ref0", model_dir=d, dtype="bfloat16", timeout_s=120)  # a receiver process of its own
        try:
            r0, r1 = run_ranks(_sync_worker, ref={"host": ref.rpc.host, "port": ref.rpc.port, "token": ref.token})
        finally:
            ref.close()
    assert r0["report"] == {"version": 7, "tensors": len([k for k in r0["tensors"] if k.startswith("exp/")])}
    assert r1["report"] is None
    t = r0["tensors"]
    for key in [k for k in t if k.startswith("exp/")]:
        name = key[4:]
        assert t[key].dtype == torch.bfloat16
        assert torch.equal(t[f"got/{name}"], t[key]), name


# --- checkpoint: save -> load -> continue == uninterrupted ----------------------------------------


def _resume_worker(rank: int, world_size: int, ckpt_dir: str) -> dict:
    from ckpt_engine.trainer.engines.fsdp2 import FSDP2TrainEngine

    data = batches(world_size)
    cfg = engine_config()
    a = FSDP2TrainEngine(build_model(), config=cfg, process_group=world_group())
    losses_a = train(a, data, rank, range(2))
    a.save_checkpoint(ckpt_dir)
    losses_a += train(a, data, rank, range(2, 4))
    uninterrupted = collect(a)

    b = FSDP2TrainEngine(build_model(seed=99), config=cfg, process_group=world_group())  # different init
    b.load_checkpoint(ckpt_dir)
    assert b.global_step == 2
    losses_b = train(b, data, rank, range(2, 4))
    resumed = collect(b)
    out = {"losses_a": losses_a, "losses_b": losses_b, "lr": [a.lr, b.lr]}
    if rank == 0:
        out["tensors"] = {**{f"a/{k}": v for k, v in uninterrupted.items()}, **{f"b/{k}": v for k, v in resumed.items()}}
    return out


def test_fsdp2_checkpoint_resume_equals_uninterrupted(worker_runs: dict) -> None:
    r0, _ = _part(worker_runs, "resume")
    t = r0["tensors"]
    names = [k[2:] for k in t if k.startswith("a/")]
    for name in names:
        assert torch.equal(t[f"a/{name}"], t[f"b/{name}"]), name
    assert r0["losses_a"][2:] == r0["losses_b"]
    assert r0["lr"][0] == r0["lr"][1]


# --- one pair of ranks for parity, MoE names and resume ---------------------------------------------


def _parts_worker(rank: int, world_size: int, ckpt_dir: str) -> dict:
    """Parity, MoE names and resume in turn on one pair of ranks (each rank imports transformers
    and builds its first optimizer once, not once per test); each part's tensors keep its prefix."""
    out: dict = {"tensors": {}}
    for part, fn, kwargs in (("parity", _parity_worker, {}), ("moe", _moe_worker, {}), ("resume", _resume_worker, {"ckpt_dir": ckpt_dir})):
        res = fn(rank, world_size, **kwargs)
        out["tensors"].update({f"{part}:{k}": v for k, v in res.pop("tensors", {}).items()})
        out[part] = res
    return out


@pytest.fixture(scope="module")
def worker_runs() -> dict:
    """What both ranks returned from `_parts_worker` (the tests only read it)."""
    with tempfile.TemporaryDirectory() as ckpt:
        r0, r1 = run_ranks(_parts_worker, ckpt_dir=os.path.join(ckpt, "step2"))
    return {"ranks": (r0, r1)}


def _part(runs: dict, part: str) -> tuple[dict, dict]:
    """One part's results per rank, its tensors under their own names again."""
    parts = []
    for r in runs["ranks"]:
        res = dict(r[part])
        prefix = f"{part}:"
        tensors = {k[len(prefix):]: v for k, v in r.get("tensors", {}).items() if k.startswith(prefix)}
        if tensors:
            res["tensors"] = tensors
        parts.append(res)
    return parts[0], parts[1]


# --- bad input -------------------------------------------------------------------------------------


def _solo_group() -> torch.distributed.ProcessGroup:
    import datetime

    store = torch.distributed.HashStore()
    return torch.distributed.ProcessGroupGloo(store, 0, 1, datetime.timedelta(seconds=10))


def test_unknown_backend_is_a_clear_error():
    from ckpt_engine.trainer.engines.base import TrainEngineRegistry

    with pytest.raises(ValueError, match=r"unknown trainer backend 'fsdp3'; known: fsdp2, megatron, megatron_fsdp"):
        TrainEngineRegistry.get("fsdp3")


def test_fused_experts_without_a_rule_fail_before_sharding():
    from ckpt_engine.trainer.engines.fsdp2 import FSDP2TrainEngine

    model = build_model("qwen3_moe")
    model.config.model_type = "my_new_moe"  # a family with no FusedExpertRule
    with pytest.raises(ValueError, match=r"cannot export fused MoE experts of model_type 'my_new_moe'.*hf_names.py"):
        FSDP2TrainEngine(model, config=engine_config(), process_group=_solo_group())
    assert not any(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters())


def test_engine_needs_an_explicit_group_and_a_hf_model():
    from ckpt_engine.trainer.engines.fsdp2 import FSDP2Config, FSDP2TrainEngine

    with pytest.raises(ValueError, match="exactly one of process_group or mesh"):
        FSDP2TrainEngine(build_model(), config=engine_config())
    with pytest.raises(ValueError, match="wraps Hugging Face models"):
        FSDP2TrainEngine(torch.nn.Linear(2, 2), process_group=_solo_group())
    with pytest.raises(ValueError, match=r"FSDP2Config.wire_dtype must be one of"):
        FSDP2Config(wire_dtype="int8")
    with pytest.raises(ValueError, match=r"total_steps \(1\) must exceed warmup_steps \(2\)"):
        FSDP2Config(warmup_steps=2, total_steps=1)
