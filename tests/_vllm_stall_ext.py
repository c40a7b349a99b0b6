"""Test-only vLLM worker extension for an engine core that runs in the test's own process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`, uni-process executor: the worker is in this process too):
tests/_vllm_installed_faults.py's extension plus a worker method that stalls, as a stuck worker
would, until the test releases it (or `hold_s` passes: every wait here ends): by `RELEASE` where
the worker runs in the test's process, by creating `release_file` where it runs in another.

`test_stall("synchronize_device", hold_s)`: the next call of that worker method waits; vLLM's
engine core calls it inside `pause_scheduler` (a pause promises an idle device), so a pause then
hangs inside the engine core, in whatever thread asked for it. `test_lora_ids`: which LoRA ids
vLLM holds in its slots and in its CPU cache (tests/test_lora_vllm_eviction.py).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from _vllm_installed_faults import InstalledFaultsExtension

EXTENSION = "_vllm_stall_ext.StallExtension"

RELEASE = threading.Event()
"""Set by the test to end a stall (the worker runs in the test's process)."""
STALLED = threading.Event()
"""Set by the stalled method when it starts waiting."""


class StallExtension(InstalledFaultsExtension):
    def test_stall(self, method: str, hold_s: float, release_file: str | None = None) -> None:
        original = getattr(type(self), method)
        RELEASE.clear()
        STALLED.clear()

        def stalled(*args: Any, **kwargs: Any) -> Any:
            vars(self).pop(method, None)  # one call only
            STALLED.set()
            if release_file is None:
                RELEASE.wait(hold_s)
            else:
                deadline = time.monotonic() + hold_s
                while not Path(release_file).exists() and time.monotonic() < deadline:
                    time.sleep(0.01)
            return original(self, *args, **kwargs)

        setattr(self, method, stalled)

    def test_lora_ids(self) -> dict[str, list[int | None]]:
        """The LoRA ids in vLLM's slots (`max_loras`) and in its CPU cache (`max_cpu_loras`)."""
        adapters = self._ckpt_lora.adapters
        return {"slots": list(adapters.lora_index_to_id), "cpu": sorted(adapters.list_adapters())}
