#!/usr/bin/env bash
# Round 12 on `nvidia-h200-x2` (JSON into bench/results/h200x2_round12/, packed into $OUT):
# part a = the receiver's apply probe (swap_in vs gather + scatter + pair_delta), the one-pass
# diff's GPU tests (in-kernel delta sum, wider scatter limit), and delta syncs end to end:
# Qwen2.5-7B at lr 1e-6 and 1e-5 (1e-5 with the CUDA default scatter limit 1/4 and with the old
# 1/32), Qwen3-30B-A3B (10 layers) at 1e-6; part b = the same after the fitted scatter limit with
# hysteresis, the two-bit walk and the header copies from pinned memory: GPU tests of the delta
# and transfer paths, the kernel probe (walk of 1 vs 2 bits), the delta syncs again, 2 GiB buckets;
# part c = the final code (delta sum factored per group in the diff, one-bit walk, the sender's
# walk skipping tensors it checked last sync, the receiver's checks read back once per sync):
# GPU tests, the probe, the delta syncs, a traced 7B patch sync; part d = the diff kernel with the
# scan path of part c taken out again (it slowed the walk 2.5x), checked and timed once more.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
out=bench/results/h200x2_round12
mkdir -p "$out"
source bench/lib.sh
part=${1:-a}
nvidia-smi -L | head -n 2
if [ "$part" = a ]; then
  timeout 100 python bench/delta_apply_probe.py --gib 1 --changed 0.02 0.13 --json "$out/apply_probe.json" 2>&1 | tail -n 8
  timeout 150 python -m pytest -q -m gpu tests/test_gpu_delta_codec.py tests/test_gpu_transfer.py -k "one_pass or delta" -p no:cacheprovider 2>&1 | tail -n 4
  export BENCH_TIMEOUT=120
  bench 7b_delta_lr1e-6_inplace --backend nccl --preset qwen2.5-7b --delta --lr 1e-6 --versions 4 --iters 3 --bucket-mb 1024 --in-place
  bench 7b_delta_lr1e-5_inplace --backend nccl --preset qwen2.5-7b --delta --lr 1e-5 --versions 4 --iters 3 --bucket-mb 1024 --in-place
  bench 7b_delta_lr1e-5_inplace_narrow --backend nccl --preset qwen2.5-7b --delta --lr 1e-5 --versions 4 --iters 3 --bucket-mb 1024 --in-place --engine-kwargs '{"delta_scatter_below": 0.03125}'
  bench 30b10l_delta_lr1e-6_inplace --backend nccl --preset qwen3-30b-a3b --layers 10 --delta --lr 1e-6 --versions 5 --iters 3 --bucket-mb 1024 --in-place
elif [ "$part" = b ] || [ "$part" = c ]; then
  timeout 200 python -m pytest -q -m gpu tests/test_gpu_delta_codec.py tests/test_gpu_transfer.py tests/test_handoff.py -p no:cacheprovider 2>&1 | tail -n 3
  timeout 90 python bench/delta_kernel_probe.py --gib 1 --changed 0.02 0.13 --reps 5 --json "$out/probe_$part.json" 2>&1 | tail -n 2
  export BENCH_TIMEOUT=100
  bench 7b_delta_lr1e-6_inplace_$part --backend nccl --preset qwen2.5-7b --delta --lr 1e-6 --versions 4 --iters 3 --bucket-mb 1024 --in-place
  bench 7b_delta_lr1e-5_inplace_$part --backend nccl --preset qwen2.5-7b --delta --lr 1e-5 --versions 5 --iters 3 --bucket-mb 1024 --in-place
  bench 30b10l_delta_lr1e-6_inplace_$part --backend nccl --preset qwen3-30b-a3b --layers 10 --delta --lr 1e-6 --versions 4 --iters 3 --bucket-mb 1024 --in-place
  for lr in 1e-6 1e-5; do
    [ "$part" = c ] && [ $lr = 1e-5 ] && continue
    bench 7b_delta_lr${lr}_inplace_bucket2048_$part --backend nccl --preset qwen2.5-7b --delta --lr $lr --versions 4 --iters 2 --bucket-mb 2048 --in-place
  done
  if [ "$part" = c ]; then
    echo "== fsdp2 shrunk 7b: trainers GPU0+GPU1, receiver GPU1, nccl_handoff"
    timeout 120 python bench/fsdp2_multisender_bench.py --preset qwen2.5-7b --trainers 2 --receivers 1 --receiver-gpus 1 \
      --backend nccl_handoff --modes multi --repeats 3 --json "$out/fsdp2_shrunk_7b_c.json" 2>&1 | tail -n 6
    BENCH_TIMEOUT=90 bench 7b_delta_lr1e-6_profiled_c --backend nccl --preset qwen2.5-7b --delta --lr 1e-6 --versions 3 --iters 1 --bucket-mb 1024 --in-place --profile "$out/prof7b"
  fi
elif [ "$part" = d ]; then
  timeout 80 python -m pytest -q -m gpu tests/test_gpu_delta_codec.py -k one_pass -p no:cacheprovider 2>&1 | tail -n 2
  timeout 40 python bench/delta_kernel_probe.py --gib 1 --changed 0.02 0.13 --reps 5 --json "$out/probe_d.json" 2>&1 | tail -n 2
  export BENCH_TIMEOUT=60
  bench 7b_delta_lr1e-6_inplace_d --backend nccl --preset qwen2.5-7b --delta --lr 1e-6 --versions 4 --iters 2 --bucket-mb 1024 --in-place
  bench 7b_delta_lr1e-5_inplace_d --backend nccl --preset qwen2.5-7b --delta --lr 1e-5 --versions 5 --iters 2 --bucket-mb 1024 --in-place
fi
if [ -n "${OUT:-}" ]; then tar czf "$OUT/h200x2_round12_$part.tgz" -C bench/results h200x2_round12; fi
