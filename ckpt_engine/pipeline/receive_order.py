"""Which bucket a receiver consumes next when several senders stream at once over host work.

Receive buffers and refills are per sender, so buckets of different senders may be consumed in
any order, while each sender's own buckets keep theirs. Consuming whichever sender's next bucket
(its "head") has landed first means a slow bucket of one sender no longer holds back the refill,
hence the broadcast, of another. A pure bookkeeping class: the caller says what "landed" means.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence

__all__ = ["ReadyFirst"]

_FIRST_SLEEP_S = 2e-5
_MAX_SLEEP_S = 1e-3


class ReadyFirst:
    """Per-sender queues of manifest indices; `next_ready` picks the head that landed first."""

    def __init__(self, by_sender: Sequence[Sequence[int]]) -> None:
        self._queues = [deque(own) for own in by_sender if own]

    def __bool__(self) -> bool:
        return bool(self._queues)

    def heads(self) -> list[int]:
        """Every sender's next unconsumed bucket, in manifest order."""
        return sorted(q[0] for q in self._queues)

    def next_ready(self, ready: Callable[[int], bool], timeout_s: float) -> int | None:
        """Remove and return the head for which `ready` holds (the earliest in manifest order when
        several do), polling with a backoff from 20 us to 1 ms; None when none is ready within
        `timeout_s` (nothing is removed then). With one sender left its head is returned at once:
        there is no choice, and the caller's own bounded wait covers it."""
        if len(self._queues) == 1:
            return self._take(self._queues[0])
        deadline = time.monotonic() + timeout_s
        sleep_s = _FIRST_SLEEP_S
        while True:
            for q in sorted(self._queues, key=lambda q: q[0]):
                if ready(q[0]):
                    return self._take(q)
            if time.monotonic() > deadline:
                return None
            time.sleep(sleep_s)  # releases the GIL; the transport's own threads keep receiving
            sleep_s = min(2 * sleep_s, _MAX_SLEEP_S)

    def _take(self, q: deque[int]) -> int:
        k = q.popleft()
        if not q:
            self._queues = [x for x in self._queues if x]
        return k
