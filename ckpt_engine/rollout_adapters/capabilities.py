"""What an engine can do: one declared `EngineCapabilities` per adapter, read in one place.

Every adapter class declares `capabilities` (the table in docs/library.md lists each engine's); a
handle whose channel decides something (vLLM's weight-transfer API with a client that cannot pause
cannot stage) sets its own with `dataclasses.replace` in `__init__`. Sessions and the daemon never
read a capability of one engine by hand: they ask `lacking` which engines of a group lack one, and
name them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal, Protocol

__all__ = ["Capable", "EngineCapabilities", "Feature", "lacking"]

Feature = Literal["delta", "many_senders", "regions", "stages", "stages_regions", "installed", "checks_at_receive", "bounded_calls", "pauses"]
"""The yes/no capabilities a group needs from every engine to use the feature."""


@dataclass(frozen=True)
class EngineCapabilities:
    """What a sync into one engine may use (all False / the defaults: the plainest engine)."""

    delta: bool = False
    """`receive` takes a `delta` request: its receiver ranks keep base copies and apply patches."""
    many_senders: bool = False
    """Its receiver ranks take buckets from several senders."""
    regions: bool = False
    """Its receiver ranks take region delivery (`validate_regions`; `receive` hands their loader
    `(name, region, tensor)` items); a session uses region delivery only when every engine does."""
    stages: bool = False
    """It receives into a staging area while it serves (`receive(stage=...)`, then `swap` between
    two engine steps, or `discard`); a session stages only when every engine does."""
    stages_regions: bool = False
    """With `stages` and `regions`, it also stages a sync with receive plans (every region lands in
    staging; nothing live is written before `swap`)."""
    weights: Literal["full", "adapters"] = "full"
    """What a sync carries: `full` weights, or `adapters` (a LoRA adapter installed as a new version
    beside the base; `checkpoint_engine.weights` must match)."""
    transport: str | None = None
    """The only transport (registry name) whose wire the engine reads, e.g. SGLang's own; None: any
    of ckpt-engine's (the session then takes `checkpoint_engine.backend`)."""
    installed: bool = False
    """Its ranks digest what they installed, in their own layout (`installed_digests`, issue 42 item
    5): installed-weight checks compare it with the source."""
    checks_at_receive: bool = False
    """With `installed`, one rank told a check's source digests with its receive finalizes in the
    receive's last call where its own agree (`finalize_with_receive`): no finalize round trip."""
    bounded_calls: bool = False
    """Every control call (join, validate, pause, receive's start and end, finalize, resume, swap)
    answers or raises within the handle's own timeout (`RolloutAdapter.timeout_s`), so a session of
    this one engine whose timeout is no longer than the handle's makes the call on its own thread,
    not through its pool (whose bounded wait guards every other engine): two thread hand-offs
    fewer a step."""
    pauses: bool = True
    """`pause` stops the engine serving until `resume` (vLLM's weight-transfer API behind a bare client
    has no call for it: the caller pauses, and a failed sync's error says the engine may serve part of it)."""
    claims: bool = False
    """The engine can be claimed by one weight-sync group for a lease (`RolloutAdapter.claim`); the
    daemon claims such engines at registration. Engines without it are guarded by the job token."""

    def __post_init__(self) -> None:
        if self.weights not in ("full", "adapters"):
            raise ValueError(f"weights must be 'full' or 'adapters', got {self.weights!r}")
        if self.stages_regions and not (self.stages and self.regions):
            raise ValueError("stages_regions needs stages and regions")


class Capable(Protocol):
    """An engine's handle as `lacking` reads it (every `RolloutAdapter` is one)."""

    name: str
    capabilities: EngineCapabilities
    timeout_s: float | None


def bounded_within(engine: Capable, timeout_s: float) -> bool:
    """Whether every control call of `engine` ends on its own within `timeout_s`, so a caller bound
    by that timeout may make the call on its own thread."""
    bound = engine.timeout_s
    return engine.capabilities.bounded_calls and bound is not None and bound <= timeout_s


def lacking(rollouts: Iterable[Capable], feature: Feature) -> list[str]:
    """The names of the engines among `rollouts` that lack `feature`, in order."""
    return [r.name for r in rollouts if not getattr(r.capabilities, feature)]  # a field of the dataclass (`asdict`: ~10 us a call)
