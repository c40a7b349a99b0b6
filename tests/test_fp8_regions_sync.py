"""An FP8 sync through region delivery: TP=2 reference engines holding their slices of the
block-FP8 layout (codes and the scales of exactly their blocks) hold, after each sync, bit for bit
the slices of the reference quantize of the trainer's weights. Region delivery keeps the FP8 wire's
fresh codes and scales as they were yielded (no clone, `WeightSource.fresh_tensors`): a tensor
reused or overwritten later in the walk would show here as wrong bytes in a later set."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from ckpt_engine import CheckpointEngineConfig, WeightSyncSession
from ckpt_engine.fp8 import fp8_specs
from ckpt_engine.manifest import TensorSpec
from ckpt_engine.planning.receive_sets import cut_region
from ckpt_engine.planning.tp_ep import tp_ep_plan
from ckpt_engine.rollout_adapters.torch_ref import TorchRefRollout, write_spec_file
from ckpt_engine.sources.base import StateDictSource
from refengines import spawn_engine
from test_fp8_sync import checkpoint

CFG = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.0625, timeout_s=30, wire_dtype="fp8")
KV_HEADS = 2
SHAPES = {
    "model.embed_tokens.weight": (320, 256), "model.layers.0.input_layernorm.weight": (256,),
    "model.layers.0.self_attn.q_proj.weight": (256, 256), "model.layers.0.self_attn.k_proj.weight": (256, 256),
    "model.layers.0.self_attn.v_proj.weight": (256, 256), "model.layers.0.self_attn.o_proj.weight": (256, 256),
    "model.layers.0.mlp.gate_proj.weight": (512, 256), "model.layers.0.mlp.up_proj.weight": (512, 256),
    "model.layers.0.mlp.down_proj.weight": (256, 512), "model.norm.weight": (256,), "lm_head.weight": (320, 256),
}


def _model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: (torch.randn(s, generator=g) * 0.02).bfloat16() for n, s in SHAPES.items()}


def _specs() -> list[TensorSpec]:
    return fp8_specs(StateDictSource(_model(0)).metadata())


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[TorchRefRollout]]:
    path = tmp_path_factory.mktemp("fp8regions") / "fp8.msgpack"
    write_spec_file(path, _specs())
    rs = [spawn_engine(f"fp8-tp{r}", spec_file=str(path), timeout_s=60, layout={"tp_size": 2, "tp_rank": r, "num_kv_heads": KV_HEADS}) for r in range(2)]
    yield rs
    for r in rs:
        r.close()


def test_tp_ranks_hold_their_fp8_slices_after_each_sync(engines: list[TorchRefRollout]) -> None:
    plans = [tp_ep_plan(_specs(), tp_size=2, tp_rank=r, num_kv_heads=KV_HEADS) for r in range(2)]
    session = WeightSyncSession(engines, CFG)
    try:
        for seed in (1, 2):
            sd = _model(seed)
            report = session.sync(StateDictSource(sd))
            ckpt = checkpoint(sd)
            for engine, plan in zip(engines, plans):
                assert plan is not None
                bad = [
                    n for n, regions in plan.holds.items()
                    if not torch.equal(engine.get_tensor(n).contiguous().view(torch.uint8), cut_region(ckpt[n], regions[0] if regions else None).contiguous().view(torch.uint8))
                ]
                assert bad == [], f"seed {seed}, {engine.name}: {bad}"
            assert max(report.received_bytes[engines[0].name]) < 0.8 * sum(t.nbytes for t in ckpt.values())  # slices, not the model
    finally:
        session.close()
