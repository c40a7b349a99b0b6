"""Memory of each bench mode: measured on this run, and planned for the full model.

A bench that runs out of memory on the card it is meant for measures nothing, so every mode
reports the extra memory it took on each rank beyond what the rank held when the mode began
(CUDA: the allocator's peak; CPU: the process's peak resident set, reset per mode through
`/proc/self/clear_refs`), and the driver prints, from the shapes alone, what the full model needs
per rank: its weights, plus the engine's buffers, plus the largest mode's extra.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ckpt_engine.benchmark.raw_link import RAW_SLOTS

__all__ = ["MemoryPlan", "PeakMeter", "memory_plan", "resident_bytes"]

_STATUS = "/proc/self/status"


def _status_bytes(key: str) -> int | None:
    try:
        with open(_STATUS) as f:
            m = re.search(rf"^{key}:\s+(\d+) kB", f.read(), re.MULTILINE)
    except OSError:
        return None
    return int(m.group(1)) * 1024 if m else None


def resident_bytes() -> int | None:
    """This process's resident set now (Linux), None elsewhere."""
    return _status_bytes("VmRSS")


class PeakMeter:
    """The peak extra memory of one stretch of work on this rank's device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.start = 0
        self.cpu_reset = False

    def begin(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()  # a mode's freed buffers are not kept for the next one
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start = torch.cuda.memory_allocated(self.device)
            return
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset the peak resident set to the current one (Linux >= 4.0)
            self.cpu_reset = True
        except OSError:
            self.cpu_reset = False
        self.start = resident_bytes() or 0

    def extra(self) -> int | None:
        """Bytes above the start at the peak; None where this host cannot tell."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return max(0, torch.cuda.max_memory_allocated(self.device) - self.start)
        peak = _status_bytes("VmHWM")
        if not self.cpu_reset or peak is None:
            return None
        return max(0, peak - self.start)


@dataclass(frozen=True)
class MemoryPlan:
    """Memory per device of a bench run from the shapes: the weights of every rank on it (two when
    colocated: sender and receiver share one device), the engine's buffers (colocated: shared by
    both), and each mode's extra (modes run one after another; each frees its own)."""

    weights: int
    buffers: int
    modes: dict[str, int]
    ranks_per_device: int = 1

    @property
    def peak(self) -> int:
        return self.ranks_per_device * self.weights + self.buffers + max(self.modes.values(), default=0)

    def to_dict(self) -> dict[str, int]:
        return {
            "weights": self.weights, "ranks_per_device": self.ranks_per_device, "buffers": self.buffers,
            **{f"{m}_extra": v for m, v in self.modes.items()}, "peak": self.peak,
        }


def memory_plan(
    total_bytes: int, largest_tensor: int, bucket_bytes: int, num_buffers: int, raw_message: int, modes: list[str],
    *, colocated: bool = False, in_place: bool = False,
) -> MemoryPlan:
    """The busiest device's memory per mode, from the shapes alone.

    raw: `RAW_SLOTS` messages (colocated: one source and one destination message); bucketed:
    `RAW_SLOTS` buckets; naive: nothing (it broadcasts into the tensors); ours: the buffers, plus,
    on a receiver copying out, the tensors split over buckets being reassembled (measured on
    2xH200, 7B, 1 GiB buckets: two of the largest, 2,079 MiB)."""
    extra = {
        "raw": min(total_bytes, raw_message) * 2 if colocated else min(total_bytes, RAW_SLOTS * raw_message),
        "bucketed": min(total_bytes, RAW_SLOTS * bucket_bytes),
        "naive": 0,
        "ours": 0 if in_place else min(total_bytes, 2 * largest_tensor),
    }
    return MemoryPlan(total_bytes, num_buffers * bucket_bytes, {m: extra[m] for m in modes if m in extra}, 2 if colocated else 1)
