"""How a bench rank ended, in one line: the driver names the rank and its signal or exit code.

When one rank dies (the OOM killer's SIGKILL, a crash) its peers fail next on closed sockets;
the line names the cause, not the echoes: a rank killed by a signal before one that exited.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["RankDied", "check_ranks", "collect_results", "describe_exit"]


class RankDied(RuntimeError):
    """A bench rank exited with a non-zero code or was killed; the message is one line."""


def describe_exit(rank: int, code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = " (out of memory?)" if -code == signal.SIGKILL else ""
        return f"rank {rank} was killed by {name}{hint}"
    return f"rank {rank} exited with code {code}"


def check_ranks(procs: Sequence[subprocess.Popen]) -> None:
    """Raise RankDied naming the failed rank most likely to be the cause; nothing if none failed."""
    failed = [(r, p.returncode) for r, p in enumerate(procs) if p.poll() not in (None, 0)]
    if failed:
        rank, code = min(failed, key=lambda rc: (rc[1] >= 0, rc[0]))
        raise RankDied(describe_exit(rank, code))


def collect_results(
    procs: Sequence[subprocess.Popen], store: Any, deadline: float, what: str, on_tick: Callable[[], None] | None = None,
) -> list[dict[str, Any]]:
    """Wait for every rank process, failing at once on one that died (`check_ranks`) or at
    `deadline` (monotonic), then read each rank's JSON `result/<rank>` from `store`; a rank
    still running on the way out is killed."""
    try:
        while any(p.poll() is None for p in procs):
            check_ranks(procs)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} did not finish in time")
            if on_tick is not None:
                on_tick()
            time.sleep(0.2)
        check_ranks(procs)
        return [json.loads(store.get(f"result/{r}")) for r in range(len(procs))]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
