"""The suite's shared-engine holder (tests/shared_server.py), over a real subprocess as the engine:
one start for many users, a fresh start after a user killed it or discarded it, stopped at close."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from shared_server import SharedServer


@contextmanager
def _sleeper() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait(10)


def test_one_start_for_many_users_and_a_fresh_one_after_a_kill_or_a_discard() -> None:
    shared = SharedServer("sleeper", _sleeper, lambda proc: proc.poll() is None)
    try:
        first = shared.get()
        assert shared.get() is first and shared.starts == 1
        first.kill()
        first.wait(10)
        second = shared.get()  # the last user killed it: started again
        assert second is not first and second.poll() is None and shared.starts == 2
        shared.discard()
        assert second.poll() is not None  # stopped at once, not at the next get()
        third = shared.get()
        assert third.poll() is None and shared.starts == 3
    finally:
        shared.close()
    assert third.poll() is not None
