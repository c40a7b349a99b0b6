"""Installed-weight checks catch a race between a copy stream and the compute stream on CUDA (issue 42
item 5): a receiver copies each bucket into the engine's parameters on a copy stream of its own; if
the compute stream (the engine's forward) does not wait for that copy, or the receive buffer is
refilled before the copy read it, the engine serves bytes the sync never sent, and the wire's
checksums (taken before the copy) cannot see it.

Each race is played in its losing order, forced by CUDA events (no sleeps, no timing): the order the
missing wait permits, made certain. The check runs as the engine's forward would, on the compute
stream: the trainer's digests of the source (`InstalledChecks.tap` over the walk) against the
engine rank's digests of its parameters (`ckpt_engine/installed.py`). With the waits in place the
same syncs pass. Each case 3 times.

Self-contained (torch and ckpt_engine only, no vLLM). Run on a machine with one CUDA GPU:

    .venv/bin/python -m pytest -m gpu tests/test_gpu_installed_race.py -q
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Iterator

import pytest
import torch

from ckpt_engine.installed import InstalledReport, InstalledRequest
from ckpt_engine.installed_held import digest_held
from ckpt_engine.rollout_adapters.capabilities import EngineCapabilities
from ckpt_engine.sync.installed import InstalledChecks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

REPEAT = 3
SHAPES = {"embed.weight": (4096, 1024), "layer.qkv.weight": (3072, 1024), "layer.norm.weight": (1024,)}


class CudaRank:
    """One engine rank holding parameters on the GPU: it digests them on the compute stream, the
    stream its forward runs on (the installed-weight seam of `RolloutAdapter`)."""

    capabilities = EngineCapabilities(installed=True)

    def __init__(self, name: str, params: dict[str, torch.Tensor], compute: torch.cuda.Stream) -> None:
        self.name, self.params, self.compute = name, params, compute
        self.read_early: InstalledReport | None = None
        """The digests the compute stream took before the copies landed (the "compute" race)."""

    def installed_digests(self, request: InstalledRequest) -> list[InstalledReport]:
        if self.read_early is not None:
            return [self.read_early]
        with torch.cuda.stream(self.compute):
            report = digest_held(self.params, {}, request)
        return [report]


def source(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g).bfloat16() for n, s in SHAPES.items()}


def receive(params: dict[str, torch.Tensor], weights: Iterator[tuple[str, torch.Tensor]], copy: torch.cuda.Stream,
            compute: torch.cuda.Stream, race: str | None) -> None:
    """Each tensor arrives in one device receive buffer (the wire), is copied into its parameter on
    the copy stream, and the buffer is refilled with the next tensor. `race`:
    - None: the copy waits for the buffer's fill, the refill waits for the copy, the compute stream
      waits for the last copy (what a correct receiver does);
    - "refill": the next tensor is written into the buffer before the copy read it;
    - "compute": the compute stream reads the parameters before the copies landed."""
    items = list(weights)
    buffer = torch.empty(max(t.numel() for _, t in items), dtype=torch.bfloat16, device="cuda")
    fill = torch.cuda.current_stream()
    copied = torch.cuda.Event()
    for i, (name, t) in enumerate(items):
        view = buffer[: t.numel()].view(t.shape)
        if race is None:
            fill.wait_event(copied)  # the refill waits for the previous copy
        view.copy_(t, non_blocking=False)
        filled = torch.cuda.Event()
        filled.record(fill)
        if race == "refill":
            # losing order: the refill with the next tensor lands before this copy reads the buffer
            nxt = items[(i + 1) % len(items)][1]
            k = min(nxt.numel(), t.numel())
            buffer[:k].copy_(nxt.reshape(-1)[:k])
            filled.record(fill)
        copy.wait_event(filled)
        with torch.cuda.stream(copy):
            params[name].copy_(view)
        copied.record(copy)
    if race == "compute":
        # losing order: the copy stream is held until the compute stream has read every parameter
        return
    compute.wait_event(copied)


@pytest.mark.parametrize("rep", range(REPEAT))
@pytest.mark.parametrize("race", [None, "refill", "compute"])
def test_a_copy_stream_race_is_caught_by_the_installed_check(race: str | None, rep: int) -> None:
    copy, compute = torch.cuda.Stream(), torch.cuda.Stream()
    old = source(1000 + rep)
    params = {n: t.cuda() for n, t in old.items()}
    torch.cuda.synchronize()
    rank = CudaRank("gpu-engine", params, compute)
    checks = InstalledChecks(1, 4096, "warn")
    new = source(rep)
    checks.arm([rank], list(new), [None], 1)  # type: ignore[list-item]
    walked = checks.tap(iter(new.items()))
    if race == "compute":
        # the check, enqueued on the compute stream as the forward is, reads before the copies land:
        # the copy stream waits for the event recorded after that read
        request = checks.request
        assert request is not None
        rank.read_early = rank.installed_digests(request)[0]
        held = torch.cuda.Event()
        held.record(compute)
        copy.wait_event(held)
    receive(params, walked, copy, compute, race)
    with cf.ThreadPoolExecutor(1) as pool:
        failed = checks.verify(pool, [rank], 60.0)  # type: ignore[list-item]
    torch.cuda.synchronize()
    if race is None:
        assert failed == {}, failed
        assert all(torch.equal(params[n].cpu(), new[n]) for n in new)
    else:
        assert set(failed) == {"gpu-engine"}, failed
        assert "differ from the source" in failed["gpu-engine"], failed
        assert any(name in failed["gpu-engine"] for name in SHAPES), failed
