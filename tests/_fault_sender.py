"""A trainer in its own process, so a test can SIGKILL it mid-sync.

Reads {"engines": [{name, host, port, token}], "seeds": [...], "timeout_s": s, "delay_s": s} (and
optionally "stage", default off, "delta", default off, "backend", default gloo, and "hold_midway", default false) as JSON
from its first argument (else a line of stdin), syncs one version per seed into those reference engines, prints "synced N"
after each. With "hold_midway" the last seed's source yields half its tensors, prints "midway" and waits for a line on
stdin (or its end) before the rest: a test kills it there, surely mid-stream however fast or loaded the box.
"""

from __future__ import annotations

import inspect
import json
import sys
from collections.abc import Iterator

import torch

from ckpt_engine import CheckpointEngineConfig, WeightSyncSession
from ckpt_engine.rollout_adapters.torch_ref import TorchRefRollout
from refengines import SlowSource


class MidwayHeldSource(SlowSource):
    """A SlowSource that stops after half its tensors until a line (or EOF) comes on stdin."""

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        half = len(self.weights) // 2
        for i, item in enumerate(super().iter_weights()):
            if i == half:
                print("midway", flush=True)
                sys.stdin.readline()
            yield item


def main(argv: list[str] | None = None) -> None:
    job = json.loads(argv[0] if argv else sys.stdin.readline())
    takes_token = "token" in inspect.signature(TorchRefRollout.__init__).parameters
    engines = [
        TorchRefRollout(e["name"], e["host"], e["port"], None, job["timeout_s"], **({"token": e["token"]} if takes_token else {}))
        for e in job["engines"]
    ]
    cfg = CheckpointEngineConfig(
        backend=job.get("backend", "gloo"), bucket_size_mb=0.0625, timeout_s=job["timeout_s"], stage=job.get("stage", "off"), delta=job.get("delta", "off")
    )
    session = WeightSyncSession(engines, cfg)
    for i, seed in enumerate(job["seeds"]):
        held = job.get("hold_midway", False) and i == len(job["seeds"]) - 1
        report = session.sync((MidwayHeldSource if held else SlowSource)(seed, job.get("delay_s", 0.0)))
        print(f"synced {report.version}", flush=True)


if __name__ == "__main__":
    main()
