"""A `Generator` over a real vLLM server: token-in/token-out requests tagged by vLLM's own weight version.

The engine is the OpenAI `api_server` started the way vLLM users start it, with
`--enable-scale-out` (for `/inference/v1/generate`, prompts and answers as token ids, no
tokenizer) and `VLLM_SERVER_DEV_MODE=1` plus our worker extension (for the daemon's `vllm` engine
kind, `VllmServerRollout`). Each sample's versions are the ones vLLM reports for the tokens it
sampled (`weight_versions` spans, stamped by the adapter's finalize or swap while the engine is
paused), not a guess made at submit time. A request that straddles a staged swap shows two spans
(tokens before the swap from the old version, after it from the new one); its staleness counts from
its oldest span, so no sample is ever counted fresher than the weights that produced it.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from ckpt_engine.trainer.lm_task import TokenTask
from ckpt_engine.trainer.rollout import Generation

__all__ = ["VllmServerGenerator", "parse_choice_spans", "parse_choice_version"]

logger = logging.getLogger(__name__)

GENERATE_ROUTE = "/inference/v1/generate"


def parse_choice_spans(choice: Any) -> list[tuple[int, int]] | None:
    """(version, index of its first token) per span of a choice's tokens, in token order; None
    when any span came from weights no sync stamped (vLLM's initial label "default") or the field
    is missing or malformed."""
    spans = choice.get("weight_versions") if isinstance(choice, dict) else None
    if not isinstance(spans, list) or not spans:
        return None
    out: list[tuple[int, int]] = []
    for s in spans:
        label = s.get("version") if isinstance(s, dict) else None
        start = s.get("start") if isinstance(s, dict) else None
        if not isinstance(label, str) or not label.isdigit() or not isinstance(start, int):
            return None
        out.append((int(label), start))
    return out


def parse_choice_version(choice: Any) -> int | None:
    """The oldest ckpt-engine version that produced any of a choice's tokens (its staleness counts
    from it), else None (see `parse_choice_spans`)."""
    spans = parse_choice_spans(choice)
    return min(v for v, _ in spans) if spans else None


class VllmServerGenerator:
    """Samples the task's answers from a vLLM server; one HTTP request per group of equal prompts.

    Requests for the distinct prompts of a call run concurrently (vLLM batches them); the call
    returns a Generation tagged with the oldest version any answer token came from (each sample's
    spans ride along), or None when some answer came from weights no sync stamped.
    """

    def __init__(self, name: str, base_url: str, task: TokenTask, *, timeout_s: float = 60.0, max_concurrency: int = 8) -> None:
        import requests

        self.name = name
        self.base_url = base_url.rstrip("/")
        self.task = task
        self.timeout_s = timeout_s
        self._local = threading.local()
        self._session_factory = requests.Session
        self._sessions: list[Any] = []
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix=f"gen-{name}")
        self.discarded = 0
        """Calls with an answer from weights no sync stamped (the engine's initial weights)."""

    def _session(self) -> Any:
        s = getattr(self._local, "session", None)
        if s is None:
            s = self._local.session = self._session_factory()
            with self._lock:
                self._sessions.append(s)
        return s

    def _request(self, x: int, n: int, temperature: float) -> list[dict[str, Any]]:
        # No per-request seed: vLLM would give the n choices of one request the same stream.
        params: dict[str, Any] = {
            "n": n, "max_tokens": 1, "temperature": temperature, "allowed_token_ids": self.task.answer_token_ids(),
        }
        body = {"token_ids": self.task.prompt_ids(x), "sampling_params": params}
        resp = self._session().post(f"{self.base_url}{GENERATE_ROUTE}", json=body, timeout=self.timeout_s)
        if resp.status_code != 200:
            raise RuntimeError(f"engine {self.name!r}: POST {GENERATE_ROUTE} answered {resp.status_code}: {resp.text[:300]}")
        choices = resp.json().get("choices")
        if not isinstance(choices, list) or len(choices) != n:
            raise RuntimeError(f"engine {self.name!r}: expected {n} choices, got {choices!r:.200}")
        return sorted(choices, key=lambda c: c.get("index", 0))

    def _sample(self, prompts: torch.Tensor, temperature: float) -> Generation | None:
        values = [int(v) for v in prompts.tolist()]
        groups: dict[int, list[int]] = {}
        for i, v in enumerate(values):
            groups.setdefault(v, []).append(i)
        futures = {v: self._pool.submit(self._request, v, len(idx), temperature) for v, idx in groups.items()}
        actions = torch.empty(len(values), dtype=torch.long)
        spans: list[list[tuple[int, int]] | None] = [None] * len(values)
        for v, fut in futures.items():
            choices = fut.result(timeout=self.timeout_s + 5)
            for i, c in zip(groups[v], choices):
                tokens = c.get("token_ids") or []
                if len(tokens) != 1:
                    raise RuntimeError(f"engine {self.name!r}: expected one answer token, got {tokens!r:.100}")
                actions[i] = self.task.token_to_answer(tokens[0])
                spans[i] = parse_choice_spans(c)
        if any(s is None for s in spans):
            self.discarded += 1
            return None
        known = [s for s in spans if s is not None]
        return Generation(actions, min(v for s in known for v, _ in s), known)

    def generate(self, prompts: torch.Tensor) -> Generation | None:
        """Sampled answers (temperature 1) and the version that made all of them, or None."""
        return self._sample(prompts, 1.0)

    def greedy(self, prompts: torch.Tensor) -> torch.Tensor | None:
        """Greedy answers from the engine's current weights (the demo's before/after summary)."""
        gen = self._sample(prompts, 0.0)
        return None if gen is None else gen.actions

    def weight_version(self) -> str:
        s = self._session()
        resp = s.get(f"{self.base_url}/weight_info", timeout=min(self.timeout_s, 10.0))
        resp.raise_for_status()
        return str(resp.json()["weight_version"])

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            for s in self._sessions:
                s.close()
            self._sessions.clear()
