"""Test-only worker extension for tests/test_vllm_plan_cache.py: the library's worker extension plus
reads of how this worker's receive plan was had, and a direct call of the kept plan's lookup inside
the worker (its log lines and result sent back: a worker's log is not the test's). The reads
(`PlanCacheReads`) ride on the session's shared TP=2 engine's extension too (tests/vllm_regions_ext.py),
whose lookups keep their files in a dir the test names (tests/test_vllm_plan_cache_tp2.py)."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ckpt_engine.rollout_adapters.vllm.worker import CkptEngineWorkerExtension

EXTENSION = "_vllm_plan_cache_ext.PlanCacheExtension"


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextmanager
def _kept_in(path: str | None) -> Iterator[None]:
    """The plan cache's dir in this worker is `path` for the block (None: the one it started with),
    as if the worker had started with `CKPT_ENGINE_CACHE_DIR=path` (read once per process: cleared)."""
    from ckpt_engine.rollout_adapters.vllm.plan_cache import cache_dir

    if path is None:
        yield
        return
    before = os.environ.get("CKPT_ENGINE_CACHE_DIR")
    os.environ["CKPT_ENGINE_CACHE_DIR"] = path
    cache_dir.cache_clear()
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("CKPT_ENGINE_CACHE_DIR", None)
        else:
            os.environ["CKPT_ENGINE_CACHE_DIR"] = before
        cache_dir.cache_clear()


class PlanCacheReads:
    """The reads, on any extension that has the library's `_ckpt_core()`."""

    def test_plan_source(self) -> dict[str, Any] | None:
        source = self._ckpt_core().plan_source
        return dataclasses.asdict(source) if source is not None else None

    def test_lookup(self, cache_dir: str | None = None) -> dict[str, Any]:
        """The kept plan's lookup run here now, beside a full dry run: how it went, its log lines,
        and whether its recording is the full one's, field by field. Its files are kept in
        `cache_dir` (None: where this worker keeps them)."""
        from ckpt_engine.rollout_adapters.vllm.plan_cache import kept_receive_plan
        from ckpt_engine.rollout_adapters.vllm.regions import record_receive_plan

        core = self._ckpt_core()
        model, needed = self.model_runner.get_model(), core.specs().needed  # type: ignore[attr-defined]
        log = logging.getLogger("ckpt_engine.rollout_adapters.vllm.plan_cache")
        lines, level = _Lines(), log.level
        log.addHandler(lines)
        log.setLevel(logging.INFO)
        try:
            with _kept_in(cache_dir):
                plan, rec, source = kept_receive_plan(model, needed, core.vllm_config)
        finally:
            log.removeHandler(lines)
            log.setLevel(level)
        full_plan, full = record_receive_plan(model, needed, core.vllm_config)
        fields = ("boxes", "whole", "computed", "unfollowed", "touched", "landings")
        return {
            **dataclasses.asdict(source), "logs": lines.lines, "plan_equal": plan.holds == full_plan.holds,
            "differ": [f for f in fields if getattr(rec, f) != getattr(full, f)], "landings": len(full.landings),
        }


class PlanCacheExtension(CkptEngineWorkerExtension, PlanCacheReads):
    """The library's worker extension plus the reads (tests/test_vllm_plan_cache.py's engines)."""
