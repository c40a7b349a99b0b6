"""Waits on a condition with a deadline: a test waits for what it needs to have happened, never for
a fixed time (CI boxes differ 2x in speed and run beside other jobs)."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest


def wait_for(what: str, check: Callable[[], bool], timeout_s: float) -> float:
    """Seconds until `check()` held; fails the test after `timeout_s`, naming `what` never happened."""
    t0 = time.monotonic()
    while not check():
        if time.monotonic() - t0 > timeout_s:
            pytest.fail(f"not within {timeout_s}s: {what}")
        time.sleep(0.05)
    return time.monotonic() - t0
