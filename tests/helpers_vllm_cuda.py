"""What the CUDA vLLM tests (tests/test_vllm_cuda.py, tests/test_vllm_cuda_fp8.py) read of an
in-process engine: its greedy tokens on fixed prompts and the sha256 of every parameter and buffer
in vLLM's own layout (`ckpt_param_digests`)."""

from __future__ import annotations

from typing import Any

__all__ = ["PROMPTS", "digests", "greedy"]

PROMPTS = [[5, 6, 7, 8], [100, 3, 250, 17, 42]]


def greedy(llm: Any) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def digests(llm: Any) -> dict[str, str]:
    (out,) = llm.collective_rpc("ckpt_param_digests")
    return out
