"""Engine stall per sync, staged (issue 28) against today's pause, with the reference receiver.

One reference engine process steps continuously (`--step-interval-s`: each step reads every weight
under the step lock, `rollout_adapters/torch_ref/steps.py`); the trainer (this process) syncs a model of
`--preset` shapes over gloo, in the same run: `stage: off` (paused for the whole sync) and
`stage: auto` (staged: patches, or a full staging copy for dense syncs), for dense syncs and for
patch syncs where `--changed` of the elements change per version. Per mode it prints the median
transfer seconds, the median stall (the engine's time without steps because of the sync: pause to
resume, or the swap), stall / transfer, and the engine's steps per second during the syncs against
its rate with no sync running. `--receiver-tp N` runs N reference engines as the TP ranks of one
model instead, each holding only its slices (receive plans, issue 27): the staged syncs then land
per receiver set in each rank's staging area.

    python bench/staged_stall_bench.py --preset tiny --syncs 5 [--receiver-tp 2]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ckpt_engine import CheckpointEngineConfig, WeightSyncSession
from ckpt_engine.benchmark.presets import checkpoint_specs, load_preset_config
from ckpt_engine.rollout_adapters.torch_ref import TorchRefRollout, write_spec_file
from ckpt_engine.sources.base import StateDictSource


def versions(specs: list, count: int, changed: float, dtype: torch.dtype) -> list[dict[str, torch.Tensor]]:
    """`count` versions: random weights, then each changing `changed` of the elements of the last."""
    g = torch.Generator().manual_seed(0)
    sd = {s.name: (torch.randn(s.shape, generator=g) * 0.02).to(dtype) for s in specs}
    out = [sd]
    for _ in range(count - 1):
        nxt = {}
        for n, t in out[-1].items():
            flat = t.clone().reshape(-1)
            k = max(1, int(changed * flat.numel()))
            idx = torch.randint(0, flat.numel(), (k,), generator=g)
            flat[idx] = (flat[idx].float() + torch.randn(k, generator=g) * 1e-3).to(dtype)
            nxt[n] = flat.view(t.shape)
        out.append(nxt)
    return out


def steps_per_s(engine: TorchRefRollout, t0: float, t1: float) -> float:
    steps = [s for s in engine.steps(0) if t0 <= s[1] < t1]
    return len(steps) / (t1 - t0) if t1 > t0 else 0.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--syncs", type=int, default=5, help="patch syncs per mode (after a seed), and dense syncs per mode")
    p.add_argument("--changed", type=float, default=0.02)
    p.add_argument("--step-interval-s", type=float, default=0.002)
    p.add_argument("--bucket-mb", type=float, default=4.0)
    p.add_argument("--receiver-tp", type=int, default=1, help="reference engines as the TP ranks of one model (receive plans)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.receiver_tp < 1:
        raise ValueError(f"--receiver-tp must be >= 1, got {args.receiver_tp}")
    config = load_preset_config(args.preset)
    specs = checkpoint_specs(config, "bfloat16", num_layers=args.layers)
    kv = config.get("num_key_value_heads", config["num_attention_heads"])
    tp = args.receiver_tp
    vs = versions(specs, args.syncs + 1, args.changed, torch.bfloat16)
    nbytes = sum(t.numel() * t.element_size() for t in vs[0].values())
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        spec_file = str(Path(tmp) / "spec.msgpack")
        write_spec_file(spec_file, StateDictSource(vs[0]).metadata())
        engines = [
            TorchRefRollout.spawn(
                f"bench{r}", spec_file=spec_file, timeout_s=120, step_interval_s=args.step_interval_s,
                layout={"tp_size": tp, "tp_rank": r, "num_kv_heads": kv} if tp > 1 else None,
            )
            for r in range(tp)
        ]
        engine = engines[0]  # its steps are the ones counted
        try:
            time.sleep(1.0)
            t = time.monotonic()
            time.sleep(2.0)
            idle = steps_per_s(engine, t, time.monotonic())
            ranks = f", {tp} engines as TP ranks (receive plans)" if tp > 1 else ""
            print(f"{args.preset}: {len(specs)} tensors, {nbytes / 1e6:.1f} MB bf16{ranks}; engine steps {idle:.0f}/s with no sync")
            for delta in ("off", "on"):
                for stage in ("off", "auto"):
                    cfg = CheckpointEngineConfig(backend="gloo", bucket_size_mb=args.bucket_mb, timeout_s=120, delta=delta, stage=stage)
                    session = WeightSyncSession(engines, cfg)
                    transfer, stall, staged, windows = [], [], [], []
                    try:
                        for i, sd in enumerate(vs if delta == "on" else vs[: args.syncs]):
                            t0 = time.monotonic()
                            report = session.sync(StateDictSource(sd))
                            t1 = time.monotonic()
                            if delta == "on" and i == 0:
                                continue  # the seed: not a patch sync
                            transfer.append(report.seconds["transfer"])
                            stall.append(report.stall_s)
                            staged.append(report.staged)
                            windows.append((t0, t1))
                    finally:
                        session.close()
                    during = statistics.median(steps_per_s(engine, a, b) for a, b in windows)
                    row = {
                        "sync": "patch" if delta == "on" else "dense", "stage": stage, "staged": sorted(set(staged)),
                        "transfer_s": statistics.median(transfer), "stall_s": statistics.median(stall),
                        "stall_over_transfer": statistics.median(stall) / statistics.median(transfer),
                        "steps_per_s_during": during, "steps_per_s_idle": idle, "syncs": len(transfer), "receiver_tp": tp,
                    }
                    rows.append(row)
                    print(
                        f"{row['sync']:5} stage={stage:4} ({'/'.join(row['staged'])}): transfer {row['transfer_s'] * 1e3:8.1f} ms  "
                        f"stall {row['stall_s'] * 1e3:8.1f} ms  stall/transfer {row['stall_over_transfer']:.2f}  "
                        f"steps/s during syncs {during:.0f} ({during / idle if idle else 0:.2f} x idle)"
                    )
        finally:
            for e in engines:
                e.close()
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
