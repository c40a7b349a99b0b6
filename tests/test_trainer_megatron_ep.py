"""MegatronTrainEngine with expert parallelism, and checkpoint save -> load, on real megatron-core
over 2 gloo ranks (CPU).

EP export parity: a tiny Qwen3-MoE HF model (transformers 5 fuses its experts in memory; the
reference is its checkpoint form, one tensor per expert, through `hf_names.unfuse_experts`) is
loaded into a Megatron GPTModel with EP=2 (local layer spec: SequentialMLP experts, built with
use_cpu_initialization; no CUDA is needed to build or export), exported back through
`iter_weights()`, and compared bit for bit. The router (`mlp.gate.weight`) stays fp32 on the wire.

Checkpoint round trip (TP=2): forward/backward needs CUDA in megatron-core (see
test_trainer_megatron.py), so the optimizer state is made real by giving every parameter a
deterministic gradient and taking AdamW steps; then save -> re-init with another seed -> load ->
every parameter and optimizer state tensor equal, and the export equals the one before the save.

On 2 GPUs (-m gpu): EP=2 forward/backward with megatron's alltoall dispatcher matches the HF
Qwen3-MoE model (loss, and the weights after AdamW steps).
"""

from __future__ import annotations

import pytest
import torch

from tests._trainer_mp import cases_in_one_run, run_ranks

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install megatron-core==0.16.1)")
pytestmark = pytest.mark.timeout(300)


def moe_config():
    import transformers

    return transformers.Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=64, tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[],
    )


def hf_checkpoint_state(model: torch.nn.Module, model_type: str) -> dict[str, torch.Tensor]:
    """The HF model's weights in checkpoint form: fused experts split per expert (repo rules)."""
    from ckpt_engine.sources.hf_names import unfuse_experts

    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        parts = unfuse_experts(model_type, name, t)
        if parts is None:
            out[name] = t.detach().clone()
        else:
            out.update({n: p.detach().clone() for n, p in parts})
    return out


def _ep_export_worker(rank: int, world_size: int, tp: int, ep: int, etp: int, wire: str | None) -> dict:
    from megatron.core import parallel_state as ps

    from ckpt_engine.trainer.engines.common import hf_model_from_config
    from ckpt_engine.trainer.engines.megatron import (
        MegatronConfig,
        MegatronTrainEngine,
    )

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    cfg = moe_config()
    torch.manual_seed(0)
    hf = hf_model_from_config(cfg, torch.float32)
    with torch.no_grad():  # non-trivial norms and distinct experts so a swap would show
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
            elif "experts" in n:
                p.normal_(0, 0.02)
    sd = hf_checkpoint_state(hf, cfg.model_type)
    engine = MegatronTrainEngine(cfg, config=MegatronConfig(wire_dtype=wire, moe_token_dispatcher_type="allgather"))
    engine.load_hf_weights(sd)
    specs = engine.source.metadata()
    exported = {n: t.clone() for n, t in engine.source.iter_weights()}
    local = sorted(n for n, _ in engine.model.named_parameters() if "local_experts" in n)
    out = {"specs": [[s.name, s.dtype, list(s.shape)] for s in specs], "is_sender": engine.source.is_sender,
           "names": list(exported), "local_expert_params": local}
    if rank == 0:
        out["expected"] = list(sd)
        out["tensors"] = {**{f"exp/{k}": v for k, v in exported.items()}, **{f"hf/{k}": v for k, v in sd.items()}}
    ps.destroy_model_parallel()
    return out


EP_CASES = {"ep2-fp32": (1, 2, 1, None), "tp2-ep2-bf16-wire": (2, 2, 1, "bfloat16"), "tp2-etp2-fp32": (2, 1, 2, None)}


def test_megatron_ep_export_is_bit_exact_hf():
    """EP gathers (ep2), dense TP with EP experts (tp2-ep2: attention split over TP, each rank two
    whole experts), and expert TP (tp2-etp2: every expert's fc1 [gate; up] split over 2 ranks)."""
    cases = {case: dict(tp=tp, ep=ep, etp=etp, wire=wire) for case, (tp, ep, etp, wire) in EP_CASES.items()}
    r0, r1 = run_ranks(cases_in_one_run, worker=_ep_export_worker, cases=cases)
    for case, (_, ep, _, wire) in EP_CASES.items():
        a, b = r0[case], r1[case]
        assert a["specs"] == b["specs"], case
        assert a["is_sender"] and not b["is_sender"], case
        # each EP rank holds 4/ep of the experts per layer (fc1 + fc2 each), 2 layers
        assert len(a["local_expert_params"]) == len(b["local_expert_params"]) == (4 // ep) * 2 * 2, case
        names = [s[0] for s in a["specs"]]
        assert sorted(names) == sorted(a["expected"]), case
        assert a["names"] == b["names"] == names, case
        for i in range(2):
            for e in range(4):
                for proj in ("gate_proj", "up_proj", "down_proj"):
                    assert f"model.layers.{i}.mlp.experts.{e}.{proj}.weight" in names, case
        t = r0["tensors"]
        for name, dtype, shape in a["specs"]:
            got, want = t[f"{case}:exp/{name}"], t[f"{case}:hf/{name}"]
            assert list(got.shape) == shape == list(want.shape), f"{case}: {name}"
            want_dtype = "float32" if (wire is None or name.endswith("mlp.gate.weight")) else wire
            assert dtype == want_dtype == str(got.dtype).removeprefix("torch."), f"{case}: {name}"
            assert torch.equal(got, want.to(got.dtype)), f"{case}: {name}"


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_megatron_router_config_matches_hf_routing(norm_topk_prob: bool):
    """The TransformerConfig's router settings route like the HF Qwen3-MoE gate (CPU: megatron's
    routing function is plain torch; the router module itself moves its weight to CUDA in forward)."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    from ckpt_engine.trainer.engines.megatron import (
        MegatronConfig,
        transformer_config_from_hf,
    )

    cfg = moe_config()
    cfg.norm_topk_prob = norm_topk_prob
    tconf = transformer_config_from_hf(cfg, MegatronConfig(moe_token_dispatcher_type="allgather"), 1, 1, 1)
    assert tconf.moe_router_topk == 2 and tconf.num_moe_experts == 4
    gate = Qwen3MoeTopKRouter(cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        gate.weight.normal_()
    x = torch.randn(32, cfg.hidden_size)
    _, hf_scores, hf_idx = gate(x)
    logits = torch.nn.functional.linear(x, gate.weight)
    probs, routing_map = topk_routing_with_score_function(
        logits, tconf.moe_router_topk, use_pre_softmax=tconf.moe_router_pre_softmax, scaling_factor=tconf.moe_router_topk_scaling_factor
    )
    assert torch.equal(routing_map, torch.zeros_like(routing_map).scatter(1, hf_idx, True))
    torch.testing.assert_close(probs.gather(1, hf_idx), hf_scores, rtol=1e-6, atol=1e-7)


def test_moe_router_gating_runs_without_transformer_engine():
    """megatron-core 0.16.1's router GEMM read an undefined `te_general_gemm` without Transformer
    Engine (NameError in every MoE forward on the GPU box); building an MoE model defines it."""
    from megatron.core.transformer.moe import moe_utils

    from ckpt_engine.trainer.engines.megatron import megatron_moe_without_te_compat

    megatron_moe_without_te_compat()
    x = torch.randn(5, 8, requires_grad=True)
    w = torch.randn(4, 8, requires_grad=True)
    out = moe_utils.router_gating_linear(x, w, None, torch.float32)
    torch.testing.assert_close(out, x @ w.t())
    out.square().sum().backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    (x @ w.t()).square().sum().backward()
    torch.testing.assert_close(gx, x.grad)
    torch.testing.assert_close(gw, w.grad)


# --- checkpoint save -> load -> continue (TP=2) -------------------------------------------------


def _fake_grads(engine, step: int, rank: int) -> None:
    """Deterministic per-(step, rank, parameter) gradients: CPU stand-in for forward_backward,
    whose megatron-core forward needs CUDA (see test_trainer_megatron.py)."""
    from ckpt_engine.sources.megatron_export import _partition_dim
    from ckpt_engine.trainer.engines.megatron_load import vocab_padding_rows

    for i, (_, p) in enumerate(engine.model.named_parameters()):
        # a TP-replicated parameter (norms) gets the same gradient on every TP rank, as in training
        shard = rank if _partition_dim(p) is not None else 0
        g = torch.Generator().manual_seed(1000 * step + 100 * shard + i)
        p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
    for p, first in vocab_padding_rows(engine.source.exporter):  # as in training: padding rows see no loss
        p.grad[first:] = 0


def _optim_tensors(engine) -> dict[str, torch.Tensor]:
    names = {id(p): n for n, p in engine.model.named_parameters()}
    out = {}
    for p, st in engine.optimizer.state.items():
        for k, v in st.items():
            out[f"{names[id(p)]}/{k}"] = torch.as_tensor(v).clone()
    return out


def _ckpt_worker(rank: int, world_size: int, path: str) -> dict:
    from megatron.core import parallel_state as ps

    from ckpt_engine.trainer.engines.megatron import (
        MegatronConfig,
        MegatronTrainEngine,
    )

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    from tests.test_trainer_megatron import hf_config

    cfg = hf_config("qwen2")
    mcfg = MegatronConfig(wire_dtype=None, lr=1e-2, warmup_steps=5, max_grad_norm=1.0)
    torch.manual_seed(0)
    a = MegatronTrainEngine(cfg, config=mcfg)
    for step in range(3):
        _fake_grads(a, step, rank)
        if step == 1:  # a non-finite step is skipped: optimizer and LR schedule positions diverge
            next(a.model.parameters()).grad.fill_(float("nan"))
        a.optimizer_step()
        a.lr_scheduler_step()
    params = {n: p.detach().clone() for n, p in a.model.named_parameters()}
    optim = _optim_tensors(a)
    exported = {n: t.clone() for n, t in a.source.iter_weights()}
    a.save_checkpoint(path)

    torch.manual_seed(1)  # another init: loading must overwrite every parameter
    b = MegatronTrainEngine(cfg, config=mcfg)
    res: dict = {"differs_before_load": any(not torch.equal(p, params[n]) for n, p in b.model.named_parameters())}
    b.load_checkpoint(path)
    res["param_names"] = sorted(params)
    res["param_equal"] = sorted(n for n, p in b.model.named_parameters() if torch.equal(p, params[n]) and p.dtype == params[n].dtype)
    b_optim = _optim_tensors(b)
    res["optim_keys"] = [sorted(optim), sorted(b_optim)]
    res["optim_equal"] = sorted(k for k in optim if k in b_optim and torch.equal(optim[k], b_optim[k]))
    res["global_step"] = [a.global_step, b.global_step]
    res["lr"] = [a.optimizer.param_groups[0]["lr"], b.optimizer.param_groups[0]["lr"]]
    res["sched"] = [a.scheduler.last_epoch, b.scheduler.last_epoch]
    after = {n: t.clone() for n, t in b.source.iter_weights()}
    res["export_equal"] = list(after) == list(exported) and all(torch.equal(after[n], exported[n]) for n in exported)
    # continue: the same next two steps on both engines give the same weights and LR
    for step in range(3, 5):
        for e in (a, b):
            _fake_grads(e, step, rank)
            e.optimizer_step()
            e.lr_scheduler_step()
    res["continue_equal"] = all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters()))
    res["continue_lr"] = [a.optimizer.param_groups[0]["lr"], b.optimizer.param_groups[0]["lr"]]
    ps.destroy_model_parallel()
    return res


def test_megatron_checkpoint_save_load_continue_tp2(tmp_path):
    for r in run_ranks(_ckpt_worker, path=str(tmp_path / "ckpt")):
        assert r["differs_before_load"]
        assert r["param_equal"] == r["param_names"]
        assert r["optim_keys"][0] == r["optim_keys"][1] and r["optim_keys"][0]
        assert r["optim_equal"] == r["optim_keys"][0]
        assert r["global_step"] == [2, 2] and r["sched"] == [3, 3] and r["lr"][0] == r["lr"][1]
        assert r["export_equal"]
        assert r["continue_equal"] and r["continue_lr"][0] == r["continue_lr"][1]
    # layout-independent: full HF tensors, not per-rank shards
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["exp_avg.safetensors", "exp_avg_sq.safetensors", "model.safetensors"]


def test_megatron_moe_with_dense_layers_is_a_clear_error():
    from ckpt_engine.trainer.engines.megatron import (
        MegatronConfig,
        MegatronTrainEngine,
    )

    with pytest.raises(ValueError, match="moe_token_dispatcher_type"):
        MegatronConfig(moe_token_dispatcher_type="flex")
    for kw in ({"mlp_only_layers": [0]}, {"decoder_sparse_step": 2}):
        cfg = moe_config()
        for k, v in kw.items():
            setattr(cfg, k, v)
        with pytest.raises(ValueError, match="dense decoder layers"):
            MegatronTrainEngine(cfg)  # before any process group or model is touched


# --- GPU: EP=2 forward/backward parity with HF --------------------------------------------------


def _ep_train_worker(rank: int, world_size: int) -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from ckpt_engine.trainer.engines.common import hf_model_from_config
    from ckpt_engine.trainer.engines.megatron import MegatronConfig, MegatronTrainEngine
    from tests._trainer_mp import lm_loss

    ps.initialize_model_parallel(expert_model_parallel_size=2)
    model_parallel_cuda_manual_seed(123)
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = moe_config()
    cfg.norm_topk_prob = True
    torch.manual_seed(0)
    hf = hf_model_from_config(cfg, torch.float32, attn_implementation="eager").cuda()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "experts" in n:
                p.normal_(0, 0.02)
    sd = {k: v.cuda() for k, v in hf_checkpoint_state(hf, cfg.model_type).items()}
    mcfg = MegatronConfig(wire_dtype=None, lr=1e-3, max_grad_norm=None, moe_token_dispatcher_type="alltoall")
    engine = MegatronTrainEngine(cfg, config=mcfg)
    engine.load_hf_weights(sd)
    ref_opt = torch.optim.AdamW(hf.parameters(), lr=mcfg.lr, betas=mcfg.betas, eps=mcfg.eps, weight_decay=0.0)
    g = torch.Generator().manual_seed(5)
    losses, ref_losses = [], []
    for _ in range(2):  # both EP ranks see the same batch (DP=2 over the dense part: same average)
        ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=g).cuda()
        losses.append(engine.forward_backward({"input_ids": ids}, lm_loss)["loss"])
        engine.optimizer_step()
        loss = lm_loss(hf(input_ids=ids).logits, {"input_ids": ids})
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())
    exported = {n: t.detach().cpu().clone() for n, t in engine.source.iter_weights()}
    res = {"losses": losses, "ref_losses": ref_losses}
    if rank == 0:
        res["tensors"] = {**{f"exp/{k}": v for k, v in exported.items()},
                          **{f"hf/{k}": v.cpu() for k, v in hf_checkpoint_state(hf, cfg.model_type).items()},
                          **{f"init/{k}": v.cpu() for k, v in sd.items()}}
    ps.destroy_model_parallel()
    return res


@pytest.mark.gpu
def test_megatron_ep2_training_matches_hf_on_2_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    from tests.test_trainer_megatron import _assert_adam_trained_close

    r0, r1 = run_ranks(_ep_train_worker, backend="nccl")
    assert r0["losses"] == pytest.approx(r0["ref_losses"], rel=1e-4, abs=1e-4)
    assert r0["losses"] == pytest.approx(r1["losses"])
    t = r0["tensors"]
    names = [k[4:] for k in t if k.startswith("exp/")]
    assert sorted(names) == sorted(k[3:] for k in t if k.startswith("hf/"))
    for name in names:
        _assert_adam_trained_close(t[f"exp/{name}"], t[f"hf/{name}"], t[f"init/{name}"], name, lr=1e-3, steps=2)
