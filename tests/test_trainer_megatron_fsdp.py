"""Megatron-FSDP engine: clean selection/refusal on CPU; export parity and training on 2 GPUs (-m gpu).

Megatron-FSDP allocates its parameter/gradient buffers on CUDA, so everything past construction
runs only on the GPU machine. The CPU tests pin that the module imports without CUDA, the registry
selects it, and construction refuses with a message naming what is missing.
"""

from __future__ import annotations

import pytest
import torch

from tests._trainer_mp import lm_loss as _lm_loss, run_ranks

pytestmark = pytest.mark.timeout(600)


def tiny_hf_config(vocab: int = 100):  # noqa: ANN201
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)


def test_registry_selects_megatron_fsdp_and_config_validates():
    from ckpt_engine.trainer.engines.base import TrainEngineRegistry
    from ckpt_engine.trainer.engines.megatron_fsdp import MegatronFSDPConfig, MegatronFSDPTrainEngine

    assert TrainEngineRegistry.get("megatron_fsdp") is MegatronFSDPTrainEngine
    with pytest.raises(ValueError, match=r"sharding_strategy must be one of no_shard, optim, optim_grads, optim_grads_params, got 'zero3'"):
        MegatronFSDPConfig(sharding_strategy="zero3")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_refuses_cleanly_without_cuda():
    from ckpt_engine.trainer.engines.megatron_fsdp import MegatronFSDPTrainEngine

    with pytest.raises(RuntimeError, match=r"needs CUDA|cannot be imported"):
        MegatronFSDPTrainEngine(tiny_hf_config())
    from transformers import GPT2Config

    with pytest.raises(ValueError, match="no Megatron naming table"):  # bad input is reported first
        MegatronFSDPTrainEngine(GPT2Config())


# --- GPU ------------------------------------------------------------------------------------------


def _fsdp_worker(rank: int, world_size: int, strategy: str, tp: int) -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from ckpt_engine.trainer.engines.common import hf_model_from_config

    from ckpt_engine.trainer.engines.megatron_fsdp import MegatronFSDPConfig, MegatronFSDPTrainEngine

    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    model_parallel_cuda_manual_seed(123)
    cfg = tiny_hf_config()
    torch.manual_seed(0)
    hf = hf_model_from_config(cfg, torch.float32)
    sd = {k: v.clone().cuda() for k, v in hf.state_dict().items()}
    engine = MegatronFSDPTrainEngine(
        cfg, config=MegatronFSDPConfig(sharding_strategy=strategy, wire_dtype=None, lr=1e-3), initial_hf_weights=sd
    )
    exported0 = {n: t.detach().cpu().clone() for n, t in engine.source.iter_weights()}
    g = torch.Generator().manual_seed(5)
    losses = []
    for _ in range(3):
        ids = torch.randint(0, 100, (2, 16), generator=g).cuda()
        out = engine.forward_backward({"input_ids": ids}, _lm_loss)
        engine.optimizer_step()
        engine.lr_scheduler_step()
        losses.append(out["loss"])
    exported1 = {n: t.detach().cpu().clone() for n, t in engine.source.iter_weights()}
    res = {"losses": losses, "names": list(exported1), "is_sender": engine.source.is_sender}
    if rank == 0:
        res["tensors"] = {**{f"e0/{k}": v for k, v in exported0.items()}, **{f"e1/{k}": v for k, v in exported1.items()},
                          **{f"hf/{k}": v.cpu() for k, v in sd.items()}}
    ps.destroy_model_parallel()
    return res


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads", "optim_grads_params"])
def test_megatron_fsdp_export_and_training_on_2_gpus(strategy: str):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    r0, r1 = run_ranks(_fsdp_worker, backend="nccl", strategy=strategy, tp=1)
    assert r0["names"] == r1["names"]
    t = r0["tensors"]
    for name in r0["names"]:
        assert torch.equal(t[f"e0/{name}"], t[f"hf/{name}"]), f"{strategy}: export after HF load differs: {name}"
    changed = [n for n in r0["names"] if not torch.equal(t[f"e1/{n}"], t[f"e0/{n}"])]
    assert len(changed) > len(r0["names"]) // 2, f"{strategy}: training did not move the exported weights"
    assert all(torch.isfinite(torch.tensor(r0["losses"])))
    assert r0["losses"] == pytest.approx(r1["losses"])
