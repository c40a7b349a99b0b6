"""What the workers answer through vLLM's calls, and how the trainer side reads it back.

The worker extension's `ckpt_*` methods never raise: a failure comes back as `{FAILED: "Type:
message"}` (`vllm/worker.py`), raised by the trainer side (`vllm/routes.py`) once every worker
answered. vLLM's multiprocess executor stops reading answers at the first worker that raised,
leaving the others' queued, so every later call of that engine would read the answer of the call
before it (seen with a TP=2 engine).

vLLM 0.32's `update_weights` returns nothing from the workers, so every answer other than "yes" is an
error that crosses vLLM's RPC (and maybe HTTP) as text. The worker side (`transfer_engine.py`) starts
each such error with one of the markers below; the trainer side (`native.py`) finds them again. Both
import them from here, which imports no vLLM (the trainer-side handle must not pay vLLM's import).
"""

from __future__ import annotations

__all__ = ["FAILED", "NEED_MANIFEST", "NO_ROOM", "PHASES", "REJECTED", "after", "installed_key", "plan_key", "problems"]

FAILED = "ckpt_failed"
"""The key of a worker extension method's answer that failed: its error, as text."""

PHASES = ("validate", "receive", "install", "swap", "discard", "room", "arm", "installed")
"""The `phase` of an `update_weights` call (`CkptEngineUpdateInfo`)."""
NEED_MANIFEST = "need_manifest"
"""Appears in the validate error when the worker has no manifest under the announced digest."""
REJECTED = "ckpt_engine rejected the manifest: "
"""Starts the validate error that lists the manifest's problems ("; "-separated)."""
NO_ROOM = "ckpt_engine: no room for a staging copy: "
"""Starts the room phase's answer when a dense staging copy does not fit (the why follows)."""


def plan_key(rank: int) -> str:
    """Where the worker of group rank `rank` leaves its receive plan (`VllmReceiverCore.receive_plan`'s
    answer, JSON) in the weight-sync group's rendezvous store at join: no vLLM call returns it."""
    return f"receive-plan/{rank}"


def installed_key(rank: int, seed: int) -> str:
    """Where the worker of group rank `rank` leaves its installed-weight report (`InstalledReport`'s
    wire form, JSON) for the check of `seed` (phase `installed`): no vLLM call returns it either."""
    return f"installed/{seed}/{rank}"


def after(text: str, marker: str) -> str:
    """What a worker said after `marker`, out of an error that crossed vLLM's RPC (and maybe HTTP)."""
    tail = text[text.index(marker) + len(marker) :]
    for end in ("\n", "\\n"):
        tail = tail.split(end, 1)[0]
    return tail.strip().rstrip("'\"})]").strip()[:500]


def problems(text: str) -> list[str]:
    """The worker's problem list out of an error that crossed vLLM's RPC (and maybe HTTP)."""
    start = text.index(REJECTED)
    tail = text[start + len(REJECTED) :]
    for end in ("\n", "\\n"):
        tail = tail.split(end, 1)[0]
    # The message ends at the last quote of the kind that opened it (repr(), vLLM's "error '...'",
    # or an escaped one inside JSON): a problem may hold quotes of its own ("the engine's").
    opener = text[start - 1] if start > 0 else ""
    if opener in ("'", '"'):
        closer = "\\" + opener if start > 1 and text[start - 2] == "\\" else opener
        tail = tail.rsplit(closer, 1)[0] if closer in tail else tail
    return [p.strip() for p in tail.split("; ") if p.strip()]
