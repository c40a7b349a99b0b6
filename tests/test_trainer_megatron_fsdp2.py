"""Megatron-FSDP2 engine (`trainer.backend: megatron_fsdp2`): clean refusals on CPU; on 2 GPUs (-m gpu)
parity with unsharded training, export exactness, one gather per unit, no stale unit, checkpoints.

Tolerance of the parity check (3 steps, fp32): the unsharded reference runs each rank's micro-batch
through one unsharded model and averages the gradients, which is what Megatron-FSDP2's
reduce-scatter (AVG) computes, but in another summation order, so gradients differ by fp32
rounding, |dg| <~ 1e-6 |g|. AdamW runs with eps = 1e-4 here, which makes its update Lipschitz in
the gradient (|d update| <= lr |dg| / eps per element): over 3 steps at lr 1e-3 with |g| <~ 1e-1
that bounds the weight difference near 3 * 1e-3 * 1e-7 / 1e-4 = 3e-6, so `ATOL = 2e-5` is met by
a correct engine, while any real fault (a unit stale by one step, rows in the wrong place, a
missing reduction) moves weights by about lr = 1e-3. (With Adam's usual eps = 1e-8, gradients
that are zero up to rounding, e.g. the key-projection bias, flip sign between the two orders and
move by 2 lr: no meaningful tolerance exists then.)

Megatron-FSDP2 schedules on CUDA streams, so everything past construction runs on the GPU machine
with the megatron-fsdp wheel on the path (bench/RESULTS.md says how it was run).
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

from tests._trainer_mp import lm_loss, run_ranks, world_group

pytestmark = pytest.mark.timeout(600)

STEPS = 3
MICRO = 2  # sequences per rank per step
SEQ = 16
ATOL = 2e-5


def _full_main_weights(source) -> dict[str, torch.Tensor]:  # noqa: ANN001 - a MegatronFSDP2Source
    """Every exported parameter's full main (optimizer) weight by HF name, gathered one by one
    (collective): the reference the export is checked against."""
    return {e.name: source._main_full(i) for i, e in enumerate(source._entries)}


def tiny_hf_config(tie: bool = False):  # noqa: ANN201 - transformers config
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tie, attn_implementation="eager",
    )


def build_model(tie: bool = False, seed: int = 0) -> torch.nn.Module:
    from ckpt_engine.trainer.engines.common import hf_model_from_config

    torch.manual_seed(seed)
    return hf_model_from_config(tiny_hf_config(tie), torch.float32)


def engine_config(**kw):  # noqa: ANN201
    from ckpt_engine.trainer.engines.megatron_fsdp2 import MegatronFSDP2Config

    base = dict(lr=1e-3, eps=1e-4, weight_decay=0.01, max_grad_norm=1.0, wire_dtype=None)
    base.update(kw)
    return MegatronFSDP2Config(**base)


# --- CPU: selection and refusals ------------------------------------------------------------------


def test_registry_selects_megatron_fsdp2_and_config_validates():
    from ckpt_engine.trainer.engines.base import TrainEngineRegistry
    from ckpt_engine.trainer.engines.megatron_fsdp2 import MegatronFSDP2Config, MegatronFSDP2TrainEngine

    assert TrainEngineRegistry.get("megatron_fsdp2") is MegatronFSDP2TrainEngine
    with pytest.raises(ValueError, match=r"MegatronFSDP2Config.main_params_dtype must be one of .* got 'fp8'"):
        MegatronFSDP2Config(main_params_dtype="fp8")


def test_bad_input_is_reported_before_anything_is_sharded():
    from ckpt_engine.trainer.engines.megatron_fsdp2 import MegatronFSDP2TrainEngine

    with pytest.raises(ValueError, match="exactly one of process_group or mesh"):
        MegatronFSDP2TrainEngine(build_model())
    group = object()  # never used: the tied-embedding refusal comes first
    with pytest.raises(ValueError, match="cannot shard tied embeddings"):
        MegatronFSDP2TrainEngine(build_model(tie=True), process_group=group)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="wraps Hugging Face models"):
        MegatronFSDP2TrainEngine(torch.nn.Linear(2, 2), process_group=group)  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_refuses_cleanly_without_cuda_or_megatron_fsdp():
    from ckpt_engine.trainer.engines.megatron_fsdp2 import MegatronFSDP2TrainEngine, megatron_fsdp2_available

    ok, why = megatron_fsdp2_available()
    assert not ok and ("needs CUDA" in why or "install megatron-fsdp>=0.6.1" in why)
    with pytest.raises(RuntimeError, match=r"Megatron-FSDP2 (needs CUDA|cannot be imported)"):
        MegatronFSDP2TrainEngine(build_model(), process_group=object())  # type: ignore[arg-type]


# --- GPU -----------------------------------------------------------------------------------------


def _batches(world_size: int, steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(0, 128, (world_size * MICRO, SEQ), generator=g) for _ in range(steps)]


def _collect(engine) -> dict[str, torch.Tensor]:  # noqa: ANN001
    return {n: t.detach().clone() for n, t in engine.source.iter_weights()}


def _reference(model: torch.nn.Module, cfg, data: list[torch.Tensor], world_size: int) -> tuple[list[float], list[float]]:  # noqa: ANN001
    """What data-parallel training over `world_size` ranks computes, on one unsharded model."""
    import math

    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    losses, norms = [], []
    for ids in data:
        step_losses = []
        for r in range(world_size):
            mb = ids[r * MICRO : (r + 1) * MICRO]
            loss = lm_loss(model(input_ids=mb, use_cache=False).logits, {"input_ids": mb})
            loss.backward()
            step_losses.append(loss.item())
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        torch._foreach_div_(grads, world_size)
        norm = math.sqrt(sum(torch.linalg.vector_norm(g, dtype=torch.float64).square().item() for g in grads))
        coef = cfg.max_grad_norm / (norm + 1e-6)
        if coef < 1.0:
            torch._foreach_mul_(grads, coef)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(sum(step_losses) / world_size)
        norms.append(norm)
    return losses, norms


def _count_gathers(fn):  # noqa: ANN001, ANN202
    """Run fn() counting the all-gathers it issues (a pass-through wrapper, not a stand-in)."""
    import torch.distributed as dist

    calls = [0]
    real = dist.all_gather_into_tensor

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls[0] += 1
        return real(*args, **kwargs)

    dist.all_gather_into_tensor = counted
    try:
        return fn(), calls[0]
    finally:
        dist.all_gather_into_tensor = real


def _fp32_worker(rank: int, world_size: int, ckpt_dir: str) -> dict:
    import copy

    from ckpt_engine.trainer.engines.megatron_fsdp2 import MegatronFSDP2TrainEngine

    device = torch.device("cuda", rank)
    model = build_model().to(device)
    ref = copy.deepcopy(model)
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    cfg = engine_config()
    engine = MegatronFSDP2TrainEngine(model, config=cfg, process_group=world_group())
    units = engine.source.units
    out: dict = {"groups_per_unit": [len(u.parameter_groups) for u in units], "num_units": len(units)}
    e0 = _collect(engine)
    out["initial_exact"] = sorted(e0) == sorted(init) and all(torch.equal(e0[k], init[k]) for k in init)
    data = _batches(world_size, STEPS + 2)
    losses, norms = [], []
    for s in range(STEPS):
        ids = data[s][rank * MICRO : (rank + 1) * MICRO].to(device)
        losses.append(engine.forward_backward({"input_ids": ids}, lm_loss)["loss"])
        norms.append(engine.optimizer_step())
        engine.lr_scheduler_step()
    e3, gathers = _count_gathers(lambda: _collect(engine))
    main = _full_main_weights(engine.source)
    out.update(losses=losses, norms=norms, export_gathers=gathers, names=list(e3), is_sender=engine.source.is_sender)
    out["export_equals_main"] = all(torch.equal(e3[k], main[k]) for k in main) and sorted(e3) == sorted(main)
    if rank == 0:
        ref_losses, ref_norms = _reference(ref, cfg, [d.to(device) for d in data[:STEPS]], world_size)
        r = dict(ref.named_parameters())
        out.update(ref_losses=ref_losses, ref_norms=ref_norms)
        out["max_diff"] = max((e3[k] - r[k]).abs().max().item() for k in r)
        out["movement"] = max((r[k] - init[k]).abs().max().item() for k in r)

    # A forward interrupted inside the second decoder layer leaves the root and that layer gathered
    # (their pending all-gathers hold pre-step weights); the step then changes every weight.
    s = STEPS
    engine.forward_backward({"input_ids": data[s][rank * MICRO : (rank + 1) * MICRO].to(device)}, lm_loss)

    class Interrupted(Exception):
        pass

    def interrupt(_module, _args):  # noqa: ANN001, ANN202
        raise Interrupted("interrupted forward")

    handle = units[2].register_forward_pre_hook(interrupt)
    try:
        with torch.no_grad():
            engine.model(input_ids=data[s][:MICRO].to(device), use_cache=False, return_dict=False)
    except Interrupted:
        pass
    finally:
        handle.remove()
    out["pending_after_interrupt"] = [u._unshard_event is not None for u in units]
    engine.optimizer_step()
    e4, gathers4 = _count_gathers(lambda: _collect(engine))
    main4 = _full_main_weights(engine.source)
    out["export_gathers_after_interrupt"] = gathers4
    out["stale_free"] = all(torch.equal(e4[k], main4[k]) for k in main4)
    out["moved_by_step4"] = sum(not torch.equal(e4[k], e3[k]) for k in e3)

    # Checkpoint round trip into an engine built from other weights, then one more step on both.
    engine.save_checkpoint(ckpt_dir)
    other = MegatronFSDP2TrainEngine(build_model(seed=7).to(device), config=engine_config(), process_group=world_group())
    other.load_checkpoint(ckpt_dir)
    out["ckpt_exact"] = all(torch.equal(t, e4[n]) for n, t in _collect(other).items())
    ids = data[s + 1][rank * MICRO : (rank + 1) * MICRO].to(device)
    for eng in (engine, other):
        eng.forward_backward({"input_ids": ids}, lm_loss)
        eng.optimizer_step()
    a, b = _collect(engine), _collect(other)
    out["ckpt_resume_diff"] = max((a[k] - b[k]).abs().max().item() for k in a)
    out["global_steps"] = [engine.global_step, other.global_step]
    return out


@pytest.mark.gpu
def test_megatron_fsdp2_matches_unsharded_and_exports_exactly_on_2_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    from ckpt_engine.trainer.engines.megatron_fsdp2 import megatron_fsdp2_available

    ok, why = megatron_fsdp2_available()
    if not ok:
        pytest.skip(why)
    with tempfile.TemporaryDirectory() as tmp:
        r0, r1 = run_ranks(_fp32_worker, backend="nccl", ckpt_dir=os.path.join(tmp, "ckpt"))
    print(f"megatron_fsdp2 parity: max |sharded - unsharded| = {r0['max_diff']:.3e} (ATOL {ATOL}), "
          f"movement {r0['movement']:.3e}, resume diff {r0['ckpt_resume_diff']:.3e}")
    assert r0["groups_per_unit"] == [1] * r0["num_units"], "each unit should hold one fp32 parameter group"
    for r in (r0, r1):
        assert r["initial_exact"], "export right after sharding differs from the HF weights"
        assert r["export_equals_main"], "export differs from the engine's own full main weights"
        assert r["export_gathers"] == r["num_units"], f"export issued {r['export_gathers']} all-gathers for {r['num_units']} units"
    assert r0["names"] == r1["names"] and r0["is_sender"] and not r1["is_sender"]
    assert r0["losses"] == pytest.approx(r0["ref_losses"], rel=1e-5)
    assert r0["norms"] == pytest.approx(r0["ref_norms"], rel=1e-4)
    assert r0["movement"] > 50 * ATOL, "the reference did not train: the parity check would be empty"
    assert r0["max_diff"] <= ATOL
    # no unit left stale: the interrupted forward left gathers pending; export regathered every unit
    assert r0["pending_after_interrupt"][0] and r0["pending_after_interrupt"][2]
    for r in (r0, r1):
        assert r["export_gathers_after_interrupt"] == r["num_units"]
        assert r["stale_free"], "export used a unit gathered before the last optimizer step"
        assert r["moved_by_step4"] > len(r["names"]) // 2
        assert r["ckpt_exact"], "checkpoint load did not restore the exported weights"
        assert r["ckpt_resume_diff"] <= 1e-6
        assert r["global_steps"] == [STEPS + 2, STEPS + 2]


def _bf16_worker(rank: int, world_size: int) -> dict:
    from ckpt_engine.trainer.engines.megatron_fsdp2 import MegatronFSDP2TrainEngine

    device = torch.device("cuda", rank)
    cfg = engine_config(param_dtype="bfloat16", main_params_dtype="float32", main_grads_dtype="float32", wire_dtype="bfloat16")
    engine = MegatronFSDP2TrainEngine(build_model().to(device), config=cfg, process_group=world_group())
    data = _batches(world_size, STEPS)
    before = _collect(engine)
    losses = []
    for s in range(STEPS):
        ids = data[s][rank * MICRO : (rank + 1) * MICRO].to(device)
        losses.append(engine.forward_backward({"input_ids": ids}, lm_loss)["loss"])
        engine.optimizer_step()
    after, gathers = _count_gathers(lambda: _collect(engine))
    main = _full_main_weights(engine.source)
    return {
        "losses": losses, "gathers": gathers, "num_units": len(engine.source.units),
        "dtypes": sorted({str(t.dtype) for t in after.values()}),
        "main_dtypes": sorted({str(t.dtype) for t in main.values()}),
        "export_is_main_in_bf16": all(torch.equal(after[k], main[k].to(torch.bfloat16)) for k in main),
        "moved": sum(not torch.equal(after[k], before[k]) for k in after), "total": len(after),
    }


@pytest.mark.gpu
def test_megatron_fsdp2_bf16_compute_exports_updated_main_weights_on_2_gpus():
    """bf16 compute weights, fp32 main weights: after each step the compute weights are the
    main weights rounded to bf16 (Megatron-FSDP2's copy after optimizer.step), and so is the export."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    from ckpt_engine.trainer.engines.megatron_fsdp2 import megatron_fsdp2_available

    ok, why = megatron_fsdp2_available()
    if not ok:
        pytest.skip(why)
    r0, r1 = run_ranks(_bf16_worker, backend="nccl")
    for r in (r0, r1):
        assert r["dtypes"] == ["torch.bfloat16"] and r["main_dtypes"] == ["torch.float32"]
        assert r["export_is_main_in_bf16"]
        assert r["gathers"] == r["num_units"]
        assert r["moved"] > r["total"] // 2
        assert all(torch.isfinite(torch.tensor(r["losses"])))
    assert r0["losses"] == r1["losses"]
