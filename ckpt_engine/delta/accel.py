"""Whether the codec's Triton kernels may run, imported on first need.

Why: importing Triton costs about a second, and a CPU transport (gloo) must not pay it at import
time, nor load GPU kernels at all. The Triton kernels (kernels.py, direct_kernels.py,
scatter_kernels.py) are imported the first time a CUDA tensor is encoded or applied; code on that
path imports the kernel module inside the function that runs it, after asking here. Every other
device runs plain torch ops (a numba / numpy CPU family was retired: docs/delta.md).
"""

from __future__ import annotations

import functools
import logging

import torch

__all__ = ["triton_on"]

logger = logging.getLogger(__name__)


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
