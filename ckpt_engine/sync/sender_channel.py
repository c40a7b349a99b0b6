"""Trainer rank 0 tells the other sending ranks what to do, over the trainer's own process group.

With many senders, the controller (trainer rank 0: it talks to the engines and builds the
weight-sync group) must hand every other trainer rank, per sync, the group to join, the plan's
digest and the delta request, and learn afterwards whether each rank's send succeeded. Messages
are msgpack in a uint8 tensor (never pickle), validated on arrival; every wait has a timeout.
"""

from __future__ import annotations

import datetime
import time
from typing import Any

import msgpack
import torch

__all__ = ["SenderChannel"]

MAX_MESSAGE_BYTES = 1 << 20
STATUS_BYTES = 512


class SenderChannel:
    """Collective on every rank of `group` (the trainer's process group; None: the default one)."""

    def __init__(self, group: Any = None, *, timeout_s: float = 300.0) -> None:
        if not torch.distributed.is_initialized():
            raise RuntimeError("many senders need the trainer's torch.distributed process group; initialize it first")
        self.group = group
        self.timeout_s = timeout_s
        self.rank = torch.distributed.get_rank(group)
        self.world_size = torch.distributed.get_world_size(group)
        backend = str(torch.distributed.get_backend(group))
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self.last_figures: list[dict[str, float] | None] = []
        """Each rank's send figures from the last `gather_status` (None: it sent none)."""

    def _wait(self, work: Any, what: str) -> None:
        """Wait for `work` at most `timeout_s`. On a device group `wait()` only orders streams (the
        host then blocks in `.item()` until the process group's own watchdog kills the process, issue
        39), so the host polls `is_completed()` against the same bound: a rank whose peer skipped a
        collective gets this error, naming the step, instead of that kill."""
        try:
            if self.device.type == "cpu":
                work.wait(datetime.timedelta(seconds=self.timeout_s))
                return
            deadline, pause = time.monotonic() + self.timeout_s, 0.0005
            while not work.is_completed():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"not completed within {self.timeout_s:g}s")
                time.sleep(pause)
                pause = min(2 * pause, 0.01)
            work.wait()
        except Exception as exc:
            raise RuntimeError(f"trainer rank {self.rank}: {what} over the trainer's process group failed: {exc}") from exc

    def _broadcast(self, t: torch.Tensor, what: str) -> None:
        src = torch.distributed.get_global_rank(self.group, 0) if self.group is not None else 0
        self._wait(torch.distributed.broadcast(t, src=src, group=self.group, async_op=True), what)

    def publish(self, message: dict[str, Any]) -> None:
        """Rank 0: send `message` to every other rank of the group."""
        data = msgpack.packb(message, use_bin_type=True)
        if len(data) > MAX_MESSAGE_BYTES:
            raise ValueError(f"sender message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
        size = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        self._broadcast(size, "announcing the sync")
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
        self._broadcast(payload, "announcing the sync")

    def receive(self) -> dict[str, Any]:
        """Every other rank: the message rank 0 published."""
        size = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._broadcast(size, "waiting for the sync's announcement")
        n = int(size.item())
        if not 0 < n <= MAX_MESSAGE_BYTES:
            raise ValueError(f"sender message claims {n} bytes (limit {MAX_MESSAGE_BYTES})")
        payload = torch.empty(n, dtype=torch.uint8, device=self.device)
        self._broadcast(payload, "waiting for the sync's announcement")
        try:
            msg = msgpack.unpackb(bytes(payload.cpu().numpy()), raw=False, max_bin_len=0, max_ext_len=0)
        except Exception as exc:
            raise ValueError(f"sender message is not valid msgpack: {exc}") from None
        if not isinstance(msg, dict):
            raise ValueError("sender message must be a map")
        return msg

    def gather_status(self, error: str | None, figures: dict[str, float] | None = None) -> list[str | None]:
        """Every rank: each rank's error (None: it succeeded), gathered everywhere. A rank that
        succeeded may add its send's `figures` (a few numbers: its wire bytes); everyone's land
        in `last_figures` (None for a rank that sent none)."""
        if error is not None:
            text = ("!" + error).encode()[: STATUS_BYTES - 1]
        elif figures:
            text = b"=" + msgpack.packb({str(k): float(v) for k, v in figures.items()}, use_bin_type=True)
            if len(text) > STATUS_BYTES - 1:
                raise ValueError(f"send figures of {len(text)} bytes exceed the report round's {STATUS_BYTES - 1}")
        else:
            text = b""
        mine = torch.zeros(STATUS_BYTES, dtype=torch.uint8, device=self.device)
        if text:
            mine[: len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
        out = [torch.empty_like(mine) for _ in range(self.world_size)]
        self._wait(torch.distributed.all_gather(out, mine, group=self.group, async_op=True), "reporting the send")
        result: list[str | None] = []
        self.last_figures = []
        for t in out:
            raw = bytes(t.cpu().numpy())
            result.append(raw.rstrip(b"\0")[1:].decode(errors="replace") if raw.startswith(b"!") else None)
            self.last_figures.append(_figures(raw) if raw.startswith(b"=") else None)
        return result


    def gather_shares(self, shares: list[int] | None, count: int) -> list[list[int] | None]:
        """Every rank: its `count` installed-check digest shares (None: it could not fold them),
        gathered everywhere as int64 (`sync/installed.py`), rank order."""
        mine = torch.zeros(count + 1, dtype=torch.int64, device=self.device)
        if shares is not None and len(shares) == count:
            mine[0] = 1
            mine[1:] = torch.tensor(shares, dtype=torch.int64)
        out = [torch.empty_like(mine) for _ in range(self.world_size)]
        self._wait(torch.distributed.all_gather(out, mine, group=self.group, async_op=True), "gathering the installed-check shares")
        return [t[1:].cpu().tolist() if int(t[0]) == 1 else None for t in out]


def _figures(raw: bytes) -> dict[str, float] | None:
    """A rank's send figures from its status slot (one msgpack map after "=", then zero padding);
    None when unreadable (the figures only inform the report)."""
    unpacker = msgpack.Unpacker(raw=False, max_bin_len=0, max_ext_len=0)
    unpacker.feed(raw[1:])
    try:
        value = next(unpacker)
        return {str(k): float(v) for k, v in value.items()} if isinstance(value, dict) else None
    except Exception:
        return None
