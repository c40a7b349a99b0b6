#!/usr/bin/env bash
# Bring vLLM 0.26 (CUDA) to a GPU machine that has no package access.
#
#   bash bench/vllm_carry.sh fetch     # here: download the pinned wheels, check every hash,
#                                      # tar them and split the tar into 58 MiB parts under .vllm/
#   bash bench/vllm_carry.sh install   # there: join the parts carried to .vllm/ and install
#   bash bench/vllm_carry.sh plugin    # there: ckpt-engine's vLLM plugin entry point beside a checkout
#
# The wheel list with its hashes: bench/vllm-wheels-0.26.0.sha256 (or $VLLM_WHEELS): vLLM 0.26.0 (CUDA 13)
# and its dependencies that the GPU machines lack (torch 2.11 is there already).
# A device call carries at most 64 MiB, so the parts travel one per call (`carry: [".vllm/part"]`);
# each call moves its part out of the repository into /tmp/vllm-parts, where it stays while the
# machine is warm; chain the calls within the machine's 30 s warm window:
#   run(carry=[".vllm/partN"], command="bash bench/vllm_carry.sh keep .vllm/partN")   # N = aa, ab, ...
#   run(command="bash bench/vllm_carry.sh install && bash bench/gpu_runs.sh vllm")
# `bench/gpu_runs.sh vllm` installs from /tmp/vllm-parts by itself when vLLM is not importable.
set -euo pipefail
cd "$(dirname "$0")/.."
list=${VLLM_WHEELS:-bench/vllm-wheels-0.26.0.sha256}
dir=.vllm
parts=/tmp/vllm-parts
case "${1:-}" in
fetch)
  mkdir -p "$dir/wheels"
  grep -q '^/\.vllm/$' .git/info/exclude 2>/dev/null || echo /.vllm/ >> .git/info/exclude
  reqs=$(awk '{print $2}' "$list" | sed -E 's/^([^-]+)-([^-]+)-.*/\1==\2/')
  missing=()
  for r in $reqs; do
    n=${r%%==*}; v=${r##*==}
    ls "$dir/wheels/$n-$v-"*.whl >/dev/null 2>&1 || missing+=("$r")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    plats=()
    for p in manylinux_2_39_x86_64 manylinux_2_38_x86_64 manylinux_2_35_x86_64 manylinux_2_34_x86_64 \
             manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
             manylinux_2_17_x86_64 manylinux2014_x86_64 linux_x86_64; do plats+=(--platform "$p"); done
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --abi cp312 --abi abi3 --abi none "${plats[@]}" -d "$dir/wheels" "${missing[@]}"
  fi
  (cd "$dir/wheels" && sha256sum --quiet -c "$OLDPWD/$list")
  rm -f "$dir"/part*
  tar -C "$dir" -cf - wheels | split -b 58M - "$dir/part"
  ls -la "$dir"/part*
  ;;
keep)  # on the device: move one carried part out of the repository
  mkdir -p "$parts"; cp "$2" "$parts/"; ls "$parts"
  ;;
plugin)  # on the device: ckpt-engine's entry points for a checkout run from PYTHONPATH (DIR, default .)
  # (vLLM finds the `ckpt_engine` weight-transfer backend through them, the registry the nixl backend; no pip install of the project)
  d=${2:-.}/ckpt_engine-0.dev0.dist-info; mkdir -p "$d"
  printf 'Metadata-Version: 2.1\nName: ckpt-engine\nVersion: 0.dev0\n' > "$d/METADATA"
  printf '[vllm.general_plugins]\nckpt_engine = ckpt_engine.rollout_adapters.vllm.plugin:register\n\n[ckpt_engine.backends]\nnixl = ckpt_engine.transports.nixl:NixlTransport\n' > "$d/entry_points.txt"
  ;;
install)  # on the device: join, untar, install into the machine's own Python (cutlass-dsl needs its .pth)
  python3 -c "import vllm" 2>/dev/null && { echo "vllm already installed"; exit 0; }
  mkdir -p /tmp/vllm-wheels
  cat "$parts"/part* | tar -C /tmp/vllm-wheels -xf -
  (cd /tmp/vllm-wheels/wheels && sha256sum --quiet -c "$OLDPWD/$list")
  python3 -m pip install -q --no-index --no-deps --no-compile /tmp/vllm-wheels/wheels/*.whl
  # py-spy (carried in .whl/ beside the last part, if at all) dumps the stacks of a hung run
  ls .whl/py_spy-*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps .whl/py_spy-*.whl
  python3 -c "import vllm; print('vllm', vllm.__version__)"
  ;;
*) echo "usage: $0 fetch | keep PART | install | plugin [DIR]" >&2; exit 2 ;;
esac
