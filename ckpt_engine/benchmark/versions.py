"""Real consecutive weight versions for `ckpt-engine bench --delta`, in bounded memory.

An RL trainer keeps fp32 masters and exports bf16; the delta bench needs several such versions.
Holding masters, gradients and two Adam moments of a 7B-shaped model at once takes ~16 bytes per
parameter, more than a small host has. AdamW is elementwise, so stepping each chunk of a tensor
with its own AdamW is exactly AdamW on the whole tensor: versions are generated chunk by chunk
with at most `chunk_bytes` of fp32 state alive, and only the wire-dtype versions are kept, in
memory when they fit beside the sync's own copies, else in safetensors files of a temporary
directory (removed on close or at exit).
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ckpt_engine.sources.wire import torch_dtype
from ckpt_engine.manifest import TensorSpec

__all__ = ["AdamWChain", "FileVersions", "MemoryVersions", "element_chunks", "host_available_bytes"]

logger = logging.getLogger(__name__)

FP32_STATE_BYTES = 16
"""Per element while a chunk steps: master, gradient, exp_avg, exp_avg_sq (fp32 each)."""
CHUNK_ALIGN = 256
"""Chunk boundaries fall on multiples of this many elements, so vectorised kernels split every
chunk where they would split the whole tensor (their scalar tails land on the same elements)."""

Sink = Callable[[int, int, int, torch.Tensor], None]
"""sink(version, tensor index, element offset, flat wire-dtype chunk)."""


def element_chunks(numel: int, max_elems: int) -> list[tuple[int, int]]:
    """[start, stop) element ranges covering `numel`, each at most `max_elems` (rounded down to
    CHUNK_ALIGN, at least CHUNK_ALIGN), every start a multiple of CHUNK_ALIGN."""
    if max_elems < 1:
        raise ValueError(f"max_elems must be >= 1, got {max_elems}")
    size = max(CHUNK_ALIGN, max_elems // CHUNK_ALIGN * CHUNK_ALIGN)
    return [(s, min(s + size, numel)) for s in range(0, numel, size)]


def _seed(*key: object) -> int:
    """A stable 63-bit seed for a key (Python's hash() of strings changes per process)."""
    return int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=8).digest(), "little") >> 1


@dataclass(frozen=True)
class AdamWChain:
    """fp32 masters (std `init_std` for matrices, ones for 1-D norms) stepped by torch's AdamW
    with Gaussian gradients of scale `grad_scale`; version 1 is the state after `warmup_steps`,
    version k after k - 1 more steps. Every random draw is keyed by (seed, tensor, chunk, step),
    so senders generating the same specs get the same versions."""

    lr: float
    grad_scale: float = 1e-3
    warmup_steps: int = 2
    seed: int = 1234
    init_std: float = 0.02
    chunk_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        if not self.lr > 0 or not self.grad_scale > 0 or self.warmup_steps < 0 or self.chunk_bytes < FP32_STATE_BYTES:
            raise ValueError(f"bad AdamWChain settings: {self}")

    def chunks(self, spec: TensorSpec) -> list[tuple[int, int]]:
        return element_chunks(math.prod(spec.shape), self.chunk_bytes // FP32_STATE_BYTES)

    def _generator(self, device: torch.device, *key: object) -> torch.Generator:
        return torch.Generator(device=device).manual_seed(_seed(self.seed, *key))

    def initial(self, index: int, spec: TensorSpec, start: int, stop: int, device: torch.device) -> torch.Tensor:
        if len(spec.shape) == 1:
            return torch.ones(stop - start, device=device)
        g = self._generator(device, "init", index, start)
        return torch.randn(stop - start, generator=g, device=device) * self.init_std

    def gradient(self, index: int, start: int, stop: int, step: int, device: torch.device) -> torch.Tensor:
        g = self._generator(device, "grad", index, start, step)
        return torch.randn(stop - start, generator=g, device=device) * self.grad_scale

    def generate(self, specs: Sequence[TensorSpec], count: int, device: torch.device, sink: Sink) -> None:
        """Versions 1..count of every tensor, chunk by chunk, each handed to `sink` as wire dtype."""
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        for i, spec in enumerate(specs):
            wire = torch_dtype(spec.dtype)
            for start, stop in self.chunks(spec):
                master = self.initial(i, spec, start, stop, device).requires_grad_(True)
                opt = torch.optim.AdamW([master], lr=self.lr, weight_decay=0.0, foreach=False)
                for step in range(self.warmup_steps + count - 1):
                    if step >= self.warmup_steps:
                        sink(step - self.warmup_steps + 1, i, start, master.detach().to(wire))
                    master.grad = self.gradient(i, start, stop, step, device)
                    opt.step()
                    master.grad = None
                sink(count, i, start, master.detach().to(wire))
                del master, opt


class MemoryVersions:
    """Every version as full tensors on one device (`targets[v - 1]` may be given, e.g. the
    sender's own tensors when there is a single version)."""

    def __init__(self, specs: Sequence[TensorSpec], count: int, device: torch.device, targets: list[list[torch.Tensor]] | None = None) -> None:
        self.versions = targets if targets is not None else [
            [torch.empty(s.shape, dtype=torch_dtype(s.dtype), device=device) for s in specs] for _ in range(count)
        ]

    def sink(self, version: int, index: int, start: int, chunk: torch.Tensor) -> None:
        self.versions[version - 1][index].view(-1)[start : start + chunk.numel()].copy_(chunk)

    def load(self, version: int, out: Sequence[torch.Tensor]) -> None:
        for dst, src in zip(out, self.versions[version - 1]):
            if dst is not src:
                dst.copy_(src)

    def close(self) -> None:
        self.versions = []


class FileVersions:
    """Every version in safetensors files (one per chunk) in a temporary directory, read back
    with safe_open chunk by chunk, so neither writing nor loading holds more than one chunk."""

    def __init__(self, specs: Sequence[TensorSpec], chain: AdamWChain, directory: str | None = None) -> None:
        self.chunks = [chain.chunks(s) for s in specs]
        self._tmp = tempfile.TemporaryDirectory(prefix="ckpt-bench-versions-", dir=directory)
        self.path = self._tmp.name

    def _file(self, version: int, index: int, start: int) -> str:
        return os.path.join(self.path, f"v{version}_t{index}_{start}.safetensors")

    def sink(self, version: int, index: int, start: int, chunk: torch.Tensor) -> None:
        save_file({"w": chunk.cpu().contiguous()}, self._file(version, index, start))

    def load(self, version: int, out: Sequence[torch.Tensor]) -> None:
        for index, dst in enumerate(out):
            flat = dst.view(-1)
            for start, stop in self.chunks[index]:
                with safe_open(self._file(version, index, start), framework="pt") as f:
                    flat[start:stop].copy_(f.get_tensor("w"))

    def close(self) -> None:
        self._tmp.cleanup()


def host_available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
