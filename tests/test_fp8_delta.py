"""Delta syncs on a block-FP8 wire, into a reference receiver (its own process) holding the FP8
checkpoint layout: a dense seed, then patch syncs of small AdamW-like updates of the bf16
trainer weights. Each sync ends with the receiver holding, byte for byte, the quantized
checkpoint of that version (codes and scales), and patches carry fewer bytes than the dense FP8
sync; a step that moves a block's amax (its scale and many of its codes) stays exact too. And
`ckpt-engine bench --delta --wire-dtype fp8` end to end (real gloo processes): the same AdamW
versions on a bf16 wire and on the FP8 one, both chains bit-exact, with the FP8 codes and
scales each version changed."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

from ckpt_engine import CheckpointEngineConfig, WeightSyncSession
from ckpt_engine.fp8 import fp8_specs
from ckpt_engine.rollout_adapters.torch_ref import TorchRefRollout, write_spec_file
from ckpt_engine.sources.base import StateDictSource
from refengines import spawn_engine
from test_fp8_sync import checkpoint, model, same_bytes

CFG = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.25, timeout_s=30, wire_dtype="fp8", verify=True, delta="on")


def step(sd: dict[str, torch.Tensor], seed: int, lr: float) -> dict[str, torch.Tensor]:
    """One sign-like update of size `lr` per element (what AdamW's first steps move), in fp32, cast back to bf16."""
    g = torch.Generator().manual_seed(seed)
    return {n: (t.float() - lr * torch.randn(t.shape, generator=g).sign()).bfloat16() for n, t in sd.items()}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TorchRefRollout]:
    path = tmp_path_factory.mktemp("fp8delta") / "fp8.msgpack"
    write_spec_file(path, fp8_specs(StateDictSource(model(0)).metadata()))
    e = spawn_engine("fp8-delta-ref", spec_file=str(path), timeout_s=60)
    yield e
    e.close()


def test_patches_on_an_fp8_wire_hold_the_quantized_checkpoint_bit_for_bit(engine: TorchRefRollout) -> None:
    session = WeightSyncSession([engine], CFG)
    try:
        sd = model(11)
        reports = []
        versions = [sd]
        for k in range(4):
            sd = step(sd, 100 + k, 2e-5)
            versions.append(sd)
        big = dict(sd)  # a step that moves one block's amax: its scale and every code of the block change
        w = big["model.layers.0.mlp.gate_proj.weight"].clone()
        w[5, 7] = 1.0
        big["model.layers.0.mlp.gate_proj.weight"] = w
        versions.append(big)
        for v in versions:
            reports.append(session.sync(StateDictSource(v)))
            ckpt = checkpoint(v)
            bad = [n for n, t in ckpt.items() if not same_bytes(engine.get_tensor(n), t)]
            assert not bad, f"version {len(reports)}: {bad} differ from the quantized checkpoint"
    finally:
        session.close()
    seed, patches = reports[0], reports[1:]
    assert seed.delta == "seed" and seed.wire_bytes == seed.dense_bytes
    assert all(r.delta == "patch" and r.dense_bytes == seed.dense_bytes for r in patches)
    assert all(r.wire_bytes < 0.7 * r.dense_bytes for r in patches)  # small steps (and the one block): patches pay


def test_bench_delta_on_an_fp8_wire_end_to_end() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "ckpt_engine.cli", "bench", "--delta", "--wire-dtype", "fp8", "--preset", "tiny", "--layers", "1",
         "--backend", "gloo", "--device", "cpu", "--iters", "1", "--versions", "2", "--lr", "1e-5", "--json", "-"],
        capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    s = json.loads(out.stdout)
    assert s["correct"] is True and s["problems"] == []
    bf16, fp8 = s["wires"]["bf16"], s["wires"]["fp8"]
    assert fp8["wire"] == "fp8" and fp8["bytes"] < bf16["bytes"]  # 0.92 x: the tiny preset's embedding and head stay bf16
    for v in ("delta v2", "delta v3"):
        m = fp8["modes"][v]
        assert 0.0 < m["wire_fraction"] < 0.6, m  # patches against the dense FP8 bytes
        assert m["wire_bytes"] < bf16["modes"][v]["wire_bytes"]
        assert 0.0 < m["fp8_changes"]["codes"] < 0.2 and 0.0 <= m["fp8_changes"]["scales"] < 0.2, m
