"""The block-FP8 quantize: one weight to float8_e4m3fn plus its float32 inverse scales.

`quantize_block_fp8` runs the Triton kernel (`quantize_kernel.py`, one read of the weight) on CUDA
tensors and the eager recipe below everywhere else; the eager recipe is also the reference the
kernel is tested against byte for byte (`tests/test_fp8_quantize_kernel.py`).

The recipe is vLLM's own (`vllm.utils.deep_gemm.per_block_cast_to_fp8`), op for op, so the bytes
are the ones an engine quantizing the same bf16 weights holds: zero-padded to whole 128 x 128
blocks, amax per block in float32 floored at 1e-4, sf = amax / 448 (the stored
`weight_scale_inv`), q = (w * (1 / sf)).to(float8_e4m3fn) (a multiply by the reciprocal, not a
division: they differ in the last bit for some values).
Why the reference is eager torch ops: each op is correctly rounded on CPU and CUDA alike, so the
bytes are the same everywhere. A `torch.compile(dynamic=True)` build differed from them on 4xH200
for every shape and dtype tried, recompiled past its limit per shape, and ran at 0.17 TB/s. Its
cost on a GPU is memory traffic: ~27 bytes per bf16 element over float32 temporaries (a 7B FP8
sync on 2xH200 took 2.35 x its bf16 sync), hence the kernel there.
"""

from __future__ import annotations

import torch

from ckpt_engine.fp8.layout import BLOCK, FP8_DTYPE

__all__ = ["AMAX_FLOOR", "FP8_MAX", "KERNEL_DTYPES", "quantize_block_fp8", "quantize_block_fp8_reference"]


FP8_MAX = float(torch.finfo(FP8_DTYPE).max)
"""448.0: the largest finite float8_e4m3fn value, which each block's amax maps to."""
AMAX_FLOOR = 1e-4
"""vLLM's floor on a block's amax (`clamp(1e-4)`), so an all-zero block has a finite scale."""


KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
"""Input dtypes the CUDA kernel takes (others go through the eager recipe)."""


def quantize_block_fp8(w: torch.Tensor, block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize `w` ([out, in], or [experts, out, in]) into block-FP8 on its own device: (q in
    float8_e4m3fn, same shape; scale_inv in float32, [..., ceil(out / block[0]), ceil(in / block[1])]).
    The same bytes on every device: the Triton kernel on CUDA, the eager reference elsewhere."""
    if w.is_cuda and w.dim() >= 2 and w.dtype in KERNEL_DTYPES and block == BLOCK:
        from ckpt_engine.fp8.quantize_kernel import quantize_block_fp8_triton  # needs Triton: imported where a GPU quantizes

        return quantize_block_fp8_triton(w, block)
    return quantize_block_fp8_reference(w, block)


def quantize_block_fp8_reference(w: torch.Tensor, block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_block_fp8` as vLLM's eager recipe, on any device: the CPU path and the reference."""
    if w.dim() < 2 or not w.is_floating_point():
        raise ValueError(f"block-FP8 quantizes floating-point matrices ([out, in] or [experts, out, in]), got {w.dtype} {tuple(w.shape)}")
    block_rows, block_cols = block
    *lead, rows, cols = w.shape
    br, bc = -(-rows // block_rows), -(-cols // block_cols)
    prows, pcols = br * block_rows, bc * block_cols
    if (prows, pcols) != (rows, cols):
        padded = w.new_zeros((*lead, prows, pcols))
        padded[..., :rows, :cols] = w
    else:
        padded = w
    view = padded.reshape(-1, br, block_rows, bc, block_cols)
    amax = view.abs().float().amax(dim=(2, 4), keepdim=True).clamp(AMAX_FLOOR)
    # Divided by a 0-dim tensor on w's device, not by the Python float: CUDA turns a division by a
    # CPU scalar into a multiply by its float32 reciprocal, which differs from amax / 448 in the last
    # bit for some blocks (seen on H200: 2 of 14 scale tensors of a tiny Qwen2); CPU divides.
    sf = amax / torch.full((), FP8_MAX, dtype=amax.dtype, device=amax.device)
    q = (view * (1.0 / sf)).to(FP8_DTYPE)
    q = q.view(*lead, prows, pcols)[..., :rows, :cols].contiguous()
    return q, sf.view(*lead, br, bc)
