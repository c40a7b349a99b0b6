# Sourced by the device scripts: `bench NAME ARGS...` runs one `ckpt-engine bench` into
# $out/NAME.json (bounded by $BENCH_TIMEOUT seconds, default 240) and prints its modes.
bench() {
  name=$1; shift; echo "== $name: $*"
  timeout "${BENCH_TIMEOUT:-240}" python -m ckpt_engine.cli bench "$@" --json "$out/$name.json" 2>&1 | grep -v "^$" | tail -n 3
  python bench/summarize.py "$out/$name.json"
}
