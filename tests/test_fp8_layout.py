"""Block-FP8 on the wire, the pure parts: the quantize kernel against the format's definition (bytes,
never tolerances), which tensors are quantized, the scales' receive plans and sender shards, and an
engine's refusals of a layout that disagrees with its own."""

from __future__ import annotations

import pytest
import torch

from ckpt_engine.benchmark.presets import checkpoint_specs, load_preset_config
from ckpt_engine.fp8 import fp8_specs, quantize_block_fp8, quantizes
from ckpt_engine.fp8.checks import fp8_problems
from ckpt_engine.manifest import TensorSpec
from ckpt_engine.planning.regions import Region
from ckpt_engine.planning.tp_ep import tp_ep_plan
from ckpt_engine.sources.fp8 import Fp8WireSource, ShardedFp8WireSource, fp8_wire
from ckpt_engine.benchmark.sharded_source import ShardedStateDictSource
from ckpt_engine.sources.base import StateDictSource


def definition(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The block-FP8 recipe written block by block from its definition (vLLM's convention: amax in
    float32 floored at 1e-4, scale = amax / 448 stored as `scale_inv`, q = w * (1 / scale) cast to e4m3)."""
    rows, cols = w.shape
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    scales = torch.empty(-(-rows // 128), -(-cols // 128), dtype=torch.float32)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            block = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].float()
            amax = torch.clamp(block.abs().max(), min=1e-4)
            scale = amax / torch.tensor(448.0)
            scales[i, j] = scale
            q[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] = (block * (1.0 / scale)).to(torch.float8_e4m3fn)
    return q, scales


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(256, 384), (300, 260), (1, 5), (129, 128)])
def test_quantize_matches_the_formats_definition_bit_for_bit(dtype: torch.dtype, shape: tuple[int, int]) -> None:
    g = torch.Generator().manual_seed(hash((shape, str(dtype))) % 1000)
    w = (torch.randn(shape, generator=g) * 0.02).to(dtype)
    if shape[0] > 128 and shape[1] > 128:
        w[:128, :128] = 0  # an all-zero block: amax floored at 1e-4
        w[128:, 128:] *= 1e4  # a block of large values
        w[0, 128] = -0.0
    q, s = quantize_block_fp8(w)
    rq, rs = definition(w)
    assert same_bytes(q, rq) and same_bytes(s, rs)
    if shape[0] > 128 and shape[1] > 128:
        assert s[0, 0].item() == pytest.approx(1e-4 / 448) and not q[:128, :128].float().any()


def test_stacked_experts_quantize_expert_by_expert() -> None:
    w = (torch.randn(3, 200, 150) * 0.02).bfloat16()
    q, s = quantize_block_fp8(w)
    assert q.shape == (3, 200, 150) and s.shape == (3, 2, 2)
    for e in range(3):
        rq, rs = definition(w[e])
        assert same_bytes(q[e], rq) and same_bytes(s[e], rs)


def test_quantize_refuses_what_is_not_a_float_matrix() -> None:
    with pytest.raises(ValueError, match="floating-point matrices"):
        quantize_block_fp8(torch.ones(4))
    with pytest.raises(ValueError, match="floating-point matrices"):
        quantize_block_fp8(torch.ones(4, 4, dtype=torch.int32))


def test_linear_weights_are_quantized_and_everything_else_travels_as_it_is() -> None:
    specs = checkpoint_specs(load_preset_config("qwen3-30b-a3b"), num_layers=1)
    wire = fp8_specs(specs)
    quantized = {s.name for s in specs if quantizes(s)}
    assert "model.layers.0.self_attn.q_proj.weight" in quantized and "model.layers.0.mlp.experts.7.down_proj.weight" in quantized
    for kept in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.mlp.gate.weight", "model.norm.weight",
                 "model.layers.0.self_attn.q_norm.weight", "model.layers.0.input_layernorm.weight"):
        assert kept not in quantized
    by = {s.name: s for s in wire}
    assert len(wire) == len(specs) + len(quantized)
    assert by["model.layers.0.self_attn.o_proj.weight"].dtype == "float8_e4m3fn"
    scale = by["model.layers.0.mlp.experts.0.down_proj.weight_scale_inv"]
    assert (scale.dtype, scale.shape) == ("float32", (16, 6))  # [2048, 768] in 128 x 128 blocks
    q7 = {s.name for s in checkpoint_specs(load_preset_config("qwen2.5-7b"), num_layers=1) if quantizes(s)}
    assert not any(n.endswith(".bias") for n in q7) and len(q7) == 7


def test_the_wire_source_yields_weight_then_scales_in_metadata_order() -> None:
    sd = {"model.layers.0.self_attn.q_proj.weight": torch.randn(256, 128), "model.norm.weight": torch.randn(128)}
    src = Fp8WireSource(StateDictSource(sd, dtype=torch.bfloat16))
    walked = list(src.iter_weights())
    assert [n for n, _ in walked] == [s.name for s in src.metadata()]
    q, s = quantize_block_fp8(sd["model.layers.0.self_attn.q_proj.weight"].bfloat16())  # quantized from the wire's bf16
    assert same_bytes(walked[0][1], q) and same_bytes(walked[1][1], s) and walked[2][1] is sd["model.norm.weight"]
    assert fp8_wire(src, "fp8") is src and fp8_wire(StateDictSource(sd), None).__class__ is StateDictSource
    with pytest.raises(ValueError, match="wire_dtype must be one of fp8"):
        fp8_wire(StateDictSource(sd), "fp4")


def _sharded(rows: int, senders: int) -> list[ShardedFp8WireSource]:
    sd = {"m.q_proj.weight": (torch.randn(rows, 256) * 0.02).bfloat16(), "m.norm.weight": torch.randn(256).bfloat16()}
    return [ShardedFp8WireSource(ShardedStateDictSource(sd, i, senders)) for i in range(senders)]


def test_sharded_senders_quantize_their_own_blocks_of_rows() -> None:
    srcs = _sharded(512, 2)
    owners = srcs[0].owners()
    assert [(s.sender, s.start, s.stop) for s in owners["m.q_proj.weight"]] == [(0, 0, 256 * 256), (1, 256 * 256, 512 * 256)]
    assert [(s.sender, s.start, s.stop) for s in owners["m.q_proj.weight_scale_inv"]] == [(0, 0, 16), (1, 16, 32)]
    whole_q, whole_s = quantize_block_fp8(srcs[0].source.weights["m.q_proj.weight"])
    for i, src in enumerate(srcs):
        src.begin_pieces()
        s, q = src.local_piece("m.q_proj.weight_scale_inv"), src.local_piece("m.q_proj.weight")  # either order
        src.end_pieces()
        assert same_bytes(q, whole_q[i * 256 : (i + 1) * 256]) and same_bytes(s, whole_s[i * 2 : (i + 1) * 2])


def test_a_sender_shard_inside_a_block_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"m\.q_proj\.weight: sender 0 holds rows \[0, 192\).*128-row block boundaries.*senders=rank0"):
        _sharded(384, 2)[0].owners()


def test_tp_slices_hold_the_scales_of_their_blocks_and_off_block_slices_are_refused() -> None:
    specs = fp8_specs([TensorSpec("l.q_proj.weight", "bfloat16", (512, 256)), TensorSpec("l.o_proj.weight", "bfloat16", (256, 512))])
    plan = tp_ep_plan(specs, tp_size=2, tp_rank=1)
    assert plan is not None
    assert plan.holds["l.q_proj.weight_scale_inv"] == (Region(0, 2, 2),)
    assert plan.holds["l.o_proj.weight_scale_inv"] == (Region(1, 2, 2),)
    with pytest.raises(ValueError, match=r"l\.q_proj\.weight: this rank holds \[128, 192\) of dim 0.*block boundaries"):
        tp_ep_plan(fp8_specs([TensorSpec("l.q_proj.weight", "bfloat16", (256, 256))]), tp_size=4, tp_rank=2)
    ep = tp_ep_plan(fp8_specs([TensorSpec(f"l.experts.{e}.up_proj.weight", "bfloat16", (256, 128)) for e in range(4)]), ep_size=2, ep_rank=1)
    assert ep is not None and set(ep.holds) == {f"l.experts.{e}.up_proj.weight{s}" for e in (2, 3) for s in ("", "_scale_inv")}


ENGINE = {s.name: s for s in fp8_specs([TensorSpec("l.q_proj.weight", "bfloat16", (512, 256)), TensorSpec("l.norm.weight", "bfloat16", (256,))])}


def _problems(changes: dict[str, TensorSpec | None]) -> list[str]:
    sent = dict(ENGINE)
    for name, spec in changes.items():
        if spec is None:
            del sent[name]
        else:
            sent[name] = spec
    return fp8_problems(list(sent.values()), ENGINE)[0]


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"l.q_proj.weight": TensorSpec("l.q_proj.weight", "bfloat16", (512, 256)), "l.q_proj.weight_scale_inv": None},
         r"l\.q_proj\.weight: the wire carries bfloat16 but the engine holds block-FP8.*set checkpoint_engine\.wire_dtype=fp8"),
        ({"l.q_proj.weight_scale_inv": None}, r"without its scale tensor l\.q_proj\.weight_scale_inv"),
        ({"l.q_proj.weight_scale_inv": TensorSpec("l.q_proj.weight_scale_inv", "bfloat16", (4, 2))}, r"scales sent as bfloat16 but the engine keeps float32"),
        ({"l.q_proj.weight_scale_inv": TensorSpec("l.q_proj.weight_scale_inv", "float32", (2, 4))}, r"scales sent transposed \(\[2, 4\]"),
        ({"l.q_proj.weight_scale_inv": TensorSpec("l.q_proj.weight_scale_inv", "float32", (8, 4))}, r"mean 64 x 64 blocks of \[512, 256\], but the engine's checkpoint uses 128 x 128"),
    ],
)
def test_an_fp8_layout_that_disagrees_is_refused_by_name(changes: dict[str, TensorSpec | None], match: str) -> None:
    problems = _problems(changes)
    assert len(problems) == 1 and __import__("re").search(match, problems[0]), problems


def test_fp8_into_an_engine_holding_bf16_says_to_unset_the_key() -> None:
    engine = {"l.q_proj.weight": TensorSpec("l.q_proj.weight", "bfloat16", (512, 256))}
    problems, covered = fp8_problems(list(ENGINE.values()), engine)
    assert covered == {"l.q_proj.weight", "l.q_proj.weight_scale_inv"}
    assert "the wire is block-FP8 but the engine holds bfloat16; unset checkpoint_engine.wire_dtype" in problems[0]
    assert problems[1].endswith("the same fix as above")
    assert fp8_problems(list(ENGINE.values()), ENGINE) == ([], set())


def test_an_fp8_plan_puts_half_bucket_tensors_alone_unless_solo_bytes_is_set() -> None:
    """A pipelined engine whose transport sets no `solo_bytes` (colocated here; NCCL on the GPU,
    `tests/test_gpu_fp8.py`) plans the FP8 wire with each tensor of at least half a bucket in a
    bucket of its own (the bf16 embedding and head travel as they are: a sender lends them from
    their own memory); `solo_bytes: 0` keeps the packed plan, and a bf16 plan is untouched."""
    from ckpt_engine.registry import CheckpointEngineRegistry

    specs = [
        TensorSpec("model.embed_tokens.weight", "bfloat16", (512, 256)),
        TensorSpec("model.layers.0.mlp.up_proj.weight", "bfloat16", (256, 256)),
        TensorSpec("model.layers.0.input_layernorm.weight", "bfloat16", (256,)),
        TensorSpec("lm_head.weight", "bfloat16", (512, 256)),
    ]
    bucket = 1 << 19  # the embedding is half of it

    def plan(wire: list[TensorSpec], **kwargs: int) -> list[list[str]]:
        engine = CheckpointEngineRegistry.new("colocated", bucket_size_bytes=bucket, **kwargs)
        return [[e.name for e in b.entries] for b in engine.plan(wire).buckets]

    fp8 = fp8_specs(specs)
    assert plan(fp8) == [
        ["model.embed_tokens.weight"],
        ["model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight_scale_inv", "model.layers.0.input_layernorm.weight"],
        ["lm_head.weight"],
    ]
    assert plan(fp8, solo_bytes=0)[0][:2] == ["model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight"]
    assert plan(specs)[0][:2] == ["model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight"]
