"""Timing one GPU operation for the probes in bench/: CUDA events around each repetition, after one
warm-up call, the best of `reps` in seconds (the figure a memory-bound kernel is judged by)."""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["best_seconds"]


def best_seconds(fn: Callable[[], object], reps: int) -> float:
    """The fastest of `reps` timed calls of `fn` on the current CUDA device, in seconds."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best
