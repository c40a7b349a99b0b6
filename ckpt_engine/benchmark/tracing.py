"""One sync traced with torch.profiler, written as a Chrome trace per rank (`--profile DIR`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

__all__ = ["traced"]

T = TypeVar("T")


def traced(fn: Callable[[], T], device: torch.device, out_dir: str, rank: int) -> T:
    """Run `fn` under the profiler (host, and CUDA kernels on a GPU) and write DIR/rank<r>.json:
    where the link idles, which kernels the sync launches and what the host waits on."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        result = fn()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(out / f"rank{rank}.json"))
    return result
