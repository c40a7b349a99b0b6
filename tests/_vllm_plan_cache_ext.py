"""Test-only worker extension for tests/test_vllm_plan_cache.py: the library's worker extension plus
reads of how this worker's receive plan was had, and a direct call of the kept plan's lookup inside
the worker (its log lines and result sent back: a worker's log is not the test's)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from ckpt_engine.rollout_adapters.vllm.worker import CkptEngineWorkerExtension

EXTENSION = "_vllm_plan_cache_ext.PlanCacheExtension"


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


class PlanCacheExtension(CkptEngineWorkerExtension):
    def test_plan_source(self) -> dict[str, Any] | None:
        source = self._ckpt_core().plan_source
        return dataclasses.asdict(source) if source is not None else None

    def test_lookup(self) -> dict[str, Any]:
        """The kept plan's lookup run here now, beside a full dry run: how it went, its log lines,
        and whether its recording is the full one's, field by field."""
        from ckpt_engine.rollout_adapters.vllm.plan_cache import kept_receive_plan
        from ckpt_engine.rollout_adapters.vllm.regions import record_receive_plan

        core = self._ckpt_core()
        model, needed = self.model_runner.get_model(), core.specs().needed  # type: ignore[attr-defined]
        log = logging.getLogger("ckpt_engine.rollout_adapters.vllm.plan_cache")
        lines, level = _Lines(), log.level
        log.addHandler(lines)
        log.setLevel(logging.INFO)
        try:
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
