"""The bench's `raw` references: the link's own speed for a sync's bytes, without a model-sized buffer.

`raw` once broadcast the whole model from one uint8 buffer of its size; beside the model's own
tensors that is twice the model (Qwen3-30B-A3B: a 57 GiB buffer beside 61 GB of weights, out of
memory on an 80 GB card). Here the same total bytes travel as back-to-back broadcasts of at most
`message` bytes through `slots` rotating message buffers, issued the same way and timed the same
way: at 1 GiB a message an NCCL broadcast is at its asymptotic speed, so the figure is the link's,
and the extra memory is `slots x message` whatever the model. Where the transport has no broadcast
(colocated: two processes share one device), `raw` is one device-to-device copy of the same bytes.
"""

from __future__ import annotations

import datetime
from collections import deque
from typing import Any

import torch

__all__ = [
    "RAW_MESSAGE_BYTES", "RAW_SLOTS", "broadcast_bytes", "copy_bytes", "raw_meaning", "raw_message_bytes",
]

RAW_MESSAGE_BYTES = 1 << 30
"""The largest raw message (1 GiB): the link's asymptotic speed, a bounded buffer."""
RAW_SLOTS = 2
"""Message buffers in flight: the next message is issued while the previous one travels."""


def raw_message_bytes(total_bytes: int, bucket_bytes: int) -> int:
    """Raw's message size: 1 GiB or the bucket, whichever is larger, never more than the total."""
    return max(1, min(total_bytes, max(RAW_MESSAGE_BYTES, bucket_bytes)))


def raw_meaning(message_bytes: int, total_bytes: int, colocated: bool) -> str:
    """What `raw` measured, for the JSON and the table."""
    if colocated:
        return (
            f"one device-to-device copy of the same {total_bytes} bytes on the shared device, in copies of at most "
            f"{message_bytes} bytes (no broadcast exists between colocated processes)"
        )
    count = -(-total_bytes // message_bytes) if total_bytes else 0
    if count <= 1:
        return f"the same {total_bytes} bytes as one broadcast from a uint8 buffer over the same process group"
    return (
        f"the same {total_bytes} bytes as {count} back-to-back broadcasts of at most {message_bytes} bytes from "
        f"{RAW_SLOTS} rotating uint8 buffers over the same process group (no packing, no loading)"
    )


def _messages(total_bytes: int, message_bytes: int, slots: int, device: torch.device) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """A buffer of `slots` messages (or the total, if smaller) and each message's (slot offset, size)."""
    span = min(total_bytes, slots * message_bytes)
    buf = torch.zeros(span, dtype=torch.uint8, device=device)  # touched: its memory is really taken
    plan, offset, i = [], 0, 0
    while offset < total_bytes:
        n = min(message_bytes, total_bytes - offset)
        plan.append(((i % slots) * message_bytes, n))
        offset += n
        i += 1
    return buf, plan


class BroadcastBytes:
    """`total_bytes` broadcast from rank 0 of each of `groups` (at once, message by message in
    turn) as messages of at most `message_bytes`, at most `slots` in flight per group: a slot is
    reused only after the broadcast that used it finished (on NCCL that wait orders streams; it
    does not block the host)."""

    def __init__(self, groups: list[Any], total_bytes: int, message_bytes: int, device: torch.device, timeout_s: float, slots: int = RAW_SLOTS) -> None:
        self.groups, self.slots = groups, slots
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.cpu = device.type == "cpu"
        self.bufs = [_messages(total_bytes, message_bytes, slots, device) for _ in groups]

    def _wait(self, work: Any) -> None:
        if self.cpu:
            work.wait(self.timeout)
        else:
            work.wait()

    def __call__(self) -> None:
        works: list[deque[Any]] = [deque() for _ in self.groups]
        for i in range(max((len(plan) for _, plan in self.bufs), default=0)):
            for g, (group, (buf, plan)) in enumerate(zip(self.groups, self.bufs)):
                if i >= len(plan):
                    continue
                if len(works[g]) >= self.slots:
                    self._wait(works[g].popleft())
                offset, n = plan[i]
                works[g].append(group.broadcast(buf[offset : offset + n], 0))
        for pending in works:
            while pending:
                self._wait(pending.popleft())


def broadcast_bytes(
    group: Any | list[Any], total_bytes: int, message_bytes: int, device: torch.device, timeout_s: float, slots: int = RAW_SLOTS,
) -> BroadcastBytes:
    """The callable a rank times for `raw` (or `bucketed`, with the bucket as the message); with a
    list of groups, `total_bytes` from each of them at once."""
    groups = group if isinstance(group, list) else [group]
    return BroadcastBytes(groups, total_bytes, message_bytes, device, timeout_s, slots)


def copy_bytes(total_bytes: int, message_bytes: int, device: torch.device) -> Any:
    """The callable rank 0 times for a colocated `raw`: `total_bytes` copied device to device,
    from one message-sized buffer into another (2 x message of extra memory, not 2 x the model)."""
    span = min(total_bytes, message_bytes)
    src = torch.ones(span, dtype=torch.uint8, device=device)
    dst = torch.zeros(span, dtype=torch.uint8, device=device)
    sizes = [min(message_bytes, total_bytes - off) for off in range(0, total_bytes, message_bytes)]

    def run() -> None:
        for n in sizes:
            dst[:n].copy_(src[:n])

    return run
