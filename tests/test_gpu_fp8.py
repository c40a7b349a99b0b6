"""Block-FP8 on CUDA: the CUDA path (the Triton kernel) and the eager recipe run on CUDA both equal
the CPU reference bit for bit, and their rates on this GPU are printed for bench/RESULTS.md."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch

from ckpt_engine.fp8 import quantize_block_fp8
from ckpt_engine.fp8.quantize import quantize_block_fp8_reference
from ckpt_engine.fp8.quantize_kernel import quantize_block_fp8_group, quantize_block_fp8_triton

pytestmark = pytest.mark.gpu

Quantize = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(3584, 3584), (18944, 3584), (300, 260), (8, 768, 2048)])
@pytest.mark.parametrize("path", ["kernel", "eager"])
def test_cuda_quantize_equals_the_cpu_reference_bit_for_bit(path: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    quantize: Quantize = quantize_block_fp8 if path == "kernel" else quantize_block_fp8_reference
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(shape, generator=g) * 0.02).to(dtype)
    w[..., :128, :128] = 0
    q, s = quantize(w.cuda())
    rq, rs = quantize_block_fp8_reference(w)
    assert torch.equal(q.cpu().view(torch.uint8), rq.view(torch.uint8))
    assert torch.equal(s.cpu().view(torch.int32), rs.view(torch.int32))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second GPU")
def test_weights_on_another_gpu_than_the_current_one_quantize_there() -> None:
    """A sender's weights on cuda:1 while cuda:0 is current (an engine beside it on cuda:0): both
    kernels launch on the weights' GPU (each launch on cuda:0 was refused, the join's warm-up first)."""
    torch.cuda.set_device(0)
    w = (torch.randn(2, 256, 384, generator=torch.Generator().manual_seed(3)) * 0.02).bfloat16()
    rq, rs = quantize_block_fp8_reference(w)
    on1 = w.to("cuda:1")
    for q, s in [quantize_block_fp8_triton(on1), *quantize_block_fp8_group([on1])]:
        assert q.device == torch.device("cuda:1") and torch.cuda.current_device() == 0
        assert torch.equal(q.cpu().view(torch.uint8), rq.view(torch.uint8))
        assert torch.equal(s.cpu().view(torch.int32), rs.view(torch.int32))


def _ms(quantize: Quantize, w: torch.Tensor) -> float:
    for _ in range(3):
        quantize(w)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        quantize(w)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 10


def test_cuda_quantize_throughput_is_reported() -> None:
    """Not a timed assertion: prints the rates on this GPU of the kernel (the hardware's e4m3
    rounding, the CUDA default on sm_89+), the kernel with its integer rounding, and the eager
    recipe, for bench/RESULTS.md (issue 41: 1.9 TB/s compiled on an H100), for 1 GiB of bf16 and for a 7B
    layer's shapes one launch each (where per-launch costs show)."""
    name = torch.cuda.get_device_name(0)
    big = torch.randn(16384, 32768, device="cuda").bfloat16()  # 1 GiB of bf16
    layer = [torch.randn(shape, device="cuda").bfloat16() for shape in [(3584, 3584), (512, 3584), (512, 3584), (3584, 3584), (18944, 3584), (18944, 3584), (3584, 18944)]]
    layer_bytes = sum(t.nbytes for t in layer)
    paths: list[tuple[str, Quantize]] = [
        ("kernel", quantize_block_fp8),
        ("kernel, integer rounding", functools.partial(quantize_block_fp8_triton, hw_cvt=False)),
        ("eager", quantize_block_fp8_reference),
    ]
    for label, quantize in paths:
        ms = _ms(quantize, big)
        layer_ms = _ms(lambda _: [quantize(t) for t in layer][0], big)
        print(
            f"block-FP8 quantize ({label}) of 1 GiB bf16: {ms:.3f} ms = {big.nbytes / ms / 1e9:.2f} TB/s read; "
            f"one 7B layer's 7 weights: {layer_ms:.3f} ms = {layer_bytes / layer_ms / 1e9:.2f} TB/s read, on {name}"
        )
        assert ms > 0 and layer_ms > 0


def test_an_fp8_plan_over_nccl_sends_the_large_tensors_as_they_are_alone() -> None:
    """With `solo_bytes` unset, the FP8 wire's plan over NCCL puts each tensor of at least half a
    bucket (Qwen2.5-7B's bf16 embedding and head) in a bucket of its own: the sender lends it from
    its own memory and the first bucket moves before anything is quantized. `solo_bytes: 0` keeps
    the packed plan; a bf16 plan is untouched."""
    from ckpt_engine.benchmark.presets import checkpoint_specs, load_preset_config
    from ckpt_engine.fp8.layout import fp8_specs
    from ckpt_engine.registry import CheckpointEngineRegistry

    specs = checkpoint_specs(load_preset_config("qwen2.5-7b"), num_layers=2)
    bucket = 1280 << 20
    fp8 = CheckpointEngineRegistry.new("nccl", bucket_size_bytes=bucket).plan(fp8_specs(specs))
    names = [[e.name for e in b.entries] for b in fp8.buckets]
    assert names[0] == ["model.embed_tokens.weight"] and names[-1] == ["lm_head.weight"], names
    never = CheckpointEngineRegistry.new("nccl", bucket_size_bytes=bucket, solo_bytes=0).plan(fp8_specs(specs))
    assert len(never.buckets[0].entries) > 1
    bf16 = CheckpointEngineRegistry.new("nccl", bucket_size_bytes=bucket).plan(specs)
    assert len(bf16.buckets[0].entries) > 1
