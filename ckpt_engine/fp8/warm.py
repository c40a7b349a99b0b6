"""Compiling the FP8 quantize kernels when a sender joins a group, not inside a sync.

Why: on CUDA the first quantize of a process compiles the Triton kernels (`quantize_kernel.py`,
one variant per input dtype, the one-weight kernel and the grouped one, into its own buffer and
into a send buffer), inside the first FP8 sync's transfer window where every engine waits within
`timeout_s`. `warm_up` quantizes one 128 x 128 zero block of each dtype through each, once per
process, device and dtype, at the join (`SyncGroup.build`, when `checkpoint_engine.wire_dtype` is
fp8), so the first sync is as fast as the fifth. Elsewhere (CPU) it runs the eager recipe once: nothing compiles there.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from ckpt_engine.fp8.layout import BLOCK
from ckpt_engine.fp8.quantize import KERNEL_DTYPES, quantize_block_fp8

__all__ = ["warm_up", "warmed"]

logger = logging.getLogger(__name__)

_WARMED: set[tuple[str, torch.dtype]] = set()
_LOCK = threading.Lock()


def warmed() -> frozenset[tuple[str, torch.dtype]]:
    """(device, dtype) pairs whose quantize kernels this process has loaded."""
    with _LOCK:
        return frozenset(_WARMED)


def warm_up(device: torch.device) -> list[torch.dtype]:
    """Quantize a zero block of each dtype the kernels take (`KERNEL_DTYPES`) on `device` through
    every kernel a sync may use; returns the dtypes loaded now (those loaded before are skipped)."""
    done: list[torch.dtype] = []
    with _LOCK:
        t0 = time.perf_counter()
        for dtype in KERNEL_DTYPES:
            key = (str(device), dtype)
            if key in _WARMED:
                continue
            w = torch.zeros(BLOCK, dtype=dtype, device=device)
            quantize_block_fp8(w)  # the one-weight kernel (sources whose tensors do not stay valid)
            if w.is_cuda:
                from ckpt_engine.fp8.quantize_kernel import groupable, plan_into, quantize_block_fp8_group  # needs Triton

                if groupable(w):
                    quantize_block_fp8_group([w])  # consecutive weights in one launch (stable sources)
                    slot = torch.empty(w.numel() + 256, dtype=torch.uint8, device=device)
                    plan_into([w], [0], [w.numel()]).run(slot)  # the same kernel into a send buffer (a replayed walk's fills)
                torch.cuda.synchronize(device)  # the compile and first launch finish here, not in a sync
            _WARMED.add(key)
            done.append(dtype)
        if done:
            logger.info("FP8 quantize kernels on %s for %s loaded in %.3fs (before any sync)", device, ", ".join(map(str, done)), time.perf_counter() - t0)
    return done
