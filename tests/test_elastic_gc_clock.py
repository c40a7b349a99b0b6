"""The pull's collector clock (`elastic/pull.py` `GcClock`): it counts the cyclic collector's time and
full collections while it is open, and `hold` keeps automatic collections off while any hold is open
(nested, or on another thread) and leaves the collector as it found it."""

from __future__ import annotations

import gc
import threading

from ckpt_engine.elastic.pull import GcClock


def test_the_clock_counts_collections_and_full_ones() -> None:
    with GcClock().timing() as clock:
        gc.collect(0)
        gc.collect()
    assert clock.full == 1 and clock.seconds > 0
    before = clock.info()
    gc.collect()  # closed: not counted
    assert clock.info() == before == {"gc": clock.seconds, "gc_full": 1.0}


def test_a_hold_keeps_collections_off_while_any_is_open_and_restores_the_collector() -> None:
    assert gc.isenabled()
    inner_open, outer_may_close = threading.Event(), threading.Event()

    def other() -> None:
        with GcClock.hold():
            inner_open.set()
            assert outer_may_close.wait(30)
            assert not gc.isenabled()

    with GcClock.hold():
        assert not gc.isenabled()
        t = threading.Thread(target=other)
        t.start()
        assert inner_open.wait(30)
    assert not gc.isenabled()  # the other thread's hold is still open
    outer_may_close.set()
    t.join(30)
    assert gc.isenabled()
    gc.disable()
    try:
        with GcClock.hold():
            pass
        assert not gc.isenabled()  # off before: left off
    finally:
        gc.enable()
