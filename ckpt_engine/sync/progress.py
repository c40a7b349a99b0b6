"""What each engine went through in one sync, so that a failed sync's error says what each engine
now does: paused on its old or a partial version, holding the new one paused, serving the new one,
or never paused at all (a staged sync, a client that cannot pause)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ckpt_engine.rollout_adapters.base import RolloutAdapter
from ckpt_engine.rollout_adapters.capabilities import lacking
from ckpt_engine.sync.report import BEFORE_PAUSE, SyncError

__all__ = ["SyncProgress"]


class SyncProgress:
    """The engines this sync paused (and has not let go), those it streamed into unpaused (`pause_mode:
    none`, or a client that cannot pause), those that hold its version (finalized) and those serving
    it (swapped or resumed); `restate` words a `SyncError` from them."""

    def __init__(self) -> None:
        self.begin([], "none")

    def begin(self, rollouts: Sequence[RolloutAdapter], pause_mode: str) -> None:
        """A new sync: nothing paused yet."""
        self.unpausable = set(lacking(rollouts, "pauses"))
        self.stops = pause_mode != "none"
        self.paused: set[str] = set()
        self.exposed: set[str] = set()
        self.holding: set[str] = set()
        self.live: set[str] = set()

    def step(self, stage: str, answered: Iterable[str]) -> None:
        """`answered`: the engines whose `stage` step (pause, finalize, swap, resume) went through."""
        names = set(answered)
        if stage == "pause":
            self.held_out(names if self.stops else set())
            self.exposed |= names - self.paused
        elif stage == "finalize":
            self.holding |= names
        elif stage in ("swap", "resume"):
            self.live |= names
            self.paused -= names
            self.holding -= names

    def held_out(self, names: Iterable[str]) -> None:
        """`names` were paused (whatever `pause_mode`: an engine a check failed is taken out of service)."""
        self.paused |= set(names) - self.unpausable
        self.live -= set(names)

    def restate(self, error: SyncError) -> SyncError:
        """`error` with its closing words from what each engine of its `stale` list did."""
        if error.stage in BEFORE_PAUSE:
            return error
        stale = set(error.stale)
        live = (self.live | self.holding & self.exposed - self.paused) & stale  # finalized unpaused: it serves it
        groups = [
            ("serving the new version", live),
            ("holding the new version, paused", self.holding & stale - live),
            ("left paused and stale", self.paused & stale - live - self.holding),
            ("not paused while it received (pause_mode none, or a client that cannot pause): it may serve part of the new version",
             self.exposed & stale - live - self.holding - self.paused),
        ]
        told = set().union(*(names for _, names in groups))
        groups.append(("not paused by this sync, still on its old version unless its error says otherwise", stale - told))
        said = "; ".join(f"{what}: {', '.join(sorted(names))}" for what, names in groups if names)
        error.restate(f"{said or 'no engine left stale'}; the next complete sync reseeds every engine listed", sorted(live))
        return error
