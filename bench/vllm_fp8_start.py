"""Start a vLLM engine with online FP8 quantization of a bf16 checkpoint (dummy weights) and
generate once: how long it takes to come up, or where it hangs (the caller's watchdog dumps stacks)."""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

CONFIG = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 512, "hidden_size": 256,
    "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "torch_dtype": "bfloat16",
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quantization", default="fp8")
    args = ap.parse_args()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    d = Path(tempfile.mkdtemp())
    (d / "config.json").write_text(json.dumps(CONFIG))
    t0 = time.perf_counter()
    llm = LLM(
        model=str(d), load_format="dummy", skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
        quantization=args.quantization, max_model_len=128, max_num_seqs=4, gpu_memory_utilization=0.12,
    )
    up = time.perf_counter() - t0
    out = llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7])], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    print(json.dumps({"quantization": args.quantization, "up_s": round(up, 1), "tokens": list(out[0].outputs[0].token_ids)}))
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
