"""The synthetic verifiable task posed to a causal LM in token ids (the vLLM + FSDP2 demo's task).

Same rule as `ModularTask` (answer = (a*x + b) mod V), spelled in tokens so a real engine can
serve it without a tokenizer: the prompt for x is `[PREFIX, PROMPT_BASE + x]` and the answer y is
the single token `ANSWER_BASE + y`. The engine samples only among the V answer tokens
(`allowed_token_ids`), and the loss takes the log-probability of the sampled answer among those
same V tokens, so the policy the trainer optimises is exactly the one the engine samples from.
The ids stay clear of 0-2 (pad/bos/eos in the tiny Qwen2 config).
"""

from __future__ import annotations

import torch

from ckpt_engine.trainer.task import ModularTask

__all__ = ["TokenTask", "lm_pg_loss"]

PREFIX = 3
PROMPT_BASE = 16


class TokenTask(ModularTask):
    """ModularTask over token ids: prompt/answer spelling, batch layout and loss for a causal LM."""

    def __init__(self, vocab_size: int, a: int = 5, b: int = 3, group_size: int = 4) -> None:
        super().__init__(vocab_size, a, b)
        self.answer_base = PROMPT_BASE + vocab_size
        self.group_size = group_size

    def prompts(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """`n` prompts in groups of `group_size` equal ones: one engine request samples a whole group
        (`n` choices), so a request costs one round trip and the group shares one weight version."""
        distinct = torch.randint(0, self.vocab_size, (-(-n // self.group_size),), generator=generator)
        return distinct.repeat_interleave(self.group_size)[:n]

    def min_model_vocab(self) -> int:
        """The smallest LM vocabulary that holds every prompt and answer token."""
        return self.answer_base + self.vocab_size

    def prompt_ids(self, x: int) -> list[int]:
        return [PREFIX, PROMPT_BASE + int(x)]

    def answer_token_ids(self) -> list[int]:
        return list(range(self.answer_base, self.answer_base + self.vocab_size))

    def token_to_answer(self, token: int) -> int:
        """The answer a sampled token stands for (the engine only samples allowed tokens)."""
        y = int(token) - self.answer_base
        if not 0 <= y < self.vocab_size:
            raise ValueError(f"token {token} is not an answer token (allowed {self.answer_base}..{self.answer_base + self.vocab_size - 1})")
        return y

    def to_batch(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Samples -> what the LM trainer consumes; the baseline is the whole batch's mean reward,
        computed here (before the batch is split over trainer ranks) so every rank uses the same."""
        prompts = batch["prompts"]
        input_ids = torch.stack([torch.full_like(prompts, PREFIX), prompts + PROMPT_BASE], dim=1)
        rewards = batch["rewards"].float()
        return {"input_ids": input_ids, "actions": batch["actions"].long(), "advantages": rewards - rewards.mean()}

    def loss_fn(self, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return lm_pg_loss(logits, batch, self.answer_base, self.vocab_size)


def lm_pg_loss(logits: torch.Tensor, batch: dict[str, torch.Tensor], answer_base: int, num_answers: int) -> torch.Tensor:
    """REINFORCE on the next-token distribution restricted to the answer tokens.

    No importance ratio: staleness is bounded by the loop (`trainer.max_staleness`) instead.
    """
    last = logits[:, -1, answer_base : answer_base + num_answers].float()
    logp = torch.log_softmax(last, dim=-1).gather(1, batch["actions"][:, None]).squeeze(1)
    return -(batch["advantages"] * logp).mean()
