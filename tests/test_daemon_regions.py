"""Region delivery through the daemon's sync path: reference engines started as TP=2 ranks register
by descriptor with `WeightSyncDaemon`; its syncs (a dense and two patches) leave each rank holding
exactly its slices bit for bit, and the outcome's report shows each rank took about half the model."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckpt_engine.config import CheckpointEngineConfig
from ckpt_engine.daemon import DaemonClient, DaemonConfig, WeightSyncDaemon
from ckpt_engine.planning.receive_sets import cut_region
from ckpt_engine.planning.tp_ep import tp_ep_plan
from ckpt_engine.rollout_adapters.torch_ref import write_spec_file
from ckpt_engine.sources.base import StateDictSource
from helpers_daemon import descriptor
from refengines import same_bits, spawn_engine
from regionranks import KV_HEADS, qwen2_specs, weights

pytestmark = pytest.mark.timeout(240)

JOB_TOKEN = "test-daemon-regions-token"


def test_daemon_delivers_each_tp_rank_only_its_slices(tmp_path: Path) -> None:
    specs = qwen2_specs()
    path = str(tmp_path / "qwen2.msgpack")
    write_spec_file(path, specs)
    engines = [
        spawn_engine(f"tp{r}", spec_file=path, timeout_s=60, token=JOB_TOKEN, layout={"tp_size": 2, "tp_rank": r, "num_kv_heads": KV_HEADS})
        for r in range(2)
    ]
    cfg = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.0625, timeout_s=30, delta="on")
    daemon = WeightSyncDaemon(cfg, DaemonConfig(heartbeat_timeout_s=0, health_interval_s=0.5), token=JOB_TOKEN)
    daemon.serve()
    try:
        client = DaemonClient(daemon.address, daemon.token, timeout_s=10)
        for e in engines:
            client.register(e.name, descriptor(e))
        model = sum(s.nbytes for s in specs)
        kinds = []
        for v in range(3):
            w = weights(specs, v)
            outcome = daemon.sync(StateDictSource(w))
            assert outcome.ok and not outcome.dropped, outcome.to_dict()
            assert outcome.report is not None
            kinds.append(outcome.report["delta"])
            received = outcome.report["received_bytes"]
            assert all(received[e.name][0] <= 0.55 * model for e in engines), received
            for r, e in enumerate(engines):
                plan = tp_ep_plan(specs, tp_size=2, tp_rank=r, num_kv_heads=KV_HEADS)  # what the engine states (the daemon owns it now)
                assert plan is not None
                bad = [n for n, rs in plan.holds.items() if not same_bits(e.get_tensor(n), cut_region(w[n], rs[0] if rs else None).contiguous())]
                assert bad == [], (e.name, bad[:3])
                assert e.health()["version"] == outcome.version
        assert kinds == ["seed", "patch", "patch"]
    finally:
        daemon.close()
        for e in engines:
            e.close()
