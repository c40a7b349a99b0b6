"""A daemon's sync fixes the sender's device from the trainer's source, as a session's does.

`WeightSyncDaemon.sync` wraps the source (`daemon/outcome.py` `OneWalkPerAttempt`); the wrapper
must report the source's device, or a trainer on cuda:1 whose current device is cuda:0 joins the
group from the engine's GPU (NCCL: "Duplicate GPU detected"). Here a source that says its tensors
are on cuda:1, against a sender configured for cuda:0: refused by name before the group is joined,
the engine still serving its version. No GPU is touched: the refusal comes first.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ckpt_engine.config import CheckpointEngineConfig
from ckpt_engine.daemon import WeightSyncDaemon
from ckpt_engine.daemon.config import DaemonConfig
from ckpt_engine.sources.base import StateDictSource
from helpers_daemon import TIMEOUT_S, Engines, weights, write_spec

TOKEN = "source-device-token"


class _SaysCuda1(StateDictSource):
    """A trainer's source whose tensors it says live on cuda:1 (host tensors here: never read)."""

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", 1)


def test_a_daemon_sync_refuses_a_sender_device_other_than_the_sources(tmp_path: Path) -> None:
    engines = Engines(write_spec(tmp_path / "spec.json"), TOKEN)
    cfg = CheckpointEngineConfig(backend="nccl", bucket_size_mb=0.25, timeout_s=TIMEOUT_S, stage="off", engine_kwargs={"nccl": {"device": "cuda:0"}})
    daemon = WeightSyncDaemon(cfg, DaemonConfig(heartbeat_timeout_s=0), token=TOKEN)
    try:
        r0 = engines.spawn("r0")
        daemon.register("r0", r0)
        with pytest.raises(ValueError, match=r"the weight source's tensors are on cuda:1 but the nccl sender is set to cuda:0"):
            daemon.sync(_SaysCuda1(weights(1)))
        h = r0.health()
        assert (h["version"], h["paused"], h["stale"]) == (None, False, False), h  # nothing paused, nothing sent
        assert not torch.equal(r0.get_tensor("layer0.weight"), weights(1)["layer0.weight"])
    finally:
        daemon.close()
        engines.close()
