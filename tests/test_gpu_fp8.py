"""Block-FP8 on CUDA: the quantize kernel equals the CPU reference bit for bit, and its rate on this
GPU is printed for bench/RESULTS.md."""

from __future__ import annotations

import pytest
import torch

from ckpt_engine.fp8 import quantize_block_fp8

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(3584, 3584), (18944, 3584), (300, 260), (8, 768, 2048)])
def test_cuda_quantize_equals_the_cpu_reference_bit_for_bit(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(shape, generator=g) * 0.02).to(dtype)
    w[..., :128, :128] = 0
    q, s = quantize_block_fp8(w.cuda())
    rq, rs = quantize_block_fp8(w)
    assert torch.equal(q.cpu().view(torch.uint8), rq.view(torch.uint8))
    assert torch.equal(s.cpu(), rs)


def test_cuda_quantize_throughput_is_reported() -> None:
    """Not a timed assertion: prints the kernel's rate on this GPU for bench/RESULTS.md (issue 41: 1.9 TB/s on an H100)."""
    w = torch.randn(16384, 32768, device="cuda").bfloat16()  # 1 GiB of bf16
    for _ in range(3):
        quantize_block_fp8(w)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        quantize_block_fp8(w)
    end.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(end) / 10
    print(f"block-FP8 quantize of 1 GiB bf16: {ms:.3f} ms = {w.nbytes / ms / 1e9:.2f} TB/s read on {torch.cuda.get_device_name(0)}")
    assert ms > 0
