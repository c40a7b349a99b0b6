#!/usr/bin/env bash
# Delta-sync and many-sender figures of bench/RESULTS.md in one device call on `nvidia-h200-x2`:
# the GPU transfer tests on the split core, a dense regression row, delta syncs of real AdamW
# versions (Qwen2.5-7B, and Qwen3-30B-A3B shapes on 10 of 48 layers so masters and moments fit
# one GPU) at lr 1e-6 and 1e-5, and many senders over gloo on the host's cores (a network-bound
# link emulated by TCP). JSON goes to bench/results/h200x2_delta/ (packed into $OUT on the device).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
out=bench/results/h200x2_delta
mkdir -p "$out"
nvidia-smi -L
python -m pytest -q -m gpu tests/test_gpu_transfer.py 2>&1 | tail -n 8
source bench/lib.sh
bench 7b_dense --backend nccl --preset qwen2.5-7b --iters 5 --modes raw,ours --bucket-mb 1024
bench 7b_delta_lr1e-6 --backend nccl --preset qwen2.5-7b --delta --lr 1e-6 --versions 3 --iters 3 --bucket-mb 1024
bench 7b_delta_lr1e-5 --backend nccl --preset qwen2.5-7b --delta --lr 1e-5 --versions 3 --iters 3 --bucket-mb 1024
bench 30b10l_delta_lr1e-6 --backend nccl --preset qwen3-30b-a3b --layers 10 --delta --lr 1e-6 --versions 3 --iters 3 --bucket-mb 1024
for s in 1 2 4; do
  bench cpu_gloo_senders$s --backend gloo --device cpu --preset qwen2.5-7b --layers 2 --senders $s --receivers 2 --iters 3 --bucket-mb 256
done
if [ -n "${OUT:-}" ]; then tar czf "$OUT/h200x2_delta.tgz" -C bench/results h200x2_delta; fi
