#!/usr/bin/env bash
# The device runs, on a machine with CUDA (one GPU for part `one`, two for part `two` and `bench`):
#   one   - every one-GPU test, the delta diff kernel probe, the colocated sync beside a D2D copy
#   two   - every GPU test (those needing 2 GPUs included; Megatron wheels from .whl/ if carried)
#   vllm  - the real CUDA vLLM tests (tests/test_vllm_cuda.py; vLLM carried by bench/vllm_carry.sh, nixl-cu13 in .nixl/
#           for the TP=2 server on 2 GPUs),
#           stacks of every Python process dumped by py-spy into $OUT/stacks.txt if a run hangs
#   vllm-bench - a real CUDA vLLM engine (GPU 0) fed from GPU 1: raw NCCL, vLLM's own packed NCCL
#           path and ours, Qwen2.5-7B and Qwen3-30B-A3B shapes (bench/vllm_sync_bench.py)
#   vllm-one - one GPU: the colocated, LoRA and MoE vLLM tests, the GPU race test, the colocated vLLM bench
#   vllm-x4 - on 4 GPUs in one call: vllm-bench (GPUs 2-3) beside the two-GPU vLLM tests (GPUs 0-1)
#   vllm-tp2 - a TP=2 vLLM engine fed by two FSDP2 ranks (bench/vllm_tp2_bench.py): 4 GPUs over nccl beside a raw
#           broadcast, or 2 GPUs as a hybrid engine over nixl (.nixl/ carried); issue 44 item 1
#   vllm-three - the vLLM tests that need three GPUs (a TP=2 engine or two FSDP2 ranks beside the engine)
#   fanout - 4 GPUs: one sender to three receivers (7B, 30B-A3B shapes) beside the raw broadcast
#   fp8-bench - a bf16 and an FP8-wire sync of the same model (7B, 30B-A3B), reference receiver
#   x4-rest - 4 GPUs: vllm-three beside fp8-bench, then fanout
#   nixl  - the pull transport on GPUs (nixl-cu13 wheel carried in .nixl/): a nixl sync of Qwen2.5-7B and
#           Qwen3-30B-A3B shapes beside nccl's raw broadcast and sync of the same bytes (issue 43)
#   vllm-join - 2 GPUs: a late vLLM engine (GPU 1) joins from a serving one (GPU 0) with NIXL reads, time to
#           serve against bytes / link + 2 s (bench/vllm_join_bench.py; vLLM carried, nixl-cu13 in .nixl/; issue 43)
#   bench - dense and delta syncs of Qwen2.5-7B and Qwen3-30B-A3B shapes over NCCL beside the raw
#           broadcast, and the FSDP2 shrunk topology (2 trainer ranks, receiver beside rank 1)
# JSON lands in $OUT (or bench/out/); each step is bounded so one call fits the device's limit.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
out=${OUT:-bench/out}
mkdir -p "$out"
part=${1:-one}
nvidia-smi -L
if ls .whl/*/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD
fi
with_nixl() {  # the carried nixl-cu13 wheel (.nixl/) installed once and put on PYTHONPATH; fails without it
  [ -d /tmp/nixl ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/nixl .nixl/*.whl || return 1
  export PYTHONPATH=/tmp/nixl:$PYTHONPATH
}
bench() {  # bench NAME ARGS...: one `ckpt-engine bench` into $out/NAME.json, its summary lines printed
  name=$1; shift; echo "== $name: $*"
  timeout "${BENCH_TIMEOUT:-150}" python -m ckpt_engine.cli bench "$@" --json "$out/$name.json" > "$out/$name.log" 2>&1; grep -v "^$" "$out/$name.log" | tail -n 6
}
watchdog() {  # watchdog SECONDS PID: dump every Python stack (py-spy, if carried) when PID outlives SECONDS
  # (it polls, so it ends with PID, and keeps off stdout: a caller's `| tail` would wait for its sleep)
  ( for _ in $(seq "$1"); do kill -0 "$2" 2>/dev/null || exit 0; sleep 1; done
    for p in $(pgrep -f "python|VLLM"); do echo "=== pid $p: $(tr '\0' ' ' < /proc/$p/cmdline | head -c 200)"; py-spy dump --pid "$p" 2>&1 | head -n 80; done > "$out/stacks.txt" 2>&1 ) >/dev/null 2>&1 &
}
case "$part" in
vllm)
  python3 -c "import vllm" 2>/dev/null || bash bench/vllm_carry.sh install || exit 1
  bash bench/vllm_carry.sh plugin .  # the `ckpt_engine` weight-transfer backend, for a checkout run from PYTHONPATH
  if ls .nixl/*.whl >/dev/null 2>&1; then with_nixl || exit 1; fi  # nixl carried: the TP=2 routes pull over it on 2 GPUs
  export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_USE_DEEP_GEMM=0 NCCL_DEBUG=${NCCL_DEBUG:-WARN}
  # each failure lands in $out/failures.txt as it happens (bench/pytest_eager.py), and -rA names every outcome
  # (--timeout: pytest-timeout, on the GPU image, ends one stuck test and lets the rest run)
  EAGER_REPORT=$out/failures.txt timeout "${VLLM_TEST_TIMEOUT:-420}" python -m pytest -v -rA -m gpu -p no:cacheprovider -p bench.pytest_eager \
    --timeout "${VLLM_PER_TEST_S:-200}" --tb=short ${VLLM_TESTS:-tests/test_vllm_cuda.py} ${VLLM_K:+-k "$VLLM_K"} > "$out/vllm_tests.log" 2>&1 &
  pid=$!; watchdog "${VLLM_HANG_S:-300}" $pid; wait $pid; echo "pytest exit $?"
  grep -E "(PASSED|FAILED|ERROR|SKIPPED)" "$out/vllm_tests.log" | tail -n 30; [ -f "$out/failures.txt" ] && grep -E "^(E  |====)" "$out/failures.txt" | head -n 40
  if [ -n "${VLLM_FP8:-}" ]; then
    echo "== an FP8 engine (online quantization of bf16) starting"
    timeout 170 python bench/vllm_fp8_start.py > "$out/fp8_start.log" 2>&1 &
    pid=$!; out=$out/fp8 ; mkdir -p "$out"; watchdog 150 $pid; wait $pid; echo "fp8 start exit $?"; tail -n 15 "${out%/fp8}/fp8_start.log"
  fi
  ;;
vllm-bench)
  python3 -c "import vllm" 2>/dev/null || bash bench/vllm_carry.sh install || exit 1
  export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_USE_DEEP_GEMM=0
  IFS=';' read -ra specs <<< "${VLLM_BENCH:-qwen2.5-7b 0.3;qwen3-30b-a3b 0.55 --no-staged}"  # PRESET GPU_MEM [ARGS]; ...
  for spec in "${specs[@]}"; do
    set -- $spec; preset=$1; mem=$2; shift 2
    echo "== vllm sync bench $preset $*"
    timeout "${VLLM_BENCH_TIMEOUT:-280}" python bench/vllm_sync_bench.py --preset "$preset" --gpu-mem "$mem" "$@" \
      --json "$out/vllm_bench_$preset.json" > "$out/vllm_bench_$preset.log" 2>&1 &
    pid=$!; watchdog "${VLLM_HANG_S:-250}" $pid; wait $pid; echo "exit $?"; grep -E "^(raw|vllm_packed|ours|\{)" "$out/vllm_bench_$preset.log" | tail -n 6
  done
  ;;
vllm-x4)  # 4 GPUs in one call: vllm-bench on GPUs 2-3 beside the tests that fit GPUs 0-1
  python3 -c "import vllm" 2>/dev/null || bash bench/vllm_carry.sh install || exit 1
  mkdir -p "$out/bench" "$out/two"
  (CUDA_VISIBLE_DEVICES=2,3 OUT=$out/bench bash "$0" vllm-bench > "$out/bench/run.txt" 2>&1) &
  b=$!
  CUDA_VISIBLE_DEVICES=0,1 OUT=$out/two VLLM_TEST_TIMEOUT=${VLLM_TWO_S:-300} VLLM_HANG_S=${VLLM_TWO_S:-300} bash "$0" vllm
  wait $b; tail -n 12 "$out/bench/run.txt"
  ;;
vllm-three)  # the vLLM tests that need three GPUs or more (a TP=2 engine, two FSDP2 ranks beside the engine)
  mkdir -p "$out/three"
  OUT=$out/three VLLM_TEST_TIMEOUT=${VLLM_THREE_S:-240} VLLM_HANG_S=${VLLM_THREE_S:-240} VLLM_K="tp2_server or (fsdp2 and not handoff)" bash "$0" vllm
  ;;
fp8-bench)  # 2 GPUs: a bf16 sync and an FP8-wire sync (quantize included) of the same model, one call
  # (the region bench with one TP=1 receiver: its `full` mode is a whole-model sync; the dense bench takes no --wire-dtype)
  IFS=';' read -ra specs <<< "${FP8_BENCH:-qwen2.5-7b;qwen3-30b-a3b}"  # PRESET [ARGS]; ...
  for spec in "${specs[@]}"; do
    set -- $spec; preset=$1; shift
    bench "bf16_$preset" --backend nccl --preset "$preset" --receiver-tp 1 --receivers 1 --iters 3 "$@"
    bench "fp8_$preset" --backend nccl --preset "$preset" --receiver-tp 1 --receivers 1 --iters 3 --wire-dtype fp8 "$@"
  done
  ;;
x4-rest)  # 4 GPUs: the three-GPU vLLM tests (GPUs 0-2) beside the FP8 wire bench (GPU 3 -> GPU 0), then the fan-out
  mkdir -p "$out/fp8"
  (CUDA_VISIBLE_DEVICES=3,0 OUT=$out/fp8 bash "$0" fp8-bench > "$out/fp8/run.txt" 2>&1) &
  b=$!
  bash "$0" vllm-three
  wait $b; grep -E "^==|ours|GB/s" "$out/fp8/run.txt" | head -n 30
  bash "$0" fanout
  ;;
fanout)  # 4 GPUs: one sender (cuda:0) to three receivers, Qwen2.5-7B and Qwen3-30B-A3B shapes, beside the raw broadcast
  for preset in qwen2.5-7b qwen3-30b-a3b; do
    bench "fanout_${preset}" --backend nccl --preset "$preset" --receivers 3 --bucket-mb 1024 --modes raw,ours --iters 5
    bench "fanout_${preset}_inplace" --backend nccl --preset "$preset" --receivers 3 --bucket-mb 1024 --modes raw,ours --iters 5 --in-place
  done
  ;;
vllm-one)  # one GPU: the vLLM tests that fit it (colocated, LoRA, an engine core in this process), the race
  # test, the colocated vLLM bench with vLLM's engine core in its own process and in the trainer's
  VLLM_TESTS="tests/test_gpu_installed_race.py tests/test_installed_folds.py tests/test_gpu_transfer.py::test_colocated_sender_and_receiver_in_one_process tests/test_vllm_cuda_lora.py tests/test_vllm_cuda.py::test_colocated_on_the_engines_gpu tests/test_vllm_cuda.py::test_installed_check_on_cuda_names_a_wrong_byte tests/test_vllm_cuda.py::test_vllm_serve_colocated_on_the_trainers_gpu tests/test_vllm_cuda_inprocess.py tests/test_vllm_cuda_native.py tests/test_vllm_cuda_moe.py" \
    VLLM_TEST_TIMEOUT=${VLLM_ONE_S:-420} VLLM_HANG_S=${VLLM_ONE_S:-420} bash "$0" vllm
  for mp in 1 0; do
    echo "== vllm colocated bench ${VLLM_COLO_PRESET:-qwen2.5-7b}, VLLM_ENABLE_V1_MULTIPROCESSING=$mp"
    VLLM_ENABLE_V1_MULTIPROCESSING=$mp timeout "${VLLM_BENCH_TIMEOUT:-280}" python bench/vllm_colocated_bench.py --preset "${VLLM_COLO_PRESET:-qwen2.5-7b}" \
      --gpu-mem 0.3 --json "$out/vllm_colocated_mp$mp.json" > "$out/vllm_colocated_mp$mp.log" 2>&1 &
    pid=$!; watchdog 250 $pid; wait $pid; echo "exit $?"; grep -E "^(copy|ours|loaders|checked|staged|\{)|Error" "$out/vllm_colocated_mp$mp.log" | tail -n 8
  done
  ;;
nixl)  # 2 GPUs: nixl pulls beside nccl (raw broadcast and sync) of the same shapes, one call
  with_nixl || exit 1
  bash bench/vllm_carry.sh plugin .  # the registry finds the nixl backend by its entry point
  for preset in ${NIXL_PRESETS:-qwen2.5-7b qwen3-30b-a3b}; do
    bench "nccl_$preset" --backend nccl --preset "$preset" --modes raw,ours --iters 3
    bench "nixl_$preset" --backend nixl --device cuda --preset "$preset" --modes ours --iters 3
  done
  ;;
vllm-join)  # 2 GPUs: engine A (GPU 0) synced staged over nccl, engine B (GPU 1) started late joins from it (issue 43)
  python3 -c "import vllm" 2>/dev/null || bash bench/vllm_carry.sh install || exit 1
  with_nixl || exit 1
  export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_USE_DEEP_GEMM=0
  bash bench/vllm_carry.sh plugin .  # entry points (the nixl backend, vLLM's plugin) for a checkout run from PYTHONPATH
  for preset in ${VLLM_JOIN:-qwen2.5-7b}; do  # PRESET ...; VLLM_JOIN_ARGS (e.g. "--gpu-mem 0.48" for qwen3-30b-a3b) go to each
    echo "== vllm join bench $preset ${VLLM_JOIN_ARGS:-}"
    timeout "${VLLM_JOIN_TIMEOUT:-300}" python bench/vllm_join_bench.py --preset "$preset" ${VLLM_JOIN_ARGS:-} \
      --json "$out/vllm_join_$preset.json" > "$out/vllm_join_$preset.log" 2>&1 &
    pid=$!; watchdog "${VLLM_HANG_S:-270}" $pid; wait $pid; echo "exit $?"
    grep -E "^vllm join|Error|error|did not finish" "$out/vllm_join_$preset.log" | tail -n 8
  done
  ;;
vllm-tp2)  # a TP=2 vLLM engine fed by two FSDP2 ranks (bench/vllm_tp2_bench.py, issue 44 item 1): with 4 GPUs
  # over nccl (trainer ranks on GPUs 0-1, the engine on 2-3, beside a raw broadcast); with 2 the hybrid engine over nixl
  python3 -c "import vllm" 2>/dev/null || bash bench/vllm_carry.sh install || exit 1
  bash bench/vllm_carry.sh plugin .
  export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_USE_DEEP_GEMM=0
  if [ "$(nvidia-smi -L | wc -l)" -ge 4 ]; then place="--backend nccl --trainer-gpus 0,1 --engine-gpus 2,3"
  else with_nixl || exit 1; place="--backend nixl --trainer-gpus 0,1 --engine-gpus 0,1"; fi
  for preset in ${VLLM_TP2:-qwen2.5-7b qwen3-30b-a3b}; do
    echo "== vllm tp2 bench $preset $place"
    timeout "${VLLM_TP2_TIMEOUT:-420}" python bench/vllm_tp2_bench.py --preset "$preset" $place --timeout "$(( ${VLLM_TP2_TIMEOUT:-420} - 20 ))" \
      --json "$out/vllm_tp2_$preset.json" > "$out/vllm_tp2_$preset.log" 2>&1; echo "exit $?"; tail -n 3 "$out/vllm_tp2_$preset.log"
  done
  ;;
one)
  timeout 240 python -m pytest -q -m gpu -p no:cacheprovider --tb=short tests 2>&1 | tail -n 25
  timeout 90 python bench/delta_kernel_probe.py --gib 1 --changed 0.02 --json "$out/delta_kernel_probe.json" 2>&1 | tail -n 6
  bench colocated_7b --backend colocated --device cuda --preset qwen2.5-7b --modes raw,ours --iters 5 --in-place
  bench colocated_7b_copy --backend colocated --device cuda --preset qwen2.5-7b --modes raw,ours --iters 5
  ;;
two)
  timeout 540 python -m pytest -q -m gpu -p no:cacheprovider --tb=short tests 2>&1 | tail -n 30
  ;;
bench)
  bench dense_7b --backend nccl --preset qwen2.5-7b --modes raw,ours --iters 5
  bench dense_30b24l --backend nccl --preset qwen3-30b-a3b --layers 24 --modes raw,ours --iters 3
  bench delta_7b_lr1e-6 --backend nccl --preset qwen2.5-7b --delta --lr 1e-6 --versions 4 --iters 1 --in-place
  bench delta_7b_lr1e-5 --backend nccl --preset qwen2.5-7b --delta --lr 1e-5 --versions 4 --iters 1 --in-place
  bench delta_30b10l_lr1e-6 --backend nccl --preset qwen3-30b-a3b --layers 10 --delta --lr 1e-6 --versions 4 --iters 1 --in-place
  bench delta_30b10l_lr1e-5 --backend nccl --preset qwen3-30b-a3b --layers 10 --delta --lr 1e-5 --versions 4 --iters 1 --in-place
  for preset in qwen2.5-7b qwen3-30b-a3b; do
    echo "== fsdp2 shrunk $preset (trainers cuda:0,1; receiver on cuda:1; nccl_handoff)"
    timeout 150 python bench/fsdp2_multisender_bench.py --preset $preset --trainers 2 --receivers 1 --receiver-gpus 1 \
      --backend nccl_handoff --modes multi --repeats 3 --json "$out/fsdp2_shrunk_$preset.json" 2>&1 | grep -v "^$" | tail -n 6
  done
  ;;
esac
