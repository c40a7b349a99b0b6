"""Test-only vLLM worker extension (tests/test_elastic_vllm_holds.py): marks, in a file, that a
staged receive has started on this worker, so a test acts while a sync certainly holds the engine
(its receive thread then only waits on the group's store, never on the engine's client), with no
timing."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ckpt_engine.rollout_adapters.vllm.worker import CkptEngineWorkerExtension

EXTENSION = "_vllm_stage_marks.StageMarksExtension"


class StageMarksExtension(CkptEngineWorkerExtension):
    stage_mark: str | None = None
    """Where the next staged receive marks that it started (None: nowhere)."""

    def test_mark_stages(self, path: str | None) -> None:
        self.stage_mark = path

    def ckpt_stage(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        out = super().ckpt_stage(*args, **kwargs)
        if self.stage_mark is not None:
            Path(self.stage_mark + ".tmp").write_text("staging")
            os.replace(self.stage_mark + ".tmp", self.stage_mark)
        return out
