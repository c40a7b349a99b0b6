"""What a vLLM handle's health asks of its engine beyond "does it answer" (`VllmRollout.health`).

A worker process the handle joined that is gone means a dead engine only while nobody else answers
for it: a server restarted at its address has new workers, to be rejoined and seeded by the next
sync, not dropped. A handle that never joined asks the workers once what they hold, so a daemon or
trainer restarted beside a serving engine carries on from its version. A world size the caller gave
is checked against the engine's own before the first join: the group's rendezvous would otherwise
wait for ranks that never come.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from ckpt_engine.rollout_adapters.base import Membership

__all__ = ["ask_held", "gone_worker", "world_size_problem"]

logger = logging.getLogger(__name__)


def gone_worker(name: str, pids: list[int]) -> str | None:
    """Why one of `pids` (the workers engine `name`'s handle joined, on this host) is no longer
    running, or None while all are."""
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return f"engine {name!r}: worker process {pid} is gone"
        except PermissionError:  # not ours to signal: alive
            pass
        if _is_zombie(pid):
            return f"engine {name!r}: worker process {pid} exited"
    return None


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return False


def ask_held(name: str, gone: str | None, membership: Callable[[], Membership]) -> Membership | None:
    """What engine `name`'s workers hold (`membership`). `gone` (a worker its handle joined is gone)
    is raised unless others answer: then the engine restarted at its address. Without `gone`, a
    failed ask is None (the handle asks at its next health probe: its workers may be busy)."""
    try:
        held = membership()
    except Exception as exc:
        if gone is not None:
            raise RuntimeError(gone) from exc
        logger.info("engine %s: could not ask its workers what they hold (%s); asked at the next health probe", name, exc)
        return None
    if gone is not None:
        logger.warning("%s, and the engine answers with other workers: restarted at its address (the next sync rejoins and seeds it)", gone)
    return held


def world_size_problem(name: str, told: int, actual: int) -> str | None:
    """What is wrong with `world_size=told` for engine `name`, which runs `actual` workers (None: nothing)."""
    if told == actual:
        return None
    return (
        f"engine {name!r}: world_size={told} was given, but the engine runs {actual} worker(s) (tensor x pipeline "
        f"parallel); pass world_size={actual}, or leave it out and the handle asks the engine"
    )
