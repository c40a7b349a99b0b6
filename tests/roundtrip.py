"""A deterministic mixed-dtype state dict and a rank function that sends or receives it."""

from __future__ import annotations

import time
from itertools import chain
from typing import Any

import torch

from ckpt_engine.engine import Rendezvous
from ckpt_engine.registry import CheckpointEngineRegistry
from ckpt_engine.sources.base import StateDictSource


def mixed_state(seed: int = 0, num_small: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sd: dict[str, torch.Tensor] = {
        "fp32": torch.randn(33, 17, generator=g),
        "bf16": torch.randn(1000, generator=g).bfloat16(),
        "fp16": torch.randn(7, 9, generator=g).half(),
        "int64": torch.randint(-(2**40), 2**40, (129,), generator=g),
        "bool": torch.rand(77, generator=g) > 0.5,
        "empty": torch.zeros(0, 5),
        "scalar": torch.tensor(3.25 + seed),
        "noncontig": torch.randn(40, 30, generator=g).t(),
        "big": torch.randn(70_000, generator=g),  # larger than the bucket: split into chunks
        "int8": torch.randint(-128, 127, (31,), generator=g, dtype=torch.int8),
    }
    if hasattr(torch, "float8_e4m3fn"):
        sd["fp8"] = (torch.randn(64, generator=g) * 4).to(torch.float8_e4m3fn)
    for i in range(num_small):
        sd[f"small.{i}"] = torch.randn(3, generator=g)
    return sd


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8).cpu(), b.contiguous().reshape(-1).view(torch.uint8).cpu()
    )


def roundtrip_rank(
    rank: int, rdzv: Rendezvous, *, device: str = "cpu", bucket_size: int = 64 * 1024, verify: bool = False,
    num_small: int = 0, syncs: int = 2, engine_kwargs: dict[str, Any] | None = None, destinations: bool = False,
    stable: bool = False, engine_timeout_s: float | None = None, late: tuple[int, float] | None = None,
) -> dict[str, Any]:
    """Rank 0 sends `syncs` different versions; receivers check every tensor bit for bit each time.
    `engine_timeout_s`: the engines' timeout (default: the rendezvous's); `late`: (rank, seconds)
    that rank waits before it joins.

    With `destinations`, every tensor that travels alone in its bucket(s) must land in its
    destination itself (no copy out of a buffer)."""
    # "cuda" spreads ranks over GPUs; "cpu" or an explicit "cuda:N" puts every rank there.
    dev = torch.device(f"cuda:{rank % torch.cuda.device_count()}" if device == "cuda" else device)
    engine = CheckpointEngineRegistry.new(
        rdzv.backend, bucket_size_bytes=bucket_size, verify=verify, device=dev,
        timeout_s=engine_timeout_s if engine_timeout_s is not None else rdzv.timeout_s, **(engine_kwargs or {}),
    )
    if late is not None and rank == late[0]:
        time.sleep(late[1])
    engine.init_process_group(rdzv, rank)
    bad: list[str] = []
    buffers = None
    landed_grouped = 0
    for version in range(syncs):
        sd = {k: v.to(dev) for k, v in mixed_state(version, num_small).items()}
        manifest = engine.plan(StateDictSource(sd).metadata())
        alone = {b.entries[0].name for b in manifest.buckets if len(b.entries) == 1 and b.nbytes}
        grouped = [b for b in manifest.buckets if engine.options.is_grouped(b, engine.transport)]
        in_groups = {e.name for b in grouped for e in b.entries if e.is_whole and e.chunk_size}
        if rank == 0:
            engine.send_weights(manifest, sd.items(), stable=stable)
        else:
            got = {}
            dst = {n: torch.zeros_like(t, memory_format=torch.contiguous_format) for n, t in sd.items()} if destinations else None
            for name, t in chain.from_iterable(engine.receive_buckets(manifest, dst)):
                if dst is not None and name in alone | in_groups and not verify and t.data_ptr() != dst[name].data_ptr():
                    bad.append(f"v{version} {name} travelled alone or grouped but did not land in its destination")
                landed_grouped += dst is not None and name in in_groups and t.data_ptr() == dst[name].data_ptr()
                got[name] = t.clone()
            bad += [f"v{version} {n}" for n in sd if n not in got or not same_bits(got[n], sd[n])]
        # Each sync reuses the buffers allocated at join time.
        ptrs = [b.data_ptr() for b in engine.transport.buffers]
        if buffers is not None and ptrs != buffers:
            bad.append(f"v{version}: buffers were reallocated")
        buffers = ptrs
    engine.finalize()
    return {"bad": bad, "tensors": len(sd), "alone": sorted(alone), "grouped": len(grouped), "landed_grouped": landed_grouped}
