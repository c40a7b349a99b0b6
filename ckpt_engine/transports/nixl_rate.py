"""The pull transport's rate guardrail (issue 43 item 3): each receiver measures what every link
it pulled from achieved in a sync and compares it with a floor.

The failure the field fears with one-sided transports is silent slowness: a fabric that falls back
to TCP moves the same bytes hundreds of times slower with no error (Ray's NIXL path on AWS EFA).
Per sync and per sender, a receiver counts the bytes it read and the time a read from that sender
was in flight (the union of [posted, seen done] intervals: a read seen done late, because the
loader was busy, counts until it was seen, so a slow loader can only make the figure lower, never
higher), and warns naming the link when the rate is below `min_gbps`, or fails the sync when
asked (`on_slow: error`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

__all__ = ["LinkRate", "PullRates", "SLOW_ACTIONS"]

logger = logging.getLogger(__name__)

SLOW_ACTIONS = ("warn", "error")


@dataclass
class LinkRate:
    """One sender's link as this receiver saw it in one sync."""

    link: str
    bytes: int = 0
    busy_s: float = 0.0
    reads: int = 0
    _until: float = field(default=0.0, repr=False)
    """End of the busy time counted so far (reads overlap: only new time counts)."""

    def add(self, nbytes: int, posted: float, done: float) -> None:
        start = max(posted, self._until)
        if done > start:
            self.busy_s += done - start
        self._until = max(self._until, done)
        self.bytes += nbytes
        self.reads += 1

    @property
    def gbps(self) -> float:
        return self.bytes / self.busy_s / 1e9 if self.busy_s > 0 else 0.0


class PullRates:
    """Every link of one receiver in the current sync, and the check at its end."""

    def __init__(self, min_gbps: float | None, on_slow: str) -> None:
        self.min_gbps = min_gbps
        self.on_slow = on_slow
        self.links: dict[int, LinkRate] = {}
        self.last: dict[int, LinkRate] = {}
        """The links of the last completed sync (for reports and tests)."""

    def begin(self) -> None:
        self.links = {}

    def add(self, sender: int, link: str, nbytes: int, posted: float, done: float) -> None:
        rate = self.links.get(sender)
        if rate is None:
            rate = self.links[sender] = LinkRate(link)
        rate.add(nbytes, posted, done)

    def check(self) -> str | None:
        """The sync's reads are done: log each link's rate; the message of the slowest link below
        the floor when `on_slow` is error (the caller fails the sync with it), else None."""
        self.last, self.links = self.links, {}
        failure: str | None = None
        for sender, rate in sorted(self.last.items()):
            logger.debug("nixl pull %s: %d bytes in %d reads, %.4f s busy, %.3f GB/s", rate.link, rate.bytes, rate.reads, rate.busy_s, rate.gbps)
            if self.min_gbps is None or rate.busy_s <= 0 or rate.gbps >= self.min_gbps:
                continue
            msg = (
                f"nixl pull {rate.link} achieved {rate.gbps:.3f} GB/s ({rate.bytes} bytes in {rate.busy_s:.3f} s of reads), "
                f"below the floor min_gbps={self.min_gbps:g}: the link may have fallen back to a slower transport "
                f"(check UCX_TLS / UCX_NET_DEVICES on both ends)"
            )
            if self.on_slow == "error":
                failure = failure if failure is not None else msg
            else:
                logger.warning("%s", msg)
        return failure
