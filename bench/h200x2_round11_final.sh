#!/usr/bin/env bash
# Round 11's closing device calls on `nvidia-h200-x2` (JSON into bench/results/h200x2_round11/,
# packed into $OUT): part a = GPU tests of this round (hand-off, delta table kernel, host-kept
# bases, in-place write-back), the shrunk FSDP2 topology through nccl_handoff, and the
# Megatron-FSDP2 sharded-sender tests (wheels in .whl); part b = delta syncs end to end on the
# final code and many senders over gloo on the host's cores; part c = the tile-map kernel probe, a
# traced 7B patch sync (Chrome traces per rank) and many senders into in-place CPU receivers;
# part d = patch syncs with 2 and 4 GiB buckets, and the 30B shrunk topology.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
out=bench/results/h200x2_round11
mkdir -p "$out"
source bench/lib.sh
part=${1:-a}
nvidia-smi -L | head -n 2
if [ "$part" = a ]; then
  timeout 200 python -m pytest -q -m gpu tests/test_handoff.py tests/test_gpu_delta_codec.py tests/test_gpu_transfer.py \
    -k "handoff or one_pass or delta" 2>&1 | tail -n 6
  echo "== fsdp2 shrunk 7b: trainers GPU0+GPU1, receiver GPU1, nccl_handoff"
  timeout 160 python bench/fsdp2_multisender_bench.py --preset qwen2.5-7b --trainers 2 --receivers 1 --receiver-gpus 1 \
    --backend nccl_handoff --modes multi --repeats 3 --json "$out/fsdp2_shrunk_7b.json" 2>&1 | tail -n 14
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/mfsdp/*.whl .whl/mcore/*.whl .whl/base/*.whl >/dev/null 2>&1 \
    && PYTHONPATH=/tmp/site:$PWD timeout 200 python -m pytest -q tests/test_megatron_fsdp2_shards.py 2>&1 | grep -v "Warning\|warn" | tail -n 6
elif [ "$part" = c ]; then
  timeout 90 python bench/delta_kernel_probe.py --gib 1 --changed 0.02 --reps 5 --json "$out/probe_tilemap.json" 2>&1 | tail -n 1
  BENCH_TIMEOUT=120 bench 7b_delta_lr1e-6_profiled --backend nccl --preset qwen2.5-7b --delta --lr 1e-6 --versions 3 --iters 1 --bucket-mb 1024 --in-place --profile "$out/prof7b"
  for s in 1 2; do  # receivers that offer their tensors (no copy-out on the receiving cores)
    BENCH_TIMEOUT=90 bench cpu_gloo_senders${s}_inplace --backend gloo --device cpu --preset qwen2.5-7b --layers 2 --senders $s --receivers 2 --iters 3 --bucket-mb 256 --in-place
  done
elif [ "$part" = d ]; then  # larger buckets for patch syncs (fewer per-bucket host round trips); the 30B shrunk topology
  for mb in 2048 4096; do
    BENCH_TIMEOUT=100 bench 7b_delta_lr1e-6_inplace_bucket$mb --backend nccl --preset qwen2.5-7b --delta --lr 1e-6 --versions 3 --iters 1 --bucket-mb $mb --in-place
  done
  echo "== fsdp2 shrunk 30b: trainers GPU0+GPU1, receiver GPU1, nccl_handoff"
  timeout 150 python bench/fsdp2_multisender_bench.py --preset qwen3-30b-a3b --trainers 2 --receivers 1 --receiver-gpus 1 \
    --backend nccl_handoff --modes multi --repeats 2 --json "$out/fsdp2_shrunk_30b.json" 2>&1 | grep -A8 '"shrunk"'
else
  export BENCH_TIMEOUT=150
  bench 7b_delta_lr1e-6_inplace_final --backend nccl --preset qwen2.5-7b --delta --lr 1e-6 --versions 4 --iters 3 --bucket-mb 1024 --in-place
  bench 30b10l_delta_lr1e-6_inplace_final --backend nccl --preset qwen3-30b-a3b --layers 10 --delta --lr 1e-6 --versions 5 --iters 3 --bucket-mb 1024 --in-place
  bench 7b_delta_lr1e-5_inplace_final --backend nccl --preset qwen2.5-7b --delta --lr 1e-5 --versions 3 --iters 3 --bucket-mb 1024 --in-place
  BENCH_TIMEOUT=90 bench 7b_delta_lr1e-6_hostbase --backend nccl --preset qwen2.5-7b --delta --lr 1e-6 --versions 2 --iters 2 --bucket-mb 1024 --engine-kwargs '{"delta_base": "host"}'
  for s in 1 2 4; do
    BENCH_TIMEOUT=100 bench cpu_gloo_senders$s --backend gloo --device cpu --preset qwen2.5-7b --layers 2 --senders $s --receivers 2 --iters 3 --bucket-mb 256
  done
fi
if [ -n "${OUT:-}" ]; then tar czf "$OUT/h200x2_round11_$part.tgz" -C bench/results h200x2_round11; fi
