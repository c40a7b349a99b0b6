"""`ckpt-engine bench` end to end on CPU: real processes, figures printed, correctness checked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_bench_tiny_gloo_table_and_json(tmp_path: Path) -> None:
    """One run prints the table and writes the JSON summary (`--json FILE` does both)."""
    path = tmp_path / "bench.json"
    out = subprocess.run(
        [sys.executable, "-m", "ckpt_engine.cli", "bench", "--preset", "tiny", "--backend", "gloo", "--iters", "1",
         "--bucket-mb", "4", "--receivers", "2", "--json", str(path)],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "ckpt-engine sync" in out.stdout and "vs raw" in out.stdout and "equal the sender's" in out.stdout
    summary = json.loads(path.read_text())
    assert summary["correct"] is True and summary["tensors"] == 51 and summary["receivers"] == 2
    assert set(summary["modes"]) == {"raw", "naive", "ours"}
    assert summary["modes"]["raw"]["ratio_to_raw"] == 1.0 and summary["modes"]["ours"]["gbps"] > 0
    assert summary["buckets"] > 1
    # One meaning of ratio_to_raw, said in the JSON; raw says what it moved.
    assert summary["ratio_meaning"].startswith("ratio_to_raw = raw's seconds / these seconds")
    ours = summary["modes"]["ours"]
    assert abs(ours["ratio_to_raw"] - summary["modes"]["raw"]["best_s"] / ours["best_s"]) < 1e-12
    assert summary["raw_meaning"].startswith(f"the same {summary['bytes']} bytes")
    # Every mode's memory on every rank, and the plan for the full model.
    assert all(set(m["extra_mem_bytes"]) == {"rank0", "rank1", "rank2"} for m in summary["modes"].values())
    plan = summary["memory_plan"]
    assert plan["weights"] == summary["bytes"] and plan["raw_extra"] == min(summary["bytes"], 2 * summary["raw_message_bytes"])
    assert plan["naive_extra"] == 0 and plan["peak"] >= plan["weights"] + plan["buffers"]


def test_bench_without_the_cli_extra_names_it_before_any_rank_starts() -> None:
    """rich and tqdm are the `cli` extra, not dependencies: without them the bench says which
    extra to install (exit 2) instead of a traceback, and starts no rank."""
    blocker = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('rich', 'tqdm'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "from ckpt_engine.cli import main\n"
        "sys.exit(main(['bench', '--preset', 'tiny', '--backend', 'gloo']))\n"
    )
    out = subprocess.run([sys.executable, "-c", blocker], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "ckpt-engine bench needs rich, which the `cli` extra installs: pip install 'ckpt-engine[cli]'" in out.stderr
    assert "Traceback" not in out.stderr


def test_bench_raw_never_takes_a_model_sized_buffer() -> None:
    """qwen3-30b-a3b (61 GB of bf16 weights) planned for an 80 GB card: raw's extra memory is two
    1 GiB messages, not a second copy of the model."""
    from ckpt_engine.benchmark.cli import _parser, plan_memory
    from ckpt_engine.benchmark.raw_link import RAW_MESSAGE_BYTES

    args = _parser().parse_args(["--preset", "qwen3-30b-a3b"])
    plan = plan_memory(args, "nccl", 1024.0, ["raw", "bucketed", "naive", "ours"], None)
    assert plan.weights > 56 * 2**30 and plan.modes["raw"] == 2 * RAW_MESSAGE_BYTES
    assert plan.peak < 72 * 2**30  # an H100 80 GB card has ~79 GiB for tensors: room for the CUDA context and NCCL


def test_bench_colocated_copy_beside_ours_and_broadcast_modes_refused() -> None:
    bad = subprocess.run(
        [sys.executable, "-m", "ckpt_engine.cli", "bench", "--preset", "tiny", "--backend", "colocated", "--device", "cpu", "--modes", "raw,naive,ours"],
        capture_output=True, text=True, timeout=120,
    )
    assert bad.returncode == 2 and "--modes naive: the colocated backend has no broadcast" in bad.stderr, bad.stderr[-2000:]
    out = subprocess.run(
        [sys.executable, "-m", "ckpt_engine.cli", "bench", "--preset", "tiny", "--backend", "colocated", "--device", "cpu", "--iters", "1", "--json", "-"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads(out.stdout)
    assert set(summary["modes"]) == {"raw", "ours"} and summary["correct"] is True
    assert summary["raw_meaning"].startswith("one device-to-device copy of the same")
    assert summary["memory_plan"]["ranks_per_device"] == 2
