"""nccl: the pipelined broadcast between CUDA devices.

Packing runs on the caller's current stream (where the weights were produced), the broadcast on a
side stream per group; events order the two per rotating buffer, so the host never waits on the
device except for the last bucket (and, in a delta sync, for frame headers).
"""

from __future__ import annotations

import datetime
from contextlib import AbstractContextManager
from typing import Any

import torch

from ckpt_engine.transports.collectives import coalesced_broadcast
from ckpt_engine.transports.process_groups import ProcessGroupTransport
from ckpt_engine.transports.transport import Frames

__all__ = ["NcclTransport", "StreamFrames", "StreamTransport"]


class StreamTransport(ProcessGroupTransport):
    """Device process groups whose work is ordered by streams and events (nccl, hccl): per slot a
    "ready" and a "free" event, per group a side stream."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._streams: dict[int, Any] = {}
        self._ready: list[Any] = []
        self._free: list[Any] = []
        self._frames = StreamFrames(self)

    @property
    def frames(self) -> Frames | None:
        return self._frames

    # --- what a device family provides -----------------------------------------------------------
    def new_stream(self) -> Any:
        raise NotImplementedError

    def stream_ctx(self, stream: Any) -> Any:
        raise NotImplementedError

    # --- slots and groups ------------------------------------------------------------------------
    def on_new_slot(self) -> None:
        self._ready.append(self.new_event())
        self._free.append(self.new_event())

    def on_new_group(self, gid: int) -> None:
        self._streams[gid] = self.new_stream()

    def join_groups(self, store: torch.distributed.Store, own: list[int]) -> None:
        self._streams = {}
        super().join_groups(store, own)

    @property
    def uses_streams(self) -> bool:
        return bool(self._streams)

    def clear_slots(self) -> None:
        super().clear_slots()
        self._ready, self._free = [], []

    def close(self) -> None:
        super().close()
        self._streams, self._ready, self._free = {}, [], []

    def wait_work(self, work: Any, what: str) -> None:
        try:
            work.wait()
        except Exception as exc:
            raise self._failed(what, exc) from exc

    # --- slotted messages ------------------------------------------------------------------------
    def wait_slot(self, slot: int, works: list[Any]) -> None:
        self.current_stream().wait_event(self._free[slot])

    def post(self, gid: int, slot: int, msg: torch.Tensor) -> Any:
        stream = self._streams[gid]
        if self.is_sender:
            self._ready[slot].record(self.current_stream())
        with self.stream_ctx(stream):
            stream.wait_event(self._ready[slot] if self.is_sender else self._free[slot])
            work = self._groups[gid].broadcast(msg, 0)
            work.wait()
            (self._free[slot] if self.is_sender else self._ready[slot]).record(stream)
        return work

    def post_group(self, gid: int, slot: int, msgs: list[torch.Tensor]) -> Any:
        group, stream = self._groups[gid], self._streams[gid]
        if self.is_sender:
            self._ready[slot].record(self.current_stream())
        with self.stream_ctx(stream):
            stream.wait_event(self._ready[slot] if self.is_sender else self._free[slot])
            work = coalesced_broadcast(group, msgs)
            (self._free[slot] if self.is_sender else self._ready[slot]).record(stream)
        return work

    def finish(self, k: int, sender: int, slot: int, work: Any, label: str) -> None:
        self.current_stream().wait_event(self._ready[slot])

    def release(self, slot: int) -> None:
        self._free[slot].record(self.current_stream())

    def drain_slots(self, works: list[Any]) -> None:
        for i, ev in enumerate(self._free[: self.num_buffers]):
            self.wait_event(ev, f"broadcast from buffer {i}")

    def wait_compute(self, what: str) -> None:
        if not self._streams:  # a hand-off receiver of local senders only: nothing queued here
            return
        done = self.new_event()
        done.record(self.current_stream())
        self.wait_event(done, what)


class StreamFrames(Frames):
    """Delta frames on a streamed transport's groups: each group's side stream carries its frames
    in order; the host waits on an event where it reads a header."""

    def __init__(self, transport: StreamTransport) -> None:
        self.t = transport

    def post(self, gid: int, msg: torch.Tensor, *, after_producer: bool = True) -> Any:
        t, stream = self.t, self.t._streams[gid]
        producer = t.current_stream()  # read before the context makes `stream` the current one
        with t.stream_ctx(stream):
            if after_producer:
                stream.wait_stream(producer)
            work = t.groups[gid].broadcast(msg, 0)
            work.wait()
        return work

    def fresh(self, gid: int, size: int, dtype: torch.dtype = torch.uint8, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """A receive buffer from group `gid`'s stream's memory pool (its earlier users were on that
        stream, so it may be written there at once), also recorded for the compute stream, which
        reads it after it lands (the allocator then waits for those reads before reusing it)."""
        compute = self.t.current_stream()
        with self.t.stream_ctx(self.t._streams[gid]):
            out = torch.empty(shape if shape is not None else (size,), dtype=dtype, device=self.t.device)
        out.record_stream(compute)
        return out

    def settle(self, gid: int, work: Any, what: str) -> None:
        self.t.wait_event(self.landed_event(gid), what)

    def drain(self, works: list[Any], what: str) -> None:
        for gid in self.t._streams:
            self.t.wait_event(self.landed_event(gid), f"{what} on group {gid}")

    def landed_event(self, gid: int) -> Any:
        ev = self.t.new_event()
        ev.record(self.t._streams[gid])
        return ev

    def wait_landed(self, event: Any) -> None:
        self.t.current_stream().wait_event(event)

    def reading(self, gid: int) -> AbstractContextManager[None]:
        return self.t.stream_ctx(self.t._streams[gid])


class NcclTransport(StreamTransport):
    """CUDA process groups on high-priority streams: the block scheduler starts a bucket's
    collective ahead of pending blocks of other kernels, since in fully-async RL the trainer keeps
    computing while it syncs (in the stand-alone bench, where only our own copies compete, normal
    priority made no measurable difference, so there is no switch: bench/RESULTS.md)."""

    name = "nccl"
    device_type = "cuda"
    # An NCCL shutdown finalizes the communicator with its peers: a vLLM worker leaving (inside a
    # `collective_rpc` the trainer waits on) hung there until the trainer's own side closed, which
    # only came after that leave. Nothing is in flight at a leave, so an abort loses nothing.
    abort_on_close = True
    # A bucket of a few large tensors goes as one coalesced group of per-tensor broadcasts (no pack
    # or unpack copy; 0.99 of a raw broadcast on 2xH200 in bench/nccl_coalesced_probe.py); buckets
    # of many small tensors (MoE experts) are packed: per-message cost would dominate there.
    default_group_max_tensors = 64

    @classmethod
    def resolve_device(cls, device: str | int | torch.device | None) -> torch.device:
        if not torch.cuda.is_available():
            raise ValueError("the nccl backend needs CUDA, and torch sees no CUDA device here (use gloo on CPU)")
        dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        if dev.type != "cuda":
            raise ValueError(f"the nccl backend moves CUDA tensors; got device={device!r}")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(dev)
        return dev

    def make_group(self, store: torch.distributed.Store, rank: int, world_size: int) -> Any:
        opts = torch.distributed.ProcessGroupNCCL.Options()
        opts._timeout = datetime.timedelta(seconds=self.timeout_s)
        opts.is_high_priority_stream = True
        return torch.distributed.ProcessGroupNCCL(store, rank, world_size, opts)

    def new_stream(self) -> Any:
        # torch maps a priority below the device's range to its highest one.
        return torch.cuda.Stream(device=self.device, priority=-8)

    def new_event(self) -> Any:
        return torch.cuda.Event()

    def current_stream(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def stream_ctx(self, stream: Any) -> Any:
        return torch.cuda.stream(stream)

