"""Trainers for the region-delivery tests: a rank of the many-sender test (joins a gloo trainer
group, syncs versions of the tiny Qwen2 through `sync_rollout_weights` with `senders=all`, writes a
JSON log), and `killed_sender_main` (`python -m _region_trainer`), which kills itself mid-stream."""

from __future__ import annotations

import datetime
import json
import os
import sys
from typing import Any

import torch

from ckpt_engine import CheckpointEngineConfig, sync_rollout_weights
from ckpt_engine.rollout_adapters.torch_ref import TorchRefRollout
from ckpt_engine.benchmark.sharded_source import ShardedStateDictSource
from regionranks import qwen2_specs, weights


def region_trainer_main(rank: int, world: int, port: int, engines: list[dict[str, Any]], out_dir: str, versions: int) -> None:
    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30)
    )
    cfg = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.0625, timeout_s=20, delta="on", senders="all")
    handles = [TorchRefRollout(e["name"], e["host"], e["port"], None, 20, token=e["token"]) for e in engines] if rank == 0 else None
    log: list[dict[str, Any]] = []
    for v in range(versions):
        source = ShardedStateDictSource(weights(qwen2_specs(), v), rank, world)
        source.is_sender = rank == 0
        try:
            report = sync_rollout_weights(source, handles, config=cfg)
            log.append({"ok": True, "delta": report.delta if report else None, "senders": report.senders if report else None,
                        "received": report.received_bytes if report else None})
        except Exception as exc:
            log.append({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
            break
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(log, f)


class _DiesMidStream:
    """The frame count of the armed sync in `killed_sender_main`'s process."""

    armed = False
    frames = 0
    die_at = 2


def killed_sender_main() -> None:
    """A region-sync trainer in its own process that SIGKILLs itself mid-stream.

    Reads {"engines": [{name, host, port, token}], "versions": [...], "die_at": K, "timeout_s": s}
    from a line of stdin; syncs each version into those reference engines (printing "synced N"),
    and in the last one kills itself as it is about to send its K-th frame: the receiver sets
    before it were delivered whole, the rest never were."""
    import signal

    from ckpt_engine import WeightSyncSession
    from ckpt_engine.sources.base import StateDictSource
    from tamper import GlooEngine
    from ckpt_engine.registry import CheckpointEngineRegistry

    class Dying(GlooEngine):
        def _tamper_hook(self, bucket_index: int, message: torch.Tensor) -> None:
            if _DiesMidStream.armed:
                _DiesMidStream.frames += 1
                if _DiesMidStream.frames >= _DiesMidStream.die_at:
                    os.kill(os.getpid(), signal.SIGKILL)

    job = json.loads(sys.stdin.readline())
    CheckpointEngineRegistry._classes["gloo"] = Dying  # this process only: the sender's engines
    _DiesMidStream.die_at = int(job["die_at"])
    handles = [TorchRefRollout(e["name"], e["host"], e["port"], None, job["timeout_s"], token=e["token"]) for e in job["engines"]]
    cfg = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.0625, timeout_s=job["timeout_s"], delta="on", stage="auto")
    session = WeightSyncSession(handles, cfg)
    versions = list(job["versions"])
    for i, v in enumerate(versions):
        _DiesMidStream.armed = i == len(versions) - 1
        report = session.sync(StateDictSource(weights(qwen2_specs(), v)))
        print(f"synced {report.version} {report.delta} {report.staged}", flush=True)


if __name__ == "__main__":
    killed_sender_main()
