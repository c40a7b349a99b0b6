"""The LoRA slot check behind vLLM's OpenAI server, as the handle reads it at finalize (issue 42 item 5).

In process a worker compares the slots `set_lora` wrote right after it activates a version itself
and fails its finalize (`vllm/lora_worker.py`). Behind the server vLLM activates the version inside
its own call: the registration (`/v1/load_lora_adapter` reaches every worker's LRU manager, whose
`add_adapter` activates what it adds), or else the first request that names it. Nothing may raise
there, so each worker compares its slots right after that activation and reports the outcome in its
health (`slot_check`); the handle reads it once the name is registered. A worker that has not
compared yet (its version not activated) gets one `max_tokens=1` completion naming the version,
which makes vLLM activate it; a worker still without a comparison after it is a problem too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["served_slot_problems"]


def served_slot_problems(health: Callable[[], list[dict[str, Any]] | None], version: int, activate: Callable[[], None]) -> list[str]:
    """The workers' slot problems of `version` ("worker r: ..." with more than one worker); [] when
    this sync's check was not armed, or the route cannot ask the workers (vLLM's weight-transfer API)."""
    replies = health()
    if not replies or not any(_check(r, version) is not None for r in replies):
        return []
    if any(_pending(r, version) for r in replies):
        activate()
        replies = health() or []
    problems: list[str] = []
    for rank, reply in enumerate(replies):
        where = f"worker {rank}: " if len(replies) > 1 else ""
        check = _check(reply, version)
        if check is None or check.get("problems") is None:
            problems.append(f"{where}vLLM did not activate adapter version {version} into its LoRA slots (not even for a request naming it): not checked")
        else:
            problems += [f"{where}{p}" for p in check["problems"]]
    return problems


def _check(reply: dict[str, Any], version: int) -> dict[str, Any] | None:
    check = reply.get("slot_check")
    return check if isinstance(check, dict) and check.get("version") == version else None


def _pending(reply: dict[str, Any], version: int) -> bool:
    check = _check(reply, version)
    return check is None or check.get("problems") is None
