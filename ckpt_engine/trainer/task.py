"""A verifiable synthetic task and the tiny policy that learns it.

Prompt: a token x in [0, V). Correct answer: (a*x + b) mod V for fixed a, b, so a reward is checked
exactly, with no reward model. The policy is one linear layer over the one-hot prompt
(`policy.weight` [V, V], `policy.bias` [V]); what matters is the loop, the versions and the sync,
and a task this small shows learning within a few dozen steps on CPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from ckpt_engine.manifest import TensorSpec
from ckpt_engine.sources.base import WeightSource, spec_of
from ckpt_engine.trainer.engines.base import LossFn, TrainEngine

__all__ = ["ModularTask", "ModuleSource", "TinyPolicy", "TinyTrainEngine", "pg_loss"]


class ModularTask:
    def __init__(self, vocab_size: int, a: int = 5, b: int = 3) -> None:
        self.vocab_size, self.a, self.b = vocab_size, a, b

    def prompts(self, n: int, generator: torch.Generator) -> torch.Tensor:
        return torch.randint(0, self.vocab_size, (n,), generator=generator)

    def answer(self, prompts: torch.Tensor) -> torch.Tensor:
        return (self.a * prompts + self.b) % self.vocab_size

    def reward(self, prompts: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        return (actions == self.answer(prompts)).float()

    def to_batch(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Samples (prompts, actions, rewards) -> what the TrainEngine consumes; the tiny policy takes them as is."""
        return batch

    def loss_fn(self, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return pg_loss(logits, batch)


class TinyPolicy(torch.nn.Module):
    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.policy = torch.nn.Linear(vocab_size, vocab_size)

    def forward(self, prompts: torch.Tensor) -> torch.Tensor:
        return self.policy(torch.nn.functional.one_hot(prompts, self.vocab_size).float())


def policy_logits(weights: dict[str, torch.Tensor], prompts: torch.Tensor) -> torch.Tensor:
    """The policy's forward from a plain weight dict (what a rollout engine holds)."""
    return weights["policy.weight"][:, prompts].t() + weights["policy.bias"]


def pg_loss(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """REINFORCE with a batch-mean baseline; importance-free (staleness is bounded instead)."""
    logp = torch.log_softmax(logits, dim=-1).gather(1, batch["actions"][:, None]).squeeze(1)
    advantage = batch["rewards"] - batch["rewards"].mean()
    return -(advantage * logp).mean()


class ModuleSource(WeightSource):
    """A one-process module's live state dict, read afresh on every walk."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def metadata(self) -> list[TensorSpec]:
        return [spec_of(n, t) for n, t in self.model.state_dict().items()]

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from ((n, t.detach()) for n, t in self.model.state_dict().items())


class TinyTrainEngine(TrainEngine):
    """A single-process TrainEngine over TinyPolicy; the reference for the loop's contract."""

    def __init__(self, vocab_size: int, lr: float = 0.05, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = TinyPolicy(vocab_size)
        self.source = ModuleSource(self.model)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=lr)
        self.step = 0

    def forward_backward(self, batch: dict[str, torch.Tensor], loss_fn: LossFn) -> dict[str, float]:
        loss = loss_fn(self.model(batch["prompts"]), batch)
        loss.backward()
        return {"loss": float(loss.detach())}

    def optimizer_step(self) -> float:
        norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), 10.0))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return norm

    def train_mode(self) -> None:
        self.model.train()

    def eval_mode(self) -> None:
        self.model.eval()

    def save_checkpoint(self, path: str) -> None:
        torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "step": self.step}, path)

    def load_checkpoint(self, path: str) -> None:
        state: dict[str, Any] = torch.load(path, weights_only=True)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])
