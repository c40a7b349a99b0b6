"""The generation side: a small Generator interface and the workers that keep engines busy.

A `Generator` answers prompts with actions and the weight version that produced them, or None
while its engine is not serving a complete version (paused, stale, or never synced), so no
sample is ever tagged with a version its engine did not hold completely. A vLLM generator plugs
in by implementing `generate` on top of the engine's own API; workers and the trainer loop do not
change.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import Protocol

import torch

from ckpt_engine.rollout_adapters.torch_ref import TorchRefRollout
from ckpt_engine.trainer.task import ModularTask, policy_logits

__all__ = ["Generation", "Generator", "RolloutWorker", "SampleChunk", "TorchRefPolicyGenerator"]

logger = logging.getLogger(__name__)


@dataclass
class Generation:
    actions: torch.Tensor
    version: int
    """The oldest weight version that produced any of these actions (staleness counts from it)."""
    spans: list[list[tuple[int, int]]] | None = None
    """Per sample, (version, index of its first token) for each version that produced its tokens
    (engines that swap between two steps can change version inside a request); None: all `version`."""


class Generator(Protocol):
    name: str

    def generate(self, prompts: torch.Tensor) -> Generation | None:
        """Actions for `prompts` from one complete weight version, or None if not serving now."""
        ...

    def close(self) -> None: ...


@dataclass
class SampleChunk:
    """Samples of one request: all made by `engine` holding weight `version`."""

    prompts: torch.Tensor
    actions: torch.Tensor
    rewards: torch.Tensor
    version: int
    engine: str


class TorchRefPolicyGenerator:
    """Samples the tiny policy with the weights a reference receiver holds.

    Weights are read only while the engine reports the same complete version before and after
    the read (not paused, not stale), so a read racing a sync is discarded, never mixed.
    """

    def __init__(self, name: str, host: str, port: int, timeout_s: float = 10.0, seed: int = 0, *, token: str) -> None:
        self.name = name
        self._engine = TorchRefRollout(name, host, port, None, timeout_s, token=token)  # the engine's job token
        self._weights: dict[str, torch.Tensor] | None = None
        self._version: int | None = None
        self._rng = torch.Generator().manual_seed(seed)

    def _serving_version(self) -> int | None:
        h = self._engine.health()
        return None if h["paused"] or h["stale"] or h["version"] is None else int(h["version"])

    def generate(self, prompts: torch.Tensor) -> Generation | None:
        version = self._serving_version()
        if version is None:
            return None
        if version != self._version:
            weights = {n: self._engine.get_tensor(n) for n in ("policy.weight", "policy.bias")}
            if self._serving_version() != version:
                return None  # a sync started while reading
            self._weights, self._version = weights, version
        assert self._weights is not None
        probs = torch.softmax(policy_logits(self._weights, prompts), dim=-1)
        return Generation(torch.multinomial(probs, 1, generator=self._rng).squeeze(1), version)

    def greedy(self, prompts: torch.Tensor) -> torch.Tensor | None:
        """Greedy answers from the engine's current weights (for the demo's before/after summary)."""
        gen = self.generate(prompts[:1])
        if gen is None or self._weights is None:
            return None
        return policy_logits(self._weights, prompts).argmax(dim=-1)

    def close(self) -> None:
        self._engine.close()


class RolloutWorker:
    """One thread per engine: generate continuously into the shared queue, tagged with versions."""

    def __init__(self, generator: Generator, task: ModularTask, out: queue.Queue[SampleChunk], samples_per_request: int, seed: int) -> None:
        self.generator, self.task, self.out = generator, task, out
        self.samples_per_request = samples_per_request
        self._rng = torch.Generator().manual_seed(seed)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"rollout-{generator.name}", daemon=True)
        self.generated = 0
        self.idle_polls = 0
        self.last_error: str | None = None

    def start(self) -> RolloutWorker:
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.is_set():
            prompts = self.task.prompts(self.samples_per_request, self._rng)
            try:
                gen = self.generator.generate(prompts)
            except Exception as exc:  # the engine may be restarting; keep trying, report the error
                self.last_error = f"{type(exc).__name__}: {exc}"
                self._stop.wait(0.2)
                continue
            if gen is None:
                self.idle_polls += 1
                self._stop.wait(0.02)
                continue
            chunk = SampleChunk(prompts, gen.actions, self.task.reward(prompts, gen.actions), gen.version, self.generator.name)
            while not self._stop.is_set():
                try:
                    self.out.put(chunk, timeout=0.2)
                    self.generated += len(prompts)
                    break
                except queue.Full:
                    continue

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("rollout worker %s did not stop within %.0fs", self.generator.name, timeout_s)
