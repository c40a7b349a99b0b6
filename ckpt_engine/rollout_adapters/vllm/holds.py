"""Who holds a vLLM engine now: a trainer's sync or a peer join (issue 43).

A sync and a peer join into one engine must not overlap: the join's pull lands in the staging copy
a staged sync lands in, and its swap installs weights a sync is replacing. The worker's staging
lock refuses the overlap part-way; this refuses it before anything is touched, by name. Both
claim the workers' peer lease (`vllm/peer.py`, the reference receiver's `EngineLease` and its
wording): a sync as `SYNC_OWNER` from its group join or validate (the claim rides on the validate
call) to its finalize (the release rides on it), swap or discard; a
join under a fresh name of its own (`joining`) for the whole join, naming it on its peer calls.
Whichever comes second is refused: a peer join into an engine a sync holds (or an offer from it),
or a sync's group join or validate into an engine a join holds.

Every sync claims under one name, whatever its session or group: syncs are not kept apart here
(a new session takes an engine over as before), and a new session's sync is not refused by the
claim of an old one that never let go (a failed unstaged sync, a dead trainer).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from ckpt_engine.rollout_adapters.vllm.routes import ExtensionRoute

__all__ = ["LEASE_SLACK_S", "SYNC_OWNER", "EngineHolds"]

logger = logging.getLogger(__name__)
T = TypeVar("T")

SYNC_OWNER = "trainer sync"
"""The name a sync holds an engine under (a join's refusal names it)."""

LEASE_SLACK_S = 30.0
"""Past twice the timeout of a sync (or join), how long its claim outlives a holder that never lets
go (a failed unstaged sync, a dead controller); the next sync's end, a leave or a discard lets go at once."""


class EngineHolds:
    """One engine's holds, through `route` (None: a route without peer calls, nothing to keep apart)."""

    def __init__(self, name: str, route: ExtensionRoute | None, timeout_s: float) -> None:
        self.name, self.route, self.timeout_s = name, route, timeout_s
        self.syncing = False
        """Whether a sync through this handle holds the engine now."""
        self.join_owner: str | None = None
        """The join holding the engine (`joining`): its peer calls name it."""

    def take_over(self, previous: EngineHolds) -> None:
        self.syncing = previous.syncing

    def for_sync(self) -> None:
        """Claim (or renew) the workers for a sync; RuntimeError naming the join that holds them."""
        if self.route is not None:
            self.route.rpc("ckpt_peer_claim", self.sync_claim(), min(self.timeout_s, 30.0))
            self.syncing = True

    def sync_claim(self) -> dict[str, Any] | None:
        """The sync's claim as `ckpt_peer_claim`'s arguments, for a call that carries it (the
        validate: one worker round trip, not two); None where nothing is held. `claimed` after it."""
        return {"owner": SYNC_OWNER, "lease_s": 2 * self.timeout_s + LEASE_SLACK_S} if self.route is not None else None

    def claimed(self) -> None:
        """The call carrying `sync_claim` returned: the workers hold the claim."""
        self.syncing = self.route is not None

    def sync_release(self) -> str | None:
        """The owner to let go of in the sync's last worker call (an unstaged finalize), if this
        handle's sync holds the engine; the claim counts as let go from here on."""
        owner = SYNC_OWNER if self.syncing and self.route is not None else None
        self.syncing = False
        return owner

    def let_go(self) -> None:
        """The sync ended: release its claim (best effort: a claim not released lapses)."""
        if self.syncing and self.route is not None:
            self._release(SYNC_OWNER, "the sync's")
        self.syncing = False

    def finalize(self, call: Callable[[str | None], T], released: bool) -> T:
        """A sync's finalize: `call(owner)`, `owner` the claim its worker call lets go of
        (`sync_release`; None where `released`: the receive's last call finalized and let go). Where
        it fails the claim is let go here (best effort): no resume follows a failed finalize, and a
        peer join may heal the stale engine at once, not once the claim lapses (2 x timeout_s + 30 s)."""
        owner = None if released else self.sync_release()
        try:
            return call(owner)
        except BaseException:
            if self.route is not None:
                self._release(SYNC_OWNER, "the failed sync's")
            raise

    @contextlib.contextmanager
    def joining(self, owner: str, timeout_s: float) -> Iterator[None]:
        """Hold the workers for the join `owner`; raises (naming the holder) while a sync holds them."""
        if self.route is None:
            yield
            return
        self.route.rpc("ckpt_peer_claim", {"owner": owner, "lease_s": 2 * timeout_s + LEASE_SLACK_S}, min(self.timeout_s, 30.0))
        self.join_owner = owner
        try:
            yield
        finally:
            self.join_owner = None
            self._release(owner, "the join's")

    def _release(self, owner: str, whose: str) -> None:
        assert self.route is not None
        try:
            self.route.rpc("ckpt_peer_release", {"owner": owner}, min(self.timeout_s, 10.0))
        except Exception as exc:  # a dead engine: nothing left to hold
            logger.warning("engine %s: releasing %s claim on its workers: %s", self.name, whose, exc)
