"""Staged syncs through vLLM's own weight-transfer API (the native backend) under continuous
generation: the engine's stall per sync, and tokens/s, staged against today's pause in one run.

The same measurement as `swap_vllm_bench.py` (whose switched handle, request stream, timing loop
and summary it uses), but the server runs `--weight-transfer-config '{"backend": "ckpt_engine"}'` and the handle
is `VllmRollout` over a `WeightTransferChannel`: every step is one of vLLM's own calls (`update_weights` phases `receive`
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

from ckpt_engine.rollout_adapters.vllm.clients import HTTPWeightSyncClient
from ckpt_engine.rollout_adapters.vllm import VllmRollout, WeightTransferChannel
from ckpt_engine.trainer.vllm_job import VllmServerProcess, wait_healthy
from swap_vllm_bench import MODEL, alternate_orders, bf16_trainer, switched

BACKEND = '{"backend": "ckpt_engine"}'


SwitchedNative = switched(VllmRollout)
"""Staged or today's order, per sync (`staged`), as `swap_vllm_bench.py`'s handle."""


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
    publish, adam_step = bf16_trainer(model_dir, args.lr)
    client = HTTPWeightSyncClient(url, timeout=120.0)
    adapter = SwitchedNative("vllm-native-bench", WeightTransferChannel(client), timeout_s=120.0)

    def row_of(row: dict[str, Any]) -> dict[str, Any]:
        fin = adapter.last_finalize if adapter.staged else {}
        row.update({
            "load_s": fin.get("swap_load_s", 0.0), "post_process_s": 0.0,  # the swap phase holds both
            "swap_pause_s": fin.get("swap_pause_s", 0.0), "swap_rpc_s": fin.get("swap_rpc_s", 0.0),
        })
        print(
            f"{row['kind']:>5} {row['order']:>6}: changed {row['changed']:6.2%}  sync {row['sync_s'] * 1e3:7.1f} ms  "
            f"transfer {row['transfer_s'] * 1e3:7.1f} ms  stall {row['stall_s'] * 1e3:7.1f} ms  "
            f"(pause {row['swap_pause_s'] * 1e3:5.1f} + swap phase {row['load_s'] * 1e3:6.1f} + "
            f"stamp/reset {(row['swap_rpc_s'] - row['load_s']) * 1e3:5.1f} ms)  "
            f"tok/s during {row['tok_s_during']:6.1f} vs without {row['tok_s_without']:6.1f} "
            f"({row['tok_s_during'] / max(row['tok_s_without'], 1e-9):.2f}x)  wire {row['wire_mb']:.2f} MB",
            flush=True,
        )
        return row

    try:
        return alternate_orders(url, adapter, args, publish, adam_step, row_of)
    finally:
        client.close()

if __name__ == "__main__":
    main()
