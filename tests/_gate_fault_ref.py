"""A reference receiver that signals itself mid-stream, run as its own process by
`refengines.spawn_engine(fault_file=...)`: `main(torch_ref_args)` with `$CKPT_TEST_FAULT_FILE` set.

When a bucket load reaches the load gate (load_gate.py) while that file exists, the engine takes
the file, notes the moment in `<file>.fired` (CLOCK_MONOTONIC, the same clock as the test's
`time.monotonic()`) and sends itself the signal the file names (`SIGKILL`, `SIGSTOP`): the fault
lands mid-stream at once, on any box. A test that polled for a hold and then sent the signal left
a window in which the sync's own timers ran (a starved test outlasted 3 s, then 10 s, at load
9-13), so every wait of a fault test had to outlast the slowest poll.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from ckpt_engine.rollout_adapters.torch_ref import serve
from ckpt_engine.rollout_adapters.torch_ref.load_gate import LoadGate

FAULT_ENV = "CKPT_TEST_FAULT_FILE"


def fired_path(fault_file: str | Path) -> Path:
    """Where the engine notes when it signalled itself."""
    return Path(f"{fault_file}.fired")


def _fire(fault_file: str) -> None:
    try:
        name = Path(fault_file).read_text().strip()
    except FileNotFoundError:
        return
    os.unlink(fault_file)  # once: a stopped engine that is woken goes on loading
    sig = signal.Signals[name]
    fired = fired_path(fault_file)
    tmp = fired.with_name(fired.name + ".tmp")
    tmp.write_text(repr(time.monotonic()))
    os.replace(tmp, fired)  # the test never reads a half-written moment
    os.kill(os.getpid(), sig)


def main(argv: list[str]) -> None:
    fault_file = os.environ[FAULT_ENV]
    through = LoadGate.pass_through

    def pass_through(self: LoadGate) -> None:
        _fire(fault_file)
        through(self)

    LoadGate.pass_through = pass_through  # type: ignore[method-assign]
    serve.main(argv)
