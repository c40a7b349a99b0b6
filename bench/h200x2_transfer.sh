#!/usr/bin/env bash
# The core-transfer figures of bench/RESULTS.md in one device call on the 2xH200 machine
# (`nvidia-h200-x2`): the GPU transfer tests, then every bench row. JSON files go to
# bench/results/h200x2/ (on the device machine: packed into $OUT/h200x2.tgz).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
out=bench/results/h200x2
mkdir -p "$out"
nvidia-smi -L
python -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version())"
python -m pytest -q -m gpu tests/test_gpu_transfer.py 2>&1 | tail -n 15
bench() { name=$1; shift; echo "== $name: $*"; python -m ckpt_engine.cli bench --backend nccl "$@" --json "$out/$name.json" 2>/dev/null | grep -v "^$"; }
bench 7b_1024_copy --preset qwen2.5-7b --iters 10 --modes raw,bucketed,ours --bucket-mb 1024
bench 7b_1024_inplace --preset qwen2.5-7b --iters 10 --modes raw,ours --bucket-mb 1024 --in-place
bench 7b_default_copy --preset qwen2.5-7b --iters 10 --modes raw,naive,ours
bench 7b_default_inplace --preset qwen2.5-7b --iters 10 --modes raw,ours --in-place
bench 7b_1024_copy_packed --preset qwen2.5-7b --iters 10 --modes raw,ours --bucket-mb 1024 --engine-kwargs '{"group_max_tensors": 0}'
bench 30b_1024_copy --preset qwen3-30b-a3b --iters 5 --modes raw,bucketed,naive,ours --bucket-mb 1024
bench 30b_1024_inplace --preset qwen3-30b-a3b --iters 5 --modes raw,ours --bucket-mb 1024 --in-place
if [ -n "${OUT:-}" ]; then tar czf "$OUT/h200x2.tgz" -C bench/results h200x2; fi
