"""The process groups of a broadcasting transport: one per sender, built at join.

Sender s builds its group with every receiver; receivers build every sender's group, in sender
order, so nobody waits on a group whose members are still busy building another.
gloo.py says how a host group is made and waited on, nccl.py (and hccl.py) how a device group and
its streams are.
"""

from __future__ import annotations

import logging
from abc import abstractmethod
from typing import Any

import torch

from ckpt_engine.engine import Rendezvous, TransferError
from ckpt_engine.transports.transport import Transport

__all__ = ["ProcessGroupTransport"]

logger = logging.getLogger(__name__)


class ProcessGroupTransport(Transport):
    """A transport whose links are torch process groups with a `broadcast(tensor, root)`."""

    abort_on_close: bool = False
    """Whether `close` aborts the groups instead of shutting them down (a shutdown that waits for
    the peers' would deadlock a receiver leaving while its sender waits for that leave)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._groups: dict[int, Any] = {}  # by sender
        self._group: Any = None  # the group of this rank's first sender

    @abstractmethod
    def make_group(self, store: torch.distributed.Store, rank: int, world_size: int) -> Any:
        """One process group over `store` (its keys already prefixed for this group)."""

    def on_new_group(self, gid: int) -> None:
        """Group `gid` was made (streamed transports give it its stream)."""

    @property
    def group(self) -> Any:
        return self._group

    @property
    def groups(self) -> dict[int, Any]:
        return self._groups

    def join(self, rendezvous: Rendezvous, rank: int) -> None:
        if self._group is not None:
            raise RuntimeError("init_process_group() was already called; call finalize() first to rejoin")
        senders = rendezvous.num_senders
        self.num_senders = senders
        self.rank, self.world_size = rank, rendezvous.world_size
        self.prepare()
        if not self.is_sender:
            self.alloc_buffers(self.num_buffers * senders)  # one set of rotating buffers per sender
        store = rendezvous.connect_store(is_master=False)
        self.join_groups(store, [rank] if self.is_sender else list(range(senders)))
        logger.info("rank %d/%d joined weight-sync group %s (%d senders)", rank, rendezvous.world_size, rendezvous.token, senders)

    def join_groups(self, store: torch.distributed.Store, own: list[int]) -> None:
        """Build the process group of each of senders `own` with every receiver; `group`
        is the first of them (None without any). A tiny broadcast creates each communicator now,
        so join errors surface at join time."""
        senders = self.num_senders
        assert self.rank is not None and self.world_size is not None
        group_rank = 0 if self.is_sender else self.rank - senders + 1
        self._groups = {}
        for sender in own:
            self._groups[sender] = self.make_group(torch.distributed.PrefixStore(f"sender{sender}/", store), group_rank, self.world_size - senders + 1)
            self.on_new_group(sender)
        self._group = self._groups[min(self._groups)] if self._groups else None
        self.broken = False
        for gid, group in sorted(self._groups.items()):
            probe = torch.zeros(1, dtype=torch.int64, device=self.device)
            self.wait_work(group.broadcast(probe, 0), f"warm-up of group {gid}")

    @abstractmethod
    def wait_work(self, work: Any, what: str) -> None:
        """Wait for one work handle within the timeout; a failure is a TransferError."""

    def _failed(self, what: str, exc: BaseException) -> TransferError:
        self.broken = True
        return TransferError(f"rank {self.rank}: {what} failed: {exc}")

    def abort(self) -> None:
        """Abort the groups and drop them: a gloo group's abort leaves its connections open, so a
        peer blocked in a collective with this rank waited for its whole timeout; a dropped group
        closes them, and the peer fails at once ("Connection closed by peer"). The caller drops
        its pending work handles first (they hold the group too)."""
        self.broken = True
        groups, self._groups, self._group = self._groups, {}, None
        for group in groups.values():
            try:
                group.abort()
            except Exception as exc:
                logger.warning("process group abort: %s", exc)

    def close(self) -> None:
        groups, self._groups, self._group = self._groups, {}, None
        for group in groups.values():
            try:
                if self.broken or self.abort_on_close:
                    group.abort()
                else:
                    group.shutdown()
            except Exception as exc:  # tearing down a broken group may itself fail
                logger.warning("process group teardown: %s", exc)
        self.buffers = []
