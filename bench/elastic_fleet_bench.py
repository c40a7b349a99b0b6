"""Elastic fleet on the CPU box (issue 43's must-hold): a 3-engine fleet of reference receivers keeps
serving through N restarts, each restarted engine rejoining from a serving peer with one-sided NIXL
reads (`ckpt_engine.elastic.join_from_peer`), and no request is ever served from a half-new engine.

Every engine runs "engine steps" (`torch_ref/steps.py`): each step reads every weight and records the
version the engine claimed and a digest of what it read. A trainer session syncs a new version
into the fleet between restarts. Per restart: one engine is SIGKILLed (its step records fetched
first), started again (holding zeros, no version), and joins from the others; the others keep
stepping meanwhile. At the end every step record of every engine is checked: a step that claimed
version v must have read exactly version v's weights (the trainer's digest of them); a step that
claimed none served nothing. Prints restarts, steps, half-new steps (must be 0), and the joiner's
time to serve (process ready -> holding the version, offers and checks included).

    .venv/bin/python bench/elastic_fleet_bench.py --restarts 10 --mb 32
"""

from __future__ import annotations

import argparse
import json
import platform
import signal
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ckpt_engine import CheckpointEngineConfig, WeightSyncSession
from ckpt_engine.elastic import join_from_peer
from ckpt_engine.rollout_adapters.torch_ref.steps import weights_digest
from ckpt_engine.rollout_adapters.torch_ref import TorchRefRollout, write_spec_file
from ckpt_engine.sources.base import StateDictSource


def weights(seed: int, mb: float, num: int = 16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    cols = max(1, int(mb * 1e6 / 4 / num / 256))
    return {f"layer{i}.weight": torch.randn(256, cols, generator=g) for i in range(num)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--restarts", type=int, default=10)
    p.add_argument("--mb", type=float, default=32.0, help="model size in MB (float32)")
    p.add_argument("--step-interval-s", type=float, default=0.02)
    p.add_argument("--json", help="write the figures here too")
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="elastic-bench-"))
    spec = tmp / "spec.msgpack"
    write_spec_file(spec, StateDictSource(weights(0, args.mb)).metadata())
    cfg = CheckpointEngineConfig(backend="gloo", timeout_s=60)
    digests: dict[int, str] = {}

    def spawn(name: str) -> TorchRefRollout:
        return TorchRefRollout.spawn(name, spec_file=str(spec), timeout_s=120, step_interval_s=args.step_interval_s)

    def sync(engines: list[TorchRefRollout], seed: int) -> int:
        sd = weights(seed, args.mb)
        session = WeightSyncSession(engines, cfg)
        try:
            version = session.sync(StateDictSource(sd)).version
        finally:
            session.close()
        digests[version] = weights_digest(sd)
        return version

    records: list[tuple[str, int | None, str]] = []
    seen: dict[str, int] = {}

    def collect(e: TorchRefRollout) -> None:
        rs = e.steps(seen.get(e.name, 0))
        records.extend((e.name, r[3], r[4]) for r in rs)  # type: ignore[misc]
        if rs:
            seen[e.name] = int(rs[-1][0]) + 1  # type: ignore[call-overload]

    fleet = [spawn(f"e{i}") for i in range(3)]
    joins: list[dict[str, float]] = []
    try:
        sync(fleet, 1)
        for i in range(args.restarts):
            k = i % 3
            victim = fleet[k]
            collect(victim)
            victim.process.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
            victim.process.wait(30)  # type: ignore[union-attr]
            victim.close()
            seen.pop(victim.name, None)
            others = [e for e in fleet if e is not victim]
            before = {e.name: e.health()["steps"] for e in others}
            t0 = time.perf_counter()
            fresh = spawn(victim.name)
            started = time.perf_counter() - t0
            report = join_from_peer(fresh, others, timeout_s=60)
            stepped = min(e.health()["steps"] - before[e.name] for e in others)
            joins.append({"start_s": started, "to_serve_s": report.wall_s, "pull_s": report.seconds, "gbps": report.gbps, "others_min_steps": stepped, **report.phases})
            print(f"restart {i + 1}: {victim.name} up in {started:.2f} s, serving v{report.version} from {report.peer} {report.wall_s:.3f} s after "
                  f"(pull {report.seconds:.3f} s: {', '.join(f'{k} {v:.3f}' for k, v in report.phases.items())}; {report.gbps:.3f} GB/s); the others stepped >= {stepped} times meanwhile", flush=True)
            fleet[k] = fresh
            sync(fleet, 100 + i)
        for e in fleet:
            collect(e)
    finally:
        for e in fleet:
            e.close()
    served = [r for r in records if r[1] is not None]
    half_new = [r for r in served if digests.get(r[1]) != r[2]]
    to_serve = [j["to_serve_s"] for j in joins]
    out = {
        "machine": f"{platform.node()} {platform.machine()}, {torch.get_num_threads()} torch threads",
        "mb": args.mb, "restarts": len(joins), "steps_served": len(served), "steps_without_version": len(records) - len(served),
        "half_new_steps": len(half_new), "versions": len(digests),
        "to_serve_s_median": statistics.median(to_serve) if to_serve else None, "to_serve_s_max": max(to_serve, default=None),
        "pull_gbps_median": statistics.median(j["gbps"] for j in joins) if joins else None,
        "others_min_steps_during_join": min((j["others_min_steps"] for j in joins), default=None),
    }
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps({**out, "joins": joins}, indent=1))
    if half_new:
        raise SystemExit(f"{len(half_new)} step(s) served from a half-new engine: {half_new[:5]}")


if __name__ == "__main__":
    main()
