"""The delta kernels load when a process joins a group, not inside the first patch sync (issue 45:
the first patch sync of a fresh process loaded numba kernels inside the transfer window, 6.2-6.6 s
on a loaded box against 0.6 s warm, and failed syncs with timeout_s 8-10).

A fresh interpreter (nothing of this test session loaded) joins a reference engine, itself a fresh
interpreter; after the join and before any sync, both report their device's kernels loaded."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent("""
    import json, sys
    from ckpt_engine import CheckpointEngineConfig, WeightSyncSession
    from ckpt_engine.delta.warm import warmed
    from ckpt_engine.rollout_adapters.torch_ref import TorchRefRollout, write_spec_file
    from ckpt_engine.sources.base import StateDictSource
    import torch

    spec = sys.argv[1]
    write_spec_file(spec, StateDictSource({"w": torch.zeros(64, 64)}).metadata())
    before = sorted(warmed())
    engine = TorchRefRollout.spawn("fresh", spec_file=spec, timeout_s=120)
    try:
        engine_before = engine.health()["delta_warmed"]
        session = WeightSyncSession([engine], CheckpointEngineConfig(backend="gloo", timeout_s=60, delta="on"))
        session.join()
        print(json.dumps({"before": before, "engine_before": engine_before, "sender": sorted(warmed()),
                          "engine": engine.health()["delta_warmed"], "version": engine.health()["version"]}))
        session.close()
    finally:
        engine.close()
""")


def test_a_fresh_sender_and_receiver_load_the_delta_kernels_at_the_join(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "spec.msgpack")], capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["before"] == [] and seen["engine_before"] == [], seen  # nothing loaded at import or start
    assert seen["sender"] == ["cpu"] and seen["engine"] == ["cpu"], seen  # both sides, at the join
    assert seen["version"] is None, seen  # no sync ran: the kernels were loaded before any
