"""Which compiled kernels the codec may use, each imported on first need.

Why: importing Triton and numba costs about a second, and a CPU transport (gloo) must not pay it at
import time, nor load GPU kernels at all. The Triton kernels (kernels.py, direct_kernels.py,
scatter_kernels.py) are imported the first time a CUDA tensor is encoded or applied; the numba
loops (host_kernels.py) the first time a CPU patch is. Code on those paths imports the kernel
module inside the function that runs it, after asking here.

`CKPT_ENGINE_NUMBA=0` (read once, at the first CPU patch) keeps the CPU path on numpy alone, so a
benchmark can measure what the compiled loops buy (`ckpt-engine bench --delta`).
"""

from __future__ import annotations

import functools
import logging
import os

import torch

__all__ = ["NUMBA_SWITCH", "numba_on", "triton_on"]

logger = logging.getLogger(__name__)

NUMBA_SWITCH = "CKPT_ENGINE_NUMBA"


@functools.cache
def _triton_imports() -> bool:
    try:
        from ckpt_engine.delta import kernels  # noqa: F401  (imports triton)
    except Exception as exc:  # noqa: BLE001 - any import failure means the torch path
        logger.debug("triton unavailable (%s); the delta codec uses torch ops on CUDA", exc)
        return False
    return True


def triton_on(device: torch.device) -> bool:
    """Whether the fused Triton kernels run on `device` (CUDA with Triton importable). Imports
    nothing for any other device."""
    return device.type == "cuda" and _triton_imports()


@functools.cache
def numba_on() -> bool:
    """Whether the compiled CPU loops (host_kernels.py, numba) run: numba importable and not
    switched off by CKPT_ENGINE_NUMBA=0; else the CPU path is numpy."""
    if os.environ.get(NUMBA_SWITCH, "1") == "0":
        logger.info("%s=0: the CPU delta path uses numpy only", NUMBA_SWITCH)
        return False
    try:
        from ckpt_engine.delta import host_kernels  # noqa: F401  (imports numba)
    except Exception as exc:  # noqa: BLE001 - any import failure means the numpy path
        logger.debug("numba unavailable (%s); the CPU delta path uses numpy", exc)
        return False
    return True
