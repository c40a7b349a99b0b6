"""The installed-weight fold kernel on a GPU, alone and beside a copy of the model's bytes.

One `installed_kernel.Folder` over a model's tensors (a preset's shapes, bf16, every one whole), the
way either side of a check folds them: its device time per launch (CUDA events, median of `--iters`
launches), the host time of one launch read back at once (`fold`), then a flat device copy of the
same bytes alone, with the fold on a high-priority stream beside it, and with the fold behind it (as
a worker folds behind its last copies). Prints one JSON line.

    python bench/installed_fold_probe.py --preset qwen2.5-7b
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # a sibling script, run as `python bench/...`
from delta_apply_probe import _timed  # noqa: E402


def device_ms(fn: Callable[[], object], iters: int) -> float:
    """The median device time of `fn` over `iters` runs (after two warm ones), in ms."""
    return _timed(fn, iters) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen2.5-7b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--samples", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()

    from ckpt_engine.benchmark.presets import checkpoint_specs, load_preset_config
    from ckpt_engine.installed_kernel import Folder

    config = load_preset_config(args.preset)
    specs = checkpoint_specs(config, "bfloat16", args.layers)
    views = [torch.empty(tuple(s.shape), dtype=torch.bfloat16, device="cuda").normal_() for s in specs]
    nbytes = sum(v.numel() * v.element_size() for v in views)
    folder, seed = Folder(views), 12345
    out: dict[str, object] = {"preset": args.preset, "tensors": len(views), "gb": round(nbytes / 1e9, 2), "gpu": torch.cuda.get_device_name()}
    out["fold_ms"] = device_ms(lambda: folder.launch_all(seed, args.samples), args.iters)
    folder.fold(seed, args.samples)
    t = time.perf_counter()
    folder.fold(seed, args.samples)
    out["fold_read_back_host_ms"] = (time.perf_counter() - t) * 1e3
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    side = torch.cuda.Stream(priority=-1)

    def beside() -> None:
        dst.copy_(src)
        with torch.cuda.stream(side):
            folder.launch_all(seed, args.samples)
        torch.cuda.current_stream().wait_stream(side)

    def behind() -> None:
        dst.copy_(src)
        folder.launch_all(seed, args.samples)

    iters = max(3, args.iters // 4)
    out["copy_ms"] = device_ms(lambda: dst.copy_(src), iters)
    out["copy_and_fold_beside_ms"] = device_ms(beside, iters)
    out["copy_then_fold_ms"] = device_ms(behind, iters)
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}))


if __name__ == "__main__":
    main()
