"""Block-FP8 syncs end to end into a reference receiver holding an FP8 model in the checkpoint's
layout (float8_e4m3fn weights + float32 `_scale_inv`): it ends holding the bytes of the same
quantized checkpoint; layouts that disagree are refused before anything pauses; a corrupted scale
fails its bucket's checksum."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from ckpt_engine import CheckpointEngineConfig, ManifestRejectedError, SyncError, WeightSyncSession
from ckpt_engine.fp8 import fp8_specs, quantize_block_fp8, quantizes
from ckpt_engine.manifest import TensorSpec
from ckpt_engine.rollout_adapters.torch_ref import TorchRefRollout, write_spec_file
from ckpt_engine.sources.base import StateDictSource
from tamper import GlooEngine
from refengines import serving, spawn_engine

CFG = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.25, timeout_s=30, wire_dtype="fp8", verify=True)


def model(seed: int) -> dict[str, torch.Tensor]:
    """A small Qwen2-shaped decoder layer in bf16 (partial blocks included)."""
    g = torch.Generator().manual_seed(seed)
    shapes = {
        "model.embed_tokens.weight": (320, 192), "model.layers.0.input_layernorm.weight": (192,),
        "model.layers.0.self_attn.q_proj.weight": (256, 192), "model.layers.0.self_attn.q_proj.bias": (256,),
        "model.layers.0.self_attn.k_proj.weight": (128, 192), "model.layers.0.self_attn.o_proj.weight": (192, 256),
        "model.layers.0.mlp.gate_proj.weight": (300, 192), "model.layers.0.mlp.down_proj.weight": (192, 300),
        "model.norm.weight": (192,), "lm_head.weight": (320, 192),
    }
    return {n: (torch.randn(s, generator=g) * 0.02).bfloat16() for n, s in shapes.items()}


def checkpoint(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The block-FP8 checkpoint of `sd`, quantized by the reference recipe (what loading it holds)."""
    out = {}
    for n, t in sd.items():
        if quantizes(TensorSpec(n, "bfloat16", tuple(t.shape))):
            out[n], out[n + "_scale_inv"] = quantize_block_fp8(t)
        else:
            out[n] = t
    return out


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.fixture(scope="module")
def fp8_spec_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("fp8") / "fp8.msgpack"
    write_spec_file(path, fp8_specs(StateDictSource(model(0)).metadata()))
    return str(path)


@pytest.fixture(scope="module")
def engine(fp8_spec_file: str) -> Iterator[TorchRefRollout]:
    e = spawn_engine("fp8-ref", spec_file=fp8_spec_file, timeout_s=60)
    yield e
    e.close()


def test_an_fp8_sync_holds_the_quantized_checkpoints_bytes_and_halves_the_wire(engine: TorchRefRollout) -> None:
    session = WeightSyncSession([engine], CFG)
    try:
        for seed in (1, 2):  # a second sync reuses the plan
            sd = model(seed)
            report = session.sync(StateDictSource(sd))
            ckpt = checkpoint(sd)
            bad = [n for n, t in ckpt.items() if not same_bytes(engine.get_tensor(n), t)]
            assert not bad and report.tensors == len(ckpt)
    finally:
        session.close()
    bf16 = sum(t.nbytes for t in sd.values())
    assert report.bytes == sum(t.nbytes for t in ckpt.values()) < 0.7 * bf16  # embed + head stay bf16 in this small model


@pytest.mark.parametrize(
    "config, source, match",
    [
        (CheckpointEngineConfig(backend="gloo", timeout_s=30), lambda sd: StateDictSource(sd),
         r"the wire carries bfloat16 but the engine holds block-FP8.*set checkpoint_engine\.wire_dtype=fp8"),
        (CheckpointEngineConfig(backend="gloo", timeout_s=30), lambda sd: StateDictSource({k: v for k, v in checkpoint(sd).items() if not k.endswith("o_proj.weight_scale_inv")}),
         r"o_proj\.weight: sent as float8_e4m3fn without its scale tensor"),
        (CheckpointEngineConfig(backend="gloo", timeout_s=30), lambda sd: StateDictSource({k: (v.t().contiguous() if k.endswith("down_proj.weight_scale_inv") else v) for k, v in checkpoint(sd).items()}),
         r"down_proj\.weight_scale_inv: scales sent transposed"),
    ],
    ids=["bf16-wire", "missing-scale", "transposed-scales"],
)
def test_a_layout_the_engine_does_not_hold_is_refused_before_anything_pauses(engine: TorchRefRollout, config, source, match: str) -> None:
    before, held = engine.health(), engine.get_tensor("model.layers.0.mlp.down_proj.weight_scale_inv")
    session = WeightSyncSession([engine], config)
    try:
        with pytest.raises(ManifestRejectedError, match=match):
            session.sync(source(model(5)))
    finally:
        session.close()
    after = engine.health()
    assert serving(after) and after["version"] == before["version"]  # nothing paused, nothing lost
    assert same_bytes(engine.get_tensor("model.layers.0.mlp.down_proj.weight_scale_inv"), held)


class _FlipAScale(GlooEngine):
    """Flips one byte of the bucket holding the first scale tensor, after its checksum was computed."""

    target: int | None = None
    offset = 0

    def _tamper_hook(self, bucket_index: int, message: torch.Tensor) -> None:
        if bucket_index == type(self).target:
            message[type(self).offset] ^= 0x01


def test_a_corrupted_scale_fails_its_buckets_checksum(engine: TorchRefRollout) -> None:
    cfg = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.25, timeout_s=20, wire_dtype="fp8", verify=True, stage="off")
    gloo = _FlipAScale(bucket_size_bytes=cfg.bucket_size_bytes, verify=True, timeout_s=20)
    session = WeightSyncSession([engine], cfg, engine=gloo)
    try:
        specs = fp8_specs(StateDictSource(model(0)).metadata())
        manifest = gloo.plan(specs)
        entry = next(e for b in manifest.buckets for e in b.entries if e.name.endswith("q_proj.weight_scale_inv"))
        bucket = next(b for b in manifest.buckets if entry in b.entries)
        _FlipAScale.target, _FlipAScale.offset = bucket.index, entry.bucket_offset + 2
        with pytest.raises(SyncError, match=rf"bucket {bucket.index} failed its checksum"):
            session.sync(StateDictSource(model(6)))
        assert engine.health()["stale"] is True
        _FlipAScale.target = None
        sd = model(7)
        session.sync(StateDictSource(sd))  # the next complete sync heals it
        assert all(same_bytes(engine.get_tensor(n), t) for n, t in checkpoint(sd).items())
    finally:
        session.close()
