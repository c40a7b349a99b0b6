#!/usr/bin/env bash
# Round 11, first device call on `nvidia-h200-x2`: the one-launch table diff (alignment hints) on
# one H200 against a launch per piece, the GPU delta tests, delta syncs end to end (Qwen2.5-7B at
# lr 1e-6 and 1e-5, Qwen3-30B-A3B shapes on 10 layers with enough versions to pass Triton's first
# compiles), in-place receivers, then the Megatron-FSDP2 sharded-sender tests (wheels in .whl).
# JSON goes to bench/results/h200x2_round11/ (packed into $OUT on the device).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
out=bench/results/h200x2_round11
mkdir -p "$out"
nvidia-smi -L
timeout 120 python bench/delta_kernel_probe.py --gib 1 --changed 0.02 0.005 --json "$out/probe.json" 2>&1 | tail -n 4
timeout 150 python -m pytest -q -m gpu tests/test_gpu_delta_codec.py tests/test_gpu_transfer.py -k "delta or one_pass" 2>&1 | tail -n 6
source bench/lib.sh
export BENCH_TIMEOUT=200
bench 7b_delta_lr1e-6_inplace --backend nccl --preset qwen2.5-7b --delta --lr 1e-6 --versions 5 --iters 3 --bucket-mb 1024 --in-place
bench 30b10l_delta_lr1e-6_inplace --backend nccl --preset qwen3-30b-a3b --layers 10 --delta --lr 1e-6 --versions 6 --iters 3 --bucket-mb 1024 --in-place
bench 7b_delta_lr1e-5_inplace --backend nccl --preset qwen2.5-7b --delta --lr 1e-5 --versions 4 --iters 3 --bucket-mb 1024 --in-place
if [ -n "${OUT:-}" ]; then tar czf "$OUT/h200x2_round11.tgz" -C bench/results h200x2_round11; fi
if ls .whl/mfsdp/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/mfsdp/*.whl .whl/mcore/*.whl .whl/base/*.whl \
    && PYTHONPATH=/tmp/site:$PWD timeout 240 python -m pytest -q tests/test_megatron_fsdp2_shards.py 2>&1 | tail -n 8
fi
