"""Test-only vLLM worker extension for peer joins (tests/test_elastic_vllm_failover.py): holds a
pull between two of its read windows while a file exists, so a test acts on the peer (kills it)
while the joiner is certainly mid-pull, with no timing. What the worker serves at the hold (its
version, and digests of its live parameters) is written where the test waits for it: the test
asks nothing of the engine meanwhile (an in-process `LLM`'s client is not for two threads at once,
and the join's thread is polling it). It marks staged receives too (`_vllm_stage_marks.py`, for
tests/test_elastic_vllm_holds.py): one class, so the serving peer A of the three elastic vLLM
modules is one engine they share (tests/conftest.py's `elastic_vllm_peer`)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from _vllm_stage_marks import StageMarksExtension

from ckpt_engine.elastic import pull
from ckpt_engine.rollout_adapters.torch_ref.load_gate import HOLD_MAX_S

EXTENSION = "_vllm_peer_faults.PeerFaultsExtension"


class PeerFaultsExtension(StageMarksExtension):
    def test_hold_pulls(self, holds: list[list[str]]) -> None:
        """The i-th hold of this worker's pulls (`VllmPeer.hold`: after each read window; a pull
        whose next read fails holds no more) writes {version, stale, digests} to `holds[i][1]`,
        then waits while `holds[i][0]` exists (at most `HOLD_MAX_S`). Holds past the list pass.
        From here this worker's pulls read one tensor a read (`pull.RUN_BYTES`)."""
        calls = iter(holds)
        core = self._ckpt_core()
        # One tensor a read, so a pull has windows to hold between whatever the peer's layout: a peer
        # whose image is one slab (it joined by a pull itself) was read in one run, and a pull of one
        # window ends before its hold (the failover test then saw the pull from C complete).
        pull.RUN_BYTES = 0

        def hold() -> None:
            files = next(calls, None)
            if files is None:
                return
            hold_file, reached_file = files
            serving = {"version": core.version, "stale": core.stale, "digests": self.ckpt_param_digests()}
            Path(reached_file + ".tmp").write_text(json.dumps(serving))
            os.replace(reached_file + ".tmp", reached_file)
            deadline = time.monotonic() + HOLD_MAX_S
            while os.path.exists(hold_file) and time.monotonic() < deadline:
                time.sleep(0.01)

        core.peer.hold = hold
