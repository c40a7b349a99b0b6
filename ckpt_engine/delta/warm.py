"""Loading the codec's kernels when a process joins a weight-sync group, not inside a sync.

Why: the first patch of a fresh process compiles the kernels that diff, decode, check and apply
it (Triton on CUDA), inside the transfer window where every other rank waits within `timeout_s`.
`warm_up` runs one tiny patch of each word size through the codec on the group's device at the
join, so whichever kernels the codec dispatches to are loaded before any sync waits on them.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from ckpt_engine.delta import codec

__all__ = ["warm_up", "warmed"]

logger = logging.getLogger(__name__)

_WARMED: set[str] = set()
_LOCK = threading.Lock()
_WORDS = 64  # per patch: enough for every kernel's loop, a few hundred bytes


def warmed() -> frozenset[str]:
    """The devices (`str(device)`) whose delta kernels this process has loaded."""
    with _LOCK:
        return frozenset(_WARMED)


def warm_up(device: torch.device) -> None:
    """Diff, decode, check and apply one tiny patch per word size on `device` (once per process and
    device; later calls return at once). Called by every rank when it joins a group that may carry
    patches (`PipelinedEngine.init_process_group`)."""
    key = str(device)
    with _LOCK:
        if key in _WARMED:
            return
        t0 = time.perf_counter()
        for word_bytes in (1, 2, 4, 8):
            nbytes = _WORDS * word_bytes
            base = torch.zeros(nbytes, dtype=torch.uint8, device=device)
            new = base.clone()
            new[::3] = 1  # every third byte: a patch, not a dense fallback
            out = torch.empty(codec.max_patch_bytes(nbytes, word_bytes), dtype=torch.uint8, device=device)
            size = codec.encode(base, new, word_bytes, out)
            if size is None:
                continue
            patch = codec.decode(out[:size], nbytes, word_bytes)
            expected = codec.checksum(base, word_bytes) + codec.delta_checksum(base, patch)
            codec.apply(base, patch)
            if not torch.equal(base, new) or not torch.equal(expected, codec.checksum(base, word_bytes)):
                raise RuntimeError(f"the delta codec's warm-up patch on {key} ({word_bytes}-byte words) did not round-trip")
        _WARMED.add(key)
        logger.info("delta kernels on %s loaded in %.3fs (before any sync)", key, time.perf_counter() - t0)
