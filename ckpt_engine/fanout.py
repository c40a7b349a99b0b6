"""Waiting on one future per engine with one shared deadline, collecting who failed and why."""

from __future__ import annotations

import concurrent.futures as cf
import time
from collections.abc import Iterable
from typing import Any

__all__ = ["collect_failures", "mark_stale_and_probe"]


def collect_failures(futures: dict[str, cf.Future[Any]], stage: str, timeout_s: float) -> dict[str, str]:
    """{engine: reason} for every future that raised or did not finish within `timeout_s` in all."""
    failed: dict[str, str] = {}
    deadline = time.monotonic() + timeout_s
    for name, fut in futures.items():
        try:
            fut.result(timeout=max(0.0, deadline - time.monotonic()))
        except cf.TimeoutError:
            failed[name] = f"no answer to {stage} within {timeout_s}s"
        except Exception as exc:
            failed[name] = f"{type(exc).__name__}: {exc}"
    return failed


def mark_stale_and_probe(members: Iterable[Any], failed: dict[str, str], stale: set[str]) -> None:
    """After a failed stage: every member is stale until a complete sync; members not already named
    in `failed` get a health probe, and the unreachable ones are added to `failed` by name."""
    for m in members:
        stale.add(m.name)
        if m.name not in failed:
            try:
                m.health()
            except Exception as exc:
                failed[m.name] = f"unreachable after the failure: {exc}"
