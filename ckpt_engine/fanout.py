"""Waiting on one future per engine with one shared deadline, collecting who failed and why."""

from __future__ import annotations

import concurrent.futures as cf
import time
from typing import Any

__all__ = ["collect_failures"]


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
