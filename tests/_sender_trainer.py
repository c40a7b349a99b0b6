"""A trainer rank for the many-sender sync tests: joins a gloo trainer group, syncs through
`sync_rollout_weights` with `senders=all`, and writes what happened as JSON (no pickle)."""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import torch

from ckpt_engine import CheckpointEngineConfig, sync_rollout_weights
from ckpt_engine.rollout_adapters.torch_ref import TorchRefRollout
from ckpt_engine.benchmark.sharded_source import ShardedStateDictSource
from multisender import model_state, wire


class _Dying(ShardedStateDictSource):
    """Kills its own process (SIGKILL, no clean-up) at its `die_at`-th piece."""

    def __init__(self, *args: Any, die_at: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.die_at, self.pieces = die_at, 0

    def local_piece(self, name: str) -> torch.Tensor:
        self.pieces += 1
        if self.pieces == self.die_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().local_piece(name)


def trainer_main(
    rank: int, world: int, port: int, engines: list[dict[str, Any]], out_dir: str, versions: int, kill: dict[str, int] | None,
    delta_modes: list[str] | None = None, timeout_s: float = 8.0,
) -> None:
    """`timeout_s`: the sync's; a rank that outlives a dead peer waits it out."""
    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=__import__("datetime").timedelta(seconds=20)
    )
    configs = {m: CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.0625, timeout_s=timeout_s, delta=m, senders="all") for m in ("on", "off")}
    handles = [TorchRefRollout(e["name"], e["host"], e["port"], None, timeout_s, token=e["token"]) for e in engines] if rank == 0 else None
    log: list[dict[str, Any]] = []
    for v in range(versions):
        sd = wire(model_state(v, lr=1e-5))
        if kill is not None and kill["rank"] == rank and kill["version"] == v:
            source: ShardedStateDictSource = _Dying(sd, rank, world, die_at=kill["piece"])
        else:
            source = ShardedStateDictSource(sd, rank, world)
        source.is_sender = rank == 0  # rank 0 controls; the others follow its announcements
        t0 = time.monotonic()
        try:
            report = sync_rollout_weights(source, handles, config=configs[delta_modes[v] if delta_modes else "on"])
            log.append({"v": v, "ok": True, "delta": report.delta if report else None, "staged": report.staged if report else None, "senders": report.senders if report else None,
                        "wire": report.wire_bytes if report else None, "dense": report.dense_bytes if report else None,
                        "bytes": report.bytes if report else None, "per_sender": report.wire_bytes_per_sender if report else None,
                        "received": {n: r.get("delta_wire_bytes") for n, r in report.receivers.items()} if report else None})
        except Exception as exc:
            log.append({"v": v, "ok": False, "error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - t0})
            break
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(log, f)
