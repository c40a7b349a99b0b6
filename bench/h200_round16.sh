#!/usr/bin/env bash
# Round 16 on one GPU (`nvidia-h200`; no 2-GPU kind was lent): what the trainer's recording cast
# costs when several casts fall between two syncs (the merge on the accelerator), and the GPU
# tests that need a single GPU. JSON into bench/results/h200_round16/, packed into $OUT.
# part a = the merge probe (1 GiB buckets; a 4 GiB bucket is refused by name: int32 positions)
# and the single-GPU tests of the recording cast, the delta codec and the colocated transfer;
# part b = the probe over 4 casts (cast 2 includes the sort's first allocations) and the recording
# tests after the FSDP2 adapter's shadows were added; part c = what recording costs the FSDP2
# adapter's optimizer step (bench/fsdp2_cast_step_bench.py) and the recording tests again.
set -u
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
out=bench/results/h200_round16
mkdir -p "$out"
nvidia-smi -L | head -n 1
part=${1:-a}
probe() {
  echo "== cast merge probe: $1 GiB, $2 of words per step, $3 steps"
  timeout 120 python bench/cast_merge_probe.py --device cuda --gib "$1" --changed "$2" --steps "$3" \
    --json "$out/cast_merge_${1}gib_${2}_${3}.json" 2>&1 | tail -n 7
}
if [ "$part" = a ]; then
  probe 1 0.02 3
  probe 1 0.05 3
  timeout 300 python -m pytest -q -m gpu tests/test_gpu_cast_recorder.py tests/test_gpu_delta_codec.py tests/test_gpu_transfer.py \
    -k "not nccl" -p no:cacheprovider --tb=short 2>&1 | grep -v "^$" | tail -n 25
elif [ "$part" = c ]; then
  for spec in "qwen2.5-7b 8 1e-6" "qwen2.5-7b 8 1e-5" "qwen3-30b-a3b 4 1e-6"; do
    set -- $spec
    echo "== fsdp2 cast step: $1, $2 layers, lr $3"
    timeout 200 python bench/fsdp2_cast_step_bench.py --preset "$1" --layers "$2" --lr "$3" --repeats 3 \
      --json "$out/fsdp2_cast_step_${1}_${2}l_lr$3.json" 2>&1 | tail -n 8
  done
  timeout 200 python -m pytest -q -m gpu tests/test_gpu_cast_recorder.py -k "not nccl" -p no:cacheprovider --tb=short 2>&1 | grep -v "^$" | tail -n 25
else
  probe 1 0.02 4
  probe 1 0.05 4
  probe 1.9 0.02 4
  timeout 300 python -m pytest -q -m gpu tests/test_gpu_cast_recorder.py -k "not nccl" -p no:cacheprovider --tb=short 2>&1 | grep -v "^$" | tail -n 25
fi
if [ -n "${OUT:-}" ]; then tar czf "$OUT/h200_round16_$part.tgz" -C bench/results h200_round16; fi
