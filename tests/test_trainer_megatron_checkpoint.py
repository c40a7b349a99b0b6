"""Layout-independent Megatron checkpoints on 2 real gloo ranks: saved with TP=2, loaded with TP=1.

The checkpoint holds full HF-named weights and AdamW moments (`megatron_checkpoint.py`), so an
engine with another tensor-parallel layout (here TP=1, DP=2 on the same two ranks) loads it and
continues exactly where the TP=2 engine would have: same exported weights and moments after the
load, and the same weights after one more step with the same gradient. Megatron's forward needs
CUDA, so gradients are set directly: one HF-space gradient per step, converted into each layout by
the same HF -> Megatron conversion (`megatron_load.load_hf`) the weights use, which makes "the same gradient"
meaningful across layouts.
"""

from __future__ import annotations

import pytest
import torch

from tests._trainer_mp import run_ranks

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install megatron-core==0.16.1)")
pytestmark = pytest.mark.timeout(300)


def _hf_space(engine, key: str) -> dict[str, torch.Tensor]:  # noqa: ANN001
    from ckpt_engine.trainer.engines.megatron_checkpoint import hf_space_exporter
    from ckpt_engine.sources.megatron_export import walk_to_first_stage

    ex = hf_space_exporter(engine, key)
    device = next(engine.model.parameters()).device
    return {n: t.detach().clone() for n, t in walk_to_first_stage(ex, ex.stage_specs(), engine.groups, device)}


def _hf_grads(engine, seed: int) -> None:  # noqa: ANN001
    """One gradient per HF tensor (same on every rank and layout), converted into this layout."""
    from ckpt_engine.trainer.engines.megatron_load import load_hf

    g = torch.Generator().manual_seed(seed)
    names = [s.name for s in engine.source.metadata()]
    shapes = {s.name: tuple(s.shape) for s in engine.source.metadata()}
    hf = {n: torch.randn(shapes[n], generator=g) for n in names}
    for p in engine.model.parameters():
        p.grad = torch.zeros_like(p)
    load_hf(engine.source.exporter, hf, target=lambda p: p.grad)


def _reshard_worker(rank: int, world_size: int, path: str) -> dict:
    from megatron.core import parallel_state as ps

    from ckpt_engine.trainer.engines.megatron import MegatronConfig, MegatronTrainEngine
    from tests.test_trainer_megatron import hf_config

    cfg = hf_config("qwen2")
    mcfg = MegatronConfig(wire_dtype=None, lr=1e-2, warmup_steps=3, max_grad_norm=None)
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    torch.manual_seed(0)
    a = MegatronTrainEngine(cfg, config=mcfg)
    for step in range(2):
        _hf_grads(a, step)
        a.optimizer_step()
        a.lr_scheduler_step()
    saved = {key: _hf_space(a, key) for key in ("model", "exp_avg", "exp_avg_sq")}
    a.save_checkpoint(path)
    _hf_grads(a, 2)
    a.optimizer_step()
    a_next = _hf_space(a, "model")
    a_lr = a.optimizer.param_groups[0]["lr"]
    ps.destroy_model_parallel()

    ps.initialize_model_parallel(tensor_model_parallel_size=1)  # DP=2 on the same ranks
    torch.manual_seed(1)
    b = MegatronTrainEngine(cfg, config=mcfg)
    differs = any(not torch.equal(t, saved["model"][n]) for n, t in _hf_space(b, "model").items())
    b.load_checkpoint(path)
    loaded = {key: _hf_space(b, key) for key in ("model", "exp_avg", "exp_avg_sq")}
    res = {
        "tp": [a.groups.tp_size, b.groups.tp_size], "differs_before_load": differs,
        "names": sorted(saved["model"]), "loaded_names": sorted(loaded["model"]),
        "equal": {key: sorted(n for n, t in saved[key].items() if torch.equal(t, loaded[key][n])) for key in saved},
        "moments_nonzero": all(float(t.abs().sum()) > 0 for t in saved["exp_avg"].values()),
        "steps": [[a.global_step - 1, a._sched_step], [b.global_step, b._sched_step]],
    }
    _hf_grads(b, 2)
    b.optimizer_step()
    b_next = _hf_space(b, "model")
    res["continue_equal"] = sorted(n for n, t in a_next.items() if torch.equal(t, b_next[n]))
    res["lr"] = [a_lr, b.optimizer.param_groups[0]["lr"]]
    ps.destroy_model_parallel()
    return res


def test_tp2_checkpoint_loads_into_tp1_and_continues(tmp_path):
    for r in run_ranks(_reshard_worker, path=str(tmp_path / "ckpt")):
        assert r["tp"] == [2, 1]
        assert r["differs_before_load"]
        assert r["names"] == r["loaded_names"] and r["names"]
        assert r["moments_nonzero"]
        for key, names in r["equal"].items():
            assert names == r["names"], f"{key}: differs after TP=2 -> TP=1 for {sorted(set(r['names']) - set(names))}"
        assert r["steps"] == [[2, 2], [2, 2]]
        assert r["continue_equal"] == r["names"]
        assert r["lr"][0] == r["lr"][1]


def test_load_rejects_what_is_not_a_checkpoint(tmp_path):
    from ckpt_engine.trainer.engines.megatron_checkpoint import load_megatron_checkpoint

    with pytest.raises(ValueError, match="not a ckpt_engine Megatron checkpoint: .*model.safetensors is missing"):
        load_megatron_checkpoint(object(), str(tmp_path))
