#!/usr/bin/env bash
# The 4-GPU rows of bench/RESULTS.md (`nvidia-h200-x4`), in two device calls:
#   part 1: GPU transfer tests on the split core; one sender -> three receivers (Qwen2.5-7B and
#           Qwen3-30B-A3B shapes, raw broadcast of the same bytes in the same run); delta syncs of
#           real AdamW versions (one sender GPU -> one receiver GPU) at lr 1e-6 and 1e-5.
#   part 2: FSDP2 on GPU0+GPU1 -> receivers on GPU2+GPU3: single sender vs every rank sending,
#           dense and delta; many senders over gloo on the host's cores.
# JSON goes to bench/results/h200x4/ (packed into $OUT on the device machine).
set -u
part=${1:-1}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
out=bench/results/h200x4
mkdir -p "$out"
show() { python - "$1" <<'PY'
import json, sys
try:
    s = json.load(open(sys.argv[1]))
except Exception as e:
    print("  no result:", e); sys.exit()
for k, m in s.get("modes", {}).items():
    extra = "".join(f" {f}={m[f]:.4g}" for f in ("wire_fraction", "changed_fraction", "encode_s", "apply_s", "ratio_to_raw", "gbps") if f in m)
    print(f"  {k:28s} {m['best_s']:.4f}s{extra}")
print("  correct:", s.get("correct"), s.get("base_bytes", ""), s.get("extra_mem_bytes", ""))
PY
}
bench() { name=$1; shift; echo "== $name: $*"; timeout "${T:-170}" python -m ckpt_engine.cli bench "$@" --json "$out/$name.json" > "$out/$name.log" 2>&1; echo "  exit $?"; show "$out/$name.json"; }
nvidia-smi -L
if [ "$part" = 1 ]; then
  timeout 120 python -m pytest -q -m gpu tests/test_gpu_transfer.py -k "delta or bit_exact" 2>&1 | tail -n 4
  bench 7b_recv3 --backend nccl --preset qwen2.5-7b --receivers 3 --iters 5 --modes raw,ours --bucket-mb 1024
  bench 30b_recv3 --backend nccl --preset qwen3-30b-a3b --receivers 3 --iters 3 --modes raw,ours --bucket-mb 1024
  bench 7b_delta_lr1e-6 --backend nccl --preset qwen2.5-7b --delta --lr 1e-6 --versions 3 --iters 3 --bucket-mb 1024
  bench 7b_delta_lr1e-5 --backend nccl --preset qwen2.5-7b --delta --lr 1e-5 --versions 2 --iters 2 --bucket-mb 1024
  T=150 bench 30b10l_delta_lr1e-6 --backend nccl --preset qwen3-30b-a3b --layers 10 --delta --lr 1e-6 --versions 2 --iters 2 --bucket-mb 1024
else
  for p in qwen2.5-7b qwen3-30b-a3b; do
    echo "== fsdp2 $p single+multi, 2 trainers -> 2 receivers"
    timeout 200 python bench/fsdp2_multisender_bench.py --preset $p --trainers 2 --receivers 2 --modes single,multi --repeats 3 --json "$out/fsdp2_multi_$p.json" 2>&1 | tail -n 12
  done
  echo "== fsdp2 qwen2.5-7b delta, 2 trainers -> 2 receivers"
  timeout 150 python bench/fsdp2_multisender_bench.py --preset qwen2.5-7b --trainers 2 --receivers 2 --modes single,multi --delta --delta-change 0.02 --repeats 3 --json "$out/fsdp2_multi_delta.json" 2>&1 | tail -n 12
  for s in 1 2 4; do
    T=100 bench cpu_gloo_senders$s --backend gloo --device cpu --preset qwen2.5-7b --layers 2 --senders $s --receivers 2 --iters 3 --bucket-mb 256
  done
fi
if [ -n "${OUT:-}" ]; then tar czf "$OUT/h200x4_part$part.tgz" -C bench/results h200x4; fi
