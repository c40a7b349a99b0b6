#!/usr/bin/env bash
# Round 13 on `nvidia-h200-x2` (JSON into bench/results/h200x2_round13/, packed into $OUT):
# part a = the recording cast (`delta_base: cast`): its GPU tests, then delta syncs whose patches
# the trainer's cast recorded, Qwen2.5-7B at lr 1e-6 and 1e-5 and Qwen3-30B-A3B (10 layers) at
# 1e-6, in place, with the device-base path of round 12 at lr 1e-6 for comparison in the same call;
# part b = the same after the frame header carries the patch's own header (the receiver never
# waits on the host for a payload), the many-sender hand-off of the 30B MoE with per-bucket copy
# plans, and the GPU tests of the delta, cast and hand-off paths.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
out=bench/results/h200x2_round13
mkdir -p "$out"
source bench/lib.sh
part=${1:-a}
nvidia-smi -L | head -n 2
cast='{"delta_base": "cast"}'
if [ "$part" = a ]; then
  export BENCH_TIMEOUT=75
  bench 7b_cast_lr1e-6 --backend nccl --preset qwen2.5-7b --delta --lr 1e-6 --versions 3 --iters 1 --bucket-mb 1024 --in-place --engine-kwargs "$cast"
  bench 7b_cast_lr1e-5 --backend nccl --preset qwen2.5-7b --delta --lr 1e-5 --versions 3 --iters 1 --bucket-mb 1024 --in-place --engine-kwargs "$cast"
  bench 7b_device_lr1e-6 --backend nccl --preset qwen2.5-7b --delta --lr 1e-6 --versions 3 --iters 1 --bucket-mb 1024 --in-place
  bench 30b10l_cast_lr1e-6 --backend nccl --preset qwen3-30b-a3b --layers 10 --delta --lr 1e-6 --versions 3 --iters 1 --bucket-mb 1024 --in-place --engine-kwargs "$cast"
  timeout 290 python -m pytest -q -m gpu tests/test_gpu_cast_recorder.py tests/test_gpu_transfer.py tests/test_gpu_delta_codec.py tests/test_handoff.py -p no:cacheprovider --tb=short -x 2>&1 | grep -v "^$" | tail -n 30
elif [ "$part" = b ]; then
  export BENCH_TIMEOUT=60
  bench 7b_cast_lr1e-6_b --backend nccl --preset qwen2.5-7b --delta --lr 1e-6 --versions 3 --iters 1 --bucket-mb 1024 --in-place --engine-kwargs "$cast"
  bench 7b_cast_lr1e-5_b --backend nccl --preset qwen2.5-7b --delta --lr 1e-5 --versions 3 --iters 1 --bucket-mb 1024 --in-place --engine-kwargs "$cast"
  bench 30b10l_cast_lr1e-6_b --backend nccl --preset qwen3-30b-a3b --layers 10 --delta --lr 1e-6 --versions 3 --iters 1 --bucket-mb 1024 --in-place --engine-kwargs "$cast"
  echo "== fsdp2 shrunk 30b: trainers GPU0+GPU1, receiver GPU1, nccl_handoff, per-bucket copy plans"
  timeout 150 python bench/fsdp2_multisender_bench.py --preset qwen3-30b-a3b --trainers 2 --receivers 1 --receiver-gpus 1 \
    --backend nccl_handoff --modes multi --repeats 5 --json "$out/fsdp2_shrunk_30b_b.json" 2>&1 | grep -v "^$" | tail -n 8
  timeout 200 python -m pytest -q -m gpu tests/test_gpu_cast_recorder.py tests/test_gpu_transfer.py tests/test_handoff.py -k "delta or cast or recorded or handoff or hand" -p no:cacheprovider --tb=short -x 2>&1 | grep -v "^$" | tail -n 20
  BENCH_TIMEOUT=60 bench 7b_device_lr1e-6_b --backend nccl --preset qwen2.5-7b --delta --lr 1e-6 --versions 3 --iters 1 --bucket-mb 1024 --in-place
fi
if [ -n "${OUT:-}" ]; then tar czf "$OUT/h200x2_round13_$part.tgz" -C bench/results h200x2_round13; fi
