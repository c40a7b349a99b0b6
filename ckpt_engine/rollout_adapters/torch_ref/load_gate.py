"""Where the reference receiver's bucket loads may be held, for tests and benchmarks.

Two knobs: a fixed delay per bucket (a slow loader: `--load-delay-s`), and a hold while a file
exists (its path in `$CKPT_REF_HOLD_FILE`), so a fault test can stop or kill an engine that is
certainly mid-stream: it creates the file, waits for the engine's health to say `held`, acts, and
removes the file. A delay alone made such tests race the box's speed (issue 42).
"""

from __future__ import annotations

import os
import time

__all__ = ["HOLD_ENV", "HOLD_MAX_S", "LoadGate"]

HOLD_ENV = "CKPT_REF_HOLD_FILE"
HOLD_MAX_S = 120.0
"""The longest one hold lasts: a file left behind never blocks an engine for good."""


class LoadGate:
    def __init__(self, delay_s: float = 0.0, hold_file: str | None = None) -> None:
        self.delay_s = delay_s
        self.hold_file = hold_file
        self.held = False
        """True while a load waits for the hold file to go (health reports it)."""

    @classmethod
    def from_env(cls, delay_s: float) -> LoadGate:
        return cls(delay_s, os.environ.get(HOLD_ENV) or None)

    def pass_through(self) -> None:
        """Called before each bucket loads: the delay, then the hold (at most `HOLD_MAX_S`)."""
        if self.delay_s:
            time.sleep(self.delay_s)
        if self.hold_file is None:
            return
        deadline = time.monotonic() + HOLD_MAX_S
        while os.path.exists(self.hold_file) and time.monotonic() < deadline:
            self.held = True
            time.sleep(0.01)
        self.held = False
