"""One engine, one weight-sync job: the daemon's side of claiming and releasing engines.

An engine serving two jobs would load a mix of both jobs' weights and report one job's version,
so every engine belongs to one job's group at a time. Two guards:

- **The job token.** An engine's control port demands the token it was started with, so another
  job's daemon cannot even reach it; registration fails saying so.
- **The claim.** A daemon that registers an engine claims it for its job's group (`group` in
  `hello`: derived from the job token, so every daemon of one job, a restarted one included,
  names the same group) with a lease of `daemon.engine_lease_s`. Every call the owner makes,
  health probes included, renews the lease; `leave`, a drop and `close()` release it at once,
  whoever of the job makes them. A different group's claim, and any state change from it, is
  refused until then; if the owning job goes silent, the engine is free once the lease lapses.
  A daemon that comes back (same token) takes its job's engines over at once.

Engine kinds without `capabilities.claims` (vLLM, SGLang: no code of ours holds a lease in their
servers' control paths) are guarded by the token only.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

from ckpt_engine.rollout_adapters.base import RolloutAdapter
from ckpt_engine.control.wire import AuthError, RpcError

__all__ = ["adopt", "claim_engine", "describe", "job_group", "refusal", "release_engine"]

logger = logging.getLogger(__name__)


def job_group(token: str) -> str:
    """The weight-sync group id of the job holding `token` (the same for every daemon of the job;
    one-way, so the id reveals nothing of the token)."""
    return hashlib.sha256(b"ckpt-engine job group\0" + token.encode()).hexdigest()[:16]


def claim_engine(adapter: RolloutAdapter, group: str, lease_s: float) -> None:
    """Claim `adapter`'s engine for `group`; raises (RpcError PermissionError) when another group holds it."""
    if adapter.capabilities.claims:
        adapter.claim(group, lease_s)


def adopt(adapter: RolloutAdapter, group: str) -> None:
    """Act for `group` on an engine another daemon of the same group claimed (a following trainer)."""
    if adapter.capabilities.claims:
        adapter.owner = group


def release_engine(adapter: RolloutAdapter) -> None:
    """Release `adapter`'s claim, if it has one; a failure is logged, never raised (the engine's
    lease lapses on its own)."""
    if not adapter.capabilities.claims:
        return
    try:
        adapter.release()
    except Exception as exc:
        logger.debug("releasing engine %s: %s", adapter.name, exc)


def refusal(name: str, where: str, exc: BaseException) -> str:
    """The message for a registration that failed: foreign token, foreign group, or unreachable."""
    if isinstance(exc, AuthError):
        return (f"engine {name!r} ({where}) refused this job's token: it was started for another job "
                "(an engine belongs to one weight-sync job; start it with this job's token)")
    if isinstance(exc, RpcError) and exc.remote_type == "PermissionError":
        return f"engine {name!r} ({where}) belongs to another weight-sync group: {exc.remote_message}"
    return f"engine {name!r} ({where}) is unreachable: {exc}"


def describe(descriptor: dict[str, Any]) -> str:
    if "host" in descriptor and "port" in descriptor:
        return f"{descriptor.get('kind')} at {descriptor['host']}:{descriptor['port']}"
    return str(descriptor.get("kind"))
