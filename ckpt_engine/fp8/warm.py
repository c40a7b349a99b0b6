"""Compiling the quantize kernel before a sync needs it (issue 41 item 5: no sync pays a compile).

Why: on CUDA `quantize_block_fp8` runs through torch.compile, whose first call compiles (seconds);
inside the first FP8 sync that would land in the transfer window, where every receiver waits within
`timeout_s`. A sender warms it when its FP8 wire is set up, before the plan is validated and
before anything pauses; shapes then reuse the dynamic-shape kernel. On a CPU the kernel is eager
torch ops: nothing to compile.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from ckpt_engine.fp8.quantize import quantize_block_fp8

__all__ = ["warm_up", "warmed"]

logger = logging.getLogger(__name__)

_WARMED: set[str] = set()
_LOCK = threading.Lock()
_SHAPES = ((256, 384), (200, 300), (2, 256, 128), (2, 130, 260))
"""Whole and partial blocks, plain and stacked experts: every branch (guard) of the kernel."""


def warmed() -> frozenset[str]:
    """The devices (`str(device)`) whose quantize kernel this process has compiled."""
    with _LOCK:
        return frozenset(_WARMED)


def warm_up(device: torch.device | None) -> None:
    """Quantize a few tiny weights on `device` once per process and device (CUDA only; later
    calls, and other devices, return at once)."""
    if device is None or device.type != "cuda":
        return
    key = str(device)
    with _LOCK:
        if key in _WARMED:
            return
        t0 = time.perf_counter()
        for shape in _SHAPES:
            for dtype in (torch.bfloat16, torch.float32):
                quantize_block_fp8(torch.ones(shape, dtype=dtype, device=device))
        torch.cuda.synchronize(device)
        _WARMED.add(key)
        logger.info("block-FP8 quantize kernel on %s compiled in %.3fs (before any sync)", key, time.perf_counter() - t0)
