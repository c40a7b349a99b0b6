"""Staged syncs through vLLM's own weight-transfer API (the native backend) under continuous
generation: the engine's stall per sync, and tokens/s, staged against today's pause in one run.

The same measurement as `swap_vllm_bench.py` (whose stream, counters, trainer steps and summary it
uses), but the server runs `--weight-transfer-config '{"backend": "ckpt_engine"}'` and the handle
is `VllmNativeRollout`: every step is one of vLLM's own calls (`update_weights` phases `receive`
with `stage`, `swap`; `finish_weight_update`; the workers report a staged receive's end through the
rendezvous store). Per sync it alternates staged and today's order (paused for the whole sync) on the
same engine and the same delta chain; at the end it counts the tracebacks the server logged while
syncing (vLLM logs every call that raised, in the worker, the engine core and the API server).

    PYTHONPATH=. python bench/native_staged_vllm_bench.py --syncs 4 --dense-syncs 2
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ckpt_engine import CheckpointEngineConfig, WeightSyncSession
from ckpt_engine.delta.request import DeltaRequest
from ckpt_engine.manifest import BucketManifest
from ckpt_engine.rollout_adapters.base import ReceiveReport
from ckpt_engine.rollout_adapters.vllm_clients import HTTPWeightSyncClient
from ckpt_engine.rollout_adapters.vllm_native import VllmNativeRollout
from ckpt_engine.sources.base import StateDictSource
from ckpt_engine.trainer.vllm_job import VllmServerProcess, wait_healthy
from swap_vllm_bench import MODEL, Stream, generated_tokens, summarize, tokens_per_s

BACKEND = '{"backend": "ckpt_engine"}'


class SwitchedNative(VllmNativeRollout):
    """Staged or today's order, per sync (`staged`); records the engine's stall either way. The
    session runs `stage: off` (one delta chain for both orders): staged, this handle's pause and
    resume do nothing, its receive stages and its finalize swaps."""

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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--syncs", type=int, default=4, help="delta syncs per order (staged and off alternate)")
    p.add_argument("--dense-syncs", type=int, default=2, help="dense syncs per order")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--json", type=str, default=None, help="write the rows here too")
    args = p.parse_args()
    torch.set_num_threads(1)  # the box's cores belong to the engine

    work = Path(tempfile.mkdtemp(prefix="native-staged-bench-"))
    (work / "config.json").write_text(json.dumps(MODEL))
    server = VllmServerProcess(work, work / "server.log", ["--max-num-seqs", str(args.clients), "--weight-transfer-config", BACKEND])
    try:
        wait_healthy(server.url, time.monotonic() + 300, str(server.log))
        log = work / "server.log"
        start = log.stat().st_size  # vLLM's start-up warmup logs a traceback of its own (no tokenizer)
        rows = run(server.url, work, args)
        with open(log, "rb") as f:
            f.seek(start)
            text = f.read().decode("utf-8", "replace")
        print(f"server log while syncing: {text.count('Traceback')} tracebacks, {text.count('still streaming')} 'still streaming' errors", flush=True)
    finally:
        server.stop()
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


def run(url: str, model_dir: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    import transformers

    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(model_dir), dtype=torch.float32)
    master = {n: t.detach().clone() for n, t in hf.state_dict().items() if n != "lm_head.weight"}
    g = torch.Generator().manual_seed(1)

    def publish() -> dict[str, torch.Tensor]:
        return {n: t.bfloat16().float() for n, t in master.items()}

    def adam_step() -> None:
        for t in master.values():
            t.add_(torch.randn(t.shape, generator=g).sign() * args.lr)

    client = HTTPWeightSyncClient(url, timeout=120.0)
    adapter = SwitchedNative(client, name="vllm-native-bench", timeout_s=120.0)
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
                    adam_step()
                    weights = publish()
                    changed = sum(int((weights[k] != prev[k]).sum()) for k in weights) / sum(t.numel() for t in weights.values())
                    prev = weights
                    adapter.staged = i % 2 == 0
                    n0, t0 = generated_tokens(url), time.perf_counter()
                    report = session.sync(StateDictSource(weights))
                    seconds = time.perf_counter() - t0
                    during = (generated_tokens(url) - n0) / seconds
                    idle = tokens_per_s(url, max(seconds, 1.0))
                    fin = adapter.last_finalize if adapter.staged else {}
                    row = {
                        "kind": report.delta, "order": "staged" if adapter.staged else "off", "changed": changed,
                        "sync_s": seconds, "transfer_s": report.seconds.get("transfer", 0.0), "stall_s": adapter.stall_s,
                        "tok_s_during": during, "tok_s_without": idle, "wire_mb": report.wire_bytes / 1e6,
                        "load_s": fin.get("swap_load_s", 0.0), "post_process_s": 0.0,  # the swap phase holds both
                        "swap_pause_s": fin.get("swap_pause_s", 0.0), "swap_rpc_s": fin.get("swap_rpc_s", 0.0),
                    }
                    rows.append(row)
                    print(
                        f"{row['kind']:>5} {row['order']:>6}: changed {changed:6.2%}  sync {seconds * 1e3:7.1f} ms  "
                        f"transfer {row['transfer_s'] * 1e3:7.1f} ms  stall {row['stall_s'] * 1e3:7.1f} ms  "
                        f"(pause {row['swap_pause_s'] * 1e3:5.1f} + swap phase {row['load_s'] * 1e3:6.1f} + "
                        f"stamp/reset {(row['swap_rpc_s'] - row['load_s']) * 1e3:5.1f} ms)  "
                        f"tok/s during {during:6.1f} vs without {idle:6.1f} ({during / max(idle, 1e-9):.2f}x)  wire {row['wire_mb']:.2f} MB",
                        flush=True,
                    )
            finally:
                session.close()
    finally:
        stream.stop()
        client.close()
    summarize(rows, stream.errors)
    return rows


if __name__ == "__main__":
    main()
