"""What an installed-weight check costs (issue 42 item 5): dense syncs of a preset's checkpoint into
one reference receiver in its own process, with `verify_installed` off and on every sync, and the
digests alone on both sides (the trainer's fold of the source, the engine's of what it installed).

    python bench/installed_check_bench.py --preset qwen2.5-7b --layers 1 --syncs 4 [--samples 4096]

Prints one JSON line: the median dense sync without and with the check, the check's share of the
sync, and each side's digest time (sampled and, for reference, a full fold: --samples 0's).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ckpt_engine import CheckpointEngineConfig, WeightSyncSession
from ckpt_engine.benchmark.presets import checkpoint_specs, load_preset_config
from ckpt_engine.installed import InstalledRequest, digest
from ckpt_engine.rollout_adapters.torch_ref import TorchRefRollout, write_spec_file
from ckpt_engine.sources.base import StateDictSource


def fold_s(sd: dict[str, torch.Tensor], samples: int) -> float:
    t = time.perf_counter()
    for v in [digest(x, 12345, samples) for x in sd.values()]:
        int(v)
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="qwen2.5-7b")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--syncs", type=int, default=4)
    p.add_argument("--samples", type=int, default=4096)
    p.add_argument("--bucket-mb", type=float, default=256)
    args = p.parse_args()
    specs = checkpoint_specs(load_preset_config(args.preset), num_layers=args.layers)
    g = torch.Generator().manual_seed(0)
    sd = {s.name: torch.randn(s.shape, generator=g, dtype=torch.float32).to(getattr(torch, s.dtype)) for s in specs}
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    out: dict[str, object] = {"preset": args.preset, "layers": args.layers, "tensors": len(sd), "gb": round(nbytes / 1e9, 3), "samples": args.samples}
    with tempfile.TemporaryDirectory() as tmp:
        spec_file = Path(tmp) / "spec.msgpack"
        write_spec_file(spec_file, specs)
        engine = TorchRefRollout.spawn("ref", spec_file=str(spec_file), dtype="bfloat16", timeout_s=600)
        try:
            for mode in ("off", 1):
                cfg = CheckpointEngineConfig(backend="gloo", bucket_size_mb=args.bucket_mb, stage="off", timeout_s=600,
                                             verify_installed=mode, verify_installed_samples=args.samples)
                session = WeightSyncSession([engine], cfg)
                times, checks = [], []
                try:
                    for i in range(args.syncs + 1):  # the first joins the group: not counted
                        sd[specs[0].name][0, 0] += 1
                        seconds = session.sync(StateDictSource(sd)).seconds
                        times.append(seconds["total"])
                        checks.append(seconds.get("installed_check", 0.0))
                finally:
                    session.close()
                out[f"sync_s_{'off' if mode == 'off' else 'checked'}"] = round(statistics.median(times[1:]), 4)
                out[f"syncs_{'off' if mode == 'off' else 'checked'}"] = [round(x, 4) for x in times[1:]]
                if mode != "off":
                    out["check_s"] = round(statistics.median(checks[1:]), 4)
            req = InstalledRequest([s.name for s in specs], 12345, args.samples)
            t = time.perf_counter()
            engine.installed_digests(req)
            out["engine_digests_s"] = round(time.perf_counter() - t, 4)
            out["trainer_fold_s"] = round(fold_s(sd, args.samples), 4)
            out["trainer_full_fold_s"] = round(fold_s(sd, 0), 3)
        finally:
            engine.close()
    off, on = out["sync_s_off"], out["sync_s_checked"]
    out["check_share"] = round(out["check_s"] / off, 4)  # type: ignore[operator]  # the check's own time over a dense sync
    out["difference_share"] = round((on - off) / off, 4)  # type: ignore[operator]  # noisy: two sets of syncs
    out["digests_share"] = round((out["engine_digests_s"] + out["trainer_fold_s"]) / off, 4)  # type: ignore[operator]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
