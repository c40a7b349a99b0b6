"""Rank 0 leads, the other trainer ranks follow: one loop, many data-parallel trainer processes.

Only rank 0 runs the fully-async loop (queue, staleness, daemon, syncs). The other ranks hold
their shards of the same model and must join every collective in the same order, so rank 0
broadcasts each decision over the trainer's process group before acting on it:

    header = int64[3]: (command, rows, cols)     broadcast from rank 0
    STEP   -> input_ids int64[rows, cols], actions int64[rows], advantages float32[rows]
              every rank trains on its contiguous slice of the rows, then steps the optimizer
    SYNC   -> (rows = 1: every rank sends its own shards) once per attempt, every rank walks
              `iter_weights()` or follows rank 0's announcements and sends (`follow_sync`)
    STOP   -> the followers return

The batch travels as plain tensors through the group's broadcast (no pickle). Every wait is a
collective bounded by the group's timeout (set when the group is created).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from ckpt_engine.config import CheckpointEngineConfig
from ckpt_engine.trainer.lm_task import TokenTask
from ckpt_engine.trainer.loop import TorchDistWalkBarrier, follow_sync
from ckpt_engine.trainer.engines.base import LossFn, TrainEngine

__all__ = ["DataParallelLeader", "follow_leader", "local_rows"]

logger = logging.getLogger(__name__)

STOP, STEP, SYNC = 0, 1, 2
BATCH_KEYS = ("input_ids", "actions", "advantages")


def local_rows(rows: int, rank: int, world_size: int) -> slice:
    """This rank's contiguous part of a batch of `rows` (earlier ranks take the remainder)."""
    base, extra = divmod(rows, world_size)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (1 if rank < extra else 0))


def _broadcast_header(group: dist.ProcessGroup, command: int, rows: int = 0, cols: int = 0) -> None:
    dist.broadcast(torch.tensor([command, rows, cols], dtype=torch.int64), 0, group=group)


class DataParallelLeader(TrainEngine):
    """Rank 0's view of a data-parallel TrainEngine: every call is announced to the followers first.

    Wraps the rank-local engine; the loop drives it like any TrainEngine and passes it as `peers`.
    Its `source` is the wrapped engine's (sharded, so a sync may send from every rank, when that
    source is a `ShardedWeightSource`); its process group is the trainer group the followers
    hear announcements on.
    """

    def __init__(self, engine: TrainEngine, group: dist.ProcessGroup) -> None:
        if dist.get_rank(group) != 0:
            raise ValueError("DataParallelLeader runs on rank 0 of the trainer group; the other ranks call follow_leader()")
        self.engine = engine
        self.source = engine.source
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.stopped = False

    # --- announced collectives -----------------------------------------------------------------
    def forward_backward(self, batch: dict[str, torch.Tensor], loss_fn: LossFn) -> dict[str, float]:
        """Broadcast the whole batch, then train on rank 0's slice (the followers train on theirs)."""
        if self.stopped:
            raise RuntimeError("the followers were stopped; no further steps can run")
        ids = batch["input_ids"].to(torch.int64).contiguous()
        rows, cols = ids.shape
        _broadcast_header(self.group, STEP, rows, cols)
        tensors = {"input_ids": ids, "actions": batch["actions"].to(torch.int64).contiguous(), "advantages": batch["advantages"].to(torch.float32).contiguous()}
        for key in BATCH_KEYS:
            dist.broadcast(tensors[key], 0, group=self.group)
        part = local_rows(rows, 0, self.world_size)
        return self.engine.forward_backward({k: v[part] for k, v in tensors.items()}, loss_fn)

    def optimizer_step(self) -> float:
        """The followers step right after their forward_backward, in the same collective order."""
        return self.engine.optimizer_step()

    def announce_sync(self, many_senders: bool = False) -> TorchDistWalkBarrier:
        """Tell the followers a sync starts, and whether they send their own shards (else they walk
        the weights); the daemon calls the barrier after each attempt."""
        _broadcast_header(self.group, SYNC, int(many_senders))
        return TorchDistWalkBarrier(self.group, 0)

    def stop(self) -> None:
        """Release the followers (idempotent)."""
        if not self.stopped:
            self.stopped = True
            _broadcast_header(self.group, STOP)

    # --- local --------------------------------------------------------------------------------
    def train_mode(self) -> None:
        self.engine.train_mode()

    def eval_mode(self) -> None:
        self.engine.eval_mode()

    def save_checkpoint(self, path: str) -> None:
        raise NotImplementedError("checkpointing is not part of the leader/follower protocol yet")

    def load_checkpoint(self, path: str) -> None:
        raise NotImplementedError("checkpointing is not part of the leader/follower protocol yet")


def follow_leader(
    engine: TrainEngine, group: dist.ProcessGroup, task: TokenTask, config: CheckpointEngineConfig | None = None
) -> dict[str, int]:
    """Ranks other than 0: do what rank 0 announces until it says STOP; returns counts. `config`:
    the job's checkpoint_engine section (timeouts of a sync where every rank sends)."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    steps = syncs = 0
    while True:
        header = torch.zeros(3, dtype=torch.int64)
        dist.broadcast(header, 0, group=group)
        command, rows, cols = (int(v) for v in header.tolist())
        if command == STOP:
            return {"steps": steps, "syncs": syncs}
        if command == STEP:
            batch = {
                "input_ids": torch.empty((rows, cols), dtype=torch.int64),
                "actions": torch.empty(rows, dtype=torch.int64),
                "advantages": torch.empty(rows, dtype=torch.float32),
            }
            for key in BATCH_KEYS:
                dist.broadcast(batch[key], 0, group=group)
            part = local_rows(rows, rank, world_size)
            engine.train_mode()
            engine.forward_backward({k: v[part] for k, v in batch.items()}, task.loss_fn)
            engine.optimizer_step()
            steps += 1
        elif command == SYNC:
            follow_sync(engine.source, TorchDistWalkBarrier(group, 0), many_senders=bool(rows), config=config)
            syncs += 1
        else:
            raise RuntimeError(f"rank {rank}: unknown command {command} from rank 0")
