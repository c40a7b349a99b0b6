"""Host time per sync of a MoE-like model with thousands of small tensors, on CPU (issue 11).

A 30B MoE hand-off sync is host-bound per tensor (18,867 tensors, ~9,400 expert pieces per
trainer rank), not link-bound. This probe builds a tiny Qwen3-MoE config with the real model's
tensor count per layer (128 experts x 3 per layer; tiny hidden sizes, so the bytes are few and the
sync time is almost all host time), and runs `fsdp2_multisender_bench.py` on CPU in the shrunk
hand-off topology: FSDP2 trainer ranks 0 and 1 both send, rank 1 "beside" the one receiver hands
its buckets over in shared memory, rank 0 broadcasts over gloo. It prints the median sync time,
the time per tensor, and (with --profile) each rank's top functions by own time.

    python bench/many_tensors_probe.py --layers 8 --repeats 5 --profile
"""

from __future__ import annotations

import argparse
import json
import os
import pstats
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def tiny_moe_config(layers: int, experts: int) -> dict[str, object]:
    """A Qwen3-MoE config with the 30B's tensor layout per layer and tiny sizes. The expert width
    keeps the fp32 routers under 1/32 of the wire bytes, as in the real model, so the FSDP2 source
    reports stable pieces (the path the GPU bench takes)."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "dtype": "bfloat16",
        "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": layers,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": experts,
        "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
        "vocab_size": 512, "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
    }


def _top(path: str, n: int) -> list[str]:
    stats = pstats.Stats(path)
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:n]  # by own (total) time
    total = sum(v[2] for v in stats.stats.values())
    out = [f"  own time {total:.3f} s in all"]
    for (file, line, func), (_, calls, own, cum, _) in rows:
        out.append(f"  {own:7.4f} s own {cum:7.4f} s cum {calls:8d} calls  {os.path.basename(file)}:{line} {func}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--bucket-mb", type=int, default=1, help="1 MiB holds ~250 tiny experts, like 1 GiB of the 30B's")
    p.add_argument("--profile", action="store_true", help="print each rank's top functions (cProfile of one more sync)")
    p.add_argument("--top", type=int, default=14)
    args = p.parse_args(argv)
    sys.path.insert(0, HERE)
    import fsdp2_multisender_bench as bench

    with tempfile.TemporaryDirectory() as tmp:
        config = os.path.join(tmp, "config.json")
        with open(config, "w") as f:
            json.dump(tiny_moe_config(args.layers, args.experts), f)
        out = os.path.join(tmp, "out.json")
        cmd = ["--device", "cpu", "--preset", config, "--trainers", "2", "--receivers", "1", "--receiver-gpus", "1",
               "--backend", "nccl_handoff", "--modes", "multi", "--bucket-mb", str(args.bucket_mb),
               "--repeats", str(args.repeats), "--json", out]
        if args.profile:
            cmd += ["--profile", tmp]
        with open(os.devnull, "w") as null:
            saved, sys.stdout = sys.stdout, null  # the bench prints its whole summary; keep the figures
            try:
                rc = bench.main(cmd)
            finally:
                sys.stdout = saved
        if rc != 0:
            sys.stderr.write(f"the bench failed (exit {rc})\n")
            return rc
        with open(out) as f:
            summary = json.load(f)["summary"]
        sync, tensors = summary["multi_s"], summary["tensors"]
        sys.stdout.write(
            f"{tensors} tensors, {summary['bytes'] / 1e6:.1f} MB, stable pieces {summary['stable_pieces']}, "
            f"correct {summary['multi_correct']}, copy plans built {summary.get('multi_plan_builds', 'n/a')}\n"
            f"hand-off sync (2 senders, 1 local, 1 receiver, CPU): median {sync * 1e3:.1f} ms = "
            f"{sync / tensors * 1e6:.2f} us per tensor; raw broadcast {summary['raw_single_s'] * 1e3:.2f} ms\n"
        )
        if args.profile:
            for role in ("trainer0", "trainer1", "receiver0"):
                sys.stdout.write(f"{role}:\n" + "\n".join(_top(os.path.join(tmp, f"{role}.prof"), args.top)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
