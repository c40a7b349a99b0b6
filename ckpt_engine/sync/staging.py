"""Which syncs are staged (issue 28, `checkpoint_engine.stage`), and dropping what a failed one staged.

A staged sync streams into every engine's staging area while the engines serve and pauses them
only for the swap. `StagePolicy.choose` decides per sync, after validate and before anything pauses
or moves: a patch sync stages its patches; a dense sync (or a delta seed) stages a full copy when
`stage` is `full`, or `auto` and every engine reports room for it (a rank with a receive plan needs
room for its slices only); otherwise the sync pauses as today, and the session says why once. A
sync with receive plans stages only when every engine says it can (`capabilities.stages_regions`).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from ckpt_engine.rollout_adapters.capabilities import lacking
from ckpt_engine.delta.request import DeltaRequest
from ckpt_engine.rollout_adapters.base import RolloutAdapter
from ckpt_engine.sync.fanout import collect_failures

__all__ = ["StagePolicy", "discard_all", "failure_deadline", "run_order"]

logger = logging.getLogger(__name__)

Step = Callable[[str, dict[str, float], Callable[[RolloutAdapter], Any]], dict[str, Any]]
"""The session's timed engine-wide step (stage name, the sync's seconds, what each engine does)."""

FanOut = Callable[[Callable[[RolloutAdapter], bool]], dict[str, bool]]
"""Asks every engine at once (the session's fan-out: a failure breaks the sync, nothing paused)."""


class StagePolicy:
    """`checkpoint_engine.stage` for one session; says once per session why a sync is not staged."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self._said: set[str] = set()

    def _say_once(self, message: str) -> None:
        if message not in self._said:
            self._said.add(message)
            logger.warning("%s", message)

    def choose(
        self, rollouts: Sequence[RolloutAdapter], request: DeltaRequest | None, rank_bytes: Mapping[str, list[int]], fan_out: FanOut,
        *, regions: bool = False,
    ) -> str | None:
        """`patches`, `full`, or None (pause for the whole sync). `rank_bytes`: per engine, what
        each of its ranks takes in a dense sync (the staging copy it needs). `stage: full` with an
        engine short of room raises ValueError (nothing was paused or sent)."""
        if self.mode == "off":
            return None
        cannot = lacking(rollouts, "stages")
        if cannot:
            # An adapter engine pauses nothing (a version installs beside the one requests use): only others are told.
            pausing = [r.name for r in rollouts if r.name in cannot and r.capabilities.weights != "adapters"]
            if pausing:
                self._say_once(f"checkpoint_engine.stage={self.mode}: engine(s) {', '.join(pausing)} cannot stage a sync; syncs pause for the whole transfer")
            return None
        if regions:  # a sync with receive plans: each engine says whether it stages one
            cannot = lacking(rollouts, "stages_regions")
            if cannot:
                self._say_once(
                    f"checkpoint_engine.stage={self.mode}: engine(s) {', '.join(cannot)} cannot stage a sync with receive plans; "
                    "such syncs pause for the whole transfer"
                )
                return None
        if request is not None and request.patches:
            return "patches"
        if self.mode == "patches":
            return None  # dense syncs pause as today
        need = {n: max(b, default=0) for n, b in rank_bytes.items()}
        room = fan_out(lambda r: bool(r.staging_room(need.get(r.name, 0))))
        short = sorted(n for n, ok in room.items() if not ok)
        if not short:
            return "full"
        what = f"engine(s) {', '.join(short)} report no room for a dense staging copy ({max(need.get(n, 0) for n in short) / 1e9:.3f} GB)"
        if self.mode == "full":
            raise ValueError(f"checkpoint_engine.stage=full: {what}; nothing was paused or sent. Use stage: auto (dense syncs then pause) or free memory")
        self._say_once(f"checkpoint_engine.stage=auto: {what}; dense syncs pause for the whole transfer, patch syncs stay staged")
        return None


DISCARD_FLOOR_S = 0.5
"""The least a discard is waited for, even past the failure's budget: a live engine answers in
milliseconds, and one not waited for at all would be left stale for nothing."""


def failure_deadline(timeout_s: float, sent: float) -> float:
    """When every wait of a failed stream must be over, from `sent` (the monotonic time the sender's
    own wait ended). The documented bound (docs/guarantees.md, "Bounded failure") is 3 x timeout_s
    + 2 s from the fault: the sender's wait (at most timeout_s, before `sent`), then the receivers'
    answers and the probe of the engines (at most timeout_s each), and the discards of a staged sync
    within what is left of it (`DISCARD_FLOOR_S` of the 2 s), keeping the rest for the work between
    the waits."""
    return sent + 2 * timeout_s + DISCARD_FLOOR_S


def discard_all(
    pool: cf.Executor, rollouts: Sequence[RolloutAdapter], timeout_s: float, deadline: float | None = None, unreachable: Collection[str] = (),
) -> dict[str, str]:
    """Every engine drops what it staged (a failed staged stream); {engine: why} for those that
    could not (dead or unreachable: they are stale). With `deadline` (`failure_deadline`) the
    discards are waited for only until then (at least `DISCARD_FLOOR_S`): the waits before them
    (the receivers' answers, the probe) already took most of the failure's bound. An engine in
    `unreachable` (its health probe of this failure got no answer) is asked too but waited for only
    `DISCARD_FLOOR_S`: it is stale whatever it answers late, and a frozen one would hold the failure
    up for the whole wait."""
    wait_s = min(10.0, timeout_s)
    if deadline is not None:
        wait_s = min(wait_s, max(DISCARD_FLOOR_S, deadline - time.monotonic()))
    futures = {r.name: pool.submit(r.discard) for r in rollouts}
    failed = collect_failures({n: f for n, f in futures.items() if n not in unreachable}, "discard", round(wait_s, 3))
    failed.update(collect_failures({n: f for n, f in futures.items() if n in unreachable}, "discard", DISCARD_FLOOR_S))
    return {name: f"could not drop its staged version ({why})" for name, why in failed.items()}


def run_order(
    stage: str | None, stream: Callable[[], tuple[Any, Any]], step: Step, version: int, pause_mode: str, seconds: dict[str, float],
    check: Callable[[bool], None] = lambda swapped: None,
) -> tuple[Any, Any, float]:
    """The engines' side of one sync after validate: staged, stream (every engine serving) then
    swap on every engine (its only pause); else today's pause -> stream -> finalize -> resume.
    `check(swapped)`: the installed-weight check, before finalize (staged: after the swap).
    Returns what `stream` returned (the sender's stats, the engines' reports) and the stall: the
    engines' largest swap, or pause to resume (0 with pause_mode none: the engines never stop)."""
    if stage is not None:
        stats, reports = stream()
        stalls = step("swap", seconds, lambda r: r.swap(version, pause_mode))
        check(True)
        return stats, reports, max(stalls.values(), default=0.0)
    t = time.perf_counter()
    step("pause", seconds, lambda r: r.pause(pause_mode))
    stats, reports = stream()
    check(False)
    step("finalize", seconds, lambda r: r.finalize(version))
    step("resume", seconds, lambda r: r.resume())
    return stats, reports, time.perf_counter() - t if pause_mode != "none" else 0.0
