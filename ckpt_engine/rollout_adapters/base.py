"""RolloutAdapter: the controller's handle on one rollout engine.

The controller (trainer rank 0 or the daemon) calls these in the order of one sync:
`join` once, then per sync `validate` -> `pause` -> `receive` (blocking while the sender streams)
-> `finalize(version)` -> `resume`; or, staged (issue 28, engines with `capabilities.stages`): `validate` ->
`receive(stage=...)` while the engine keeps serving -> `swap(version, pause_mode)` (or `discard()`
after a failed stream). The data never passes through these calls: the engine's own receiver ranks
take it from the weight-sync group.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from ckpt_engine.fp8.checks import fp8_problems
from ckpt_engine.delta.request import DeltaRequest
from ckpt_engine.engine import Rendezvous
from ckpt_engine.installed import InstalledReport, InstalledRequest
from ckpt_engine.manifest import BucketManifest, TensorSpec
from ckpt_engine.planning.regions import ReceivePlan
from ckpt_engine.rollout_adapters.capabilities import EngineCapabilities

__all__ = [
    "STAGES",
    "JoinOptions",
    "ManifestRejectedError",
    "Membership",
    "ReceiveReport",
    "RolloutAdapter",
    "check_manifest_against",
    "held_in",
    "version_of",
]


STAGES = ("patches", "full")
"""What `RolloutAdapter.receive(stage=...)` stages: the checked `patches` of a patch sync, or a `full`
staging copy of every weight (a dense sync, or a delta seed)."""


class ManifestRejectedError(ValueError):
    """An engine refused the manifest; nothing was transferred and its weights are unchanged."""

    def __init__(self, engine: str, problems: list[str], engines: list[str] | None = None) -> None:
        shown = "; ".join(problems[:10]) + (f"; ... ({len(problems)} problems)" if len(problems) > 10 else "")
        self.engines = engines if engines is not None else [engine]
        who = f"engine {engine!r}" if len(self.engines) == 1 else "engines " + ", ".join(map(repr, self.engines))
        super().__init__(f"{who} rejected the manifest: {shown}")
        self.engine, self.problems = engine, problems

    @classmethod
    def combine(cls, errors: list[ManifestRejectedError]) -> ManifestRejectedError:
        """One error for several engines' rejections; each problem is prefixed by its engine."""
        if len(errors) == 1:
            return errors[0]
        problems = [f"{e.engine}: {p}" for e in errors for p in e.problems]
        return cls(errors[0].engine, problems, engines=[e.engine for e in errors])


@dataclass(frozen=True)
class JoinOptions:
    """Settings both ends of the group must agree on, sent by the controller at join time."""

    bucket_size_bytes: int
    num_buffers: int
    verify: bool
    engine_kwargs: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> JoinOptions:
        if not isinstance(d, dict) or set(d) != {"bucket_size_bytes", "num_buffers", "verify", "engine_kwargs"}:
            raise ValueError(f"join options must be a map of bucket_size_bytes, num_buffers, verify, engine_kwargs; got {d!r:.200}")
        if not isinstance(d["bucket_size_bytes"], int) or d["bucket_size_bytes"] < 1:
            raise ValueError(f"bucket_size_bytes must be a positive int, got {d['bucket_size_bytes']!r}")
        if not isinstance(d["num_buffers"], int) or d["num_buffers"] < 2:
            raise ValueError(f"num_buffers must be an int >= 2, got {d['num_buffers']!r}")
        if not isinstance(d["verify"], bool) or not isinstance(d["engine_kwargs"], dict):
            raise ValueError("verify must be a bool and engine_kwargs a map")
        return cls(**d)


@dataclass
class ReceiveReport:
    """What one engine reports after loading a sync's weights."""

    tensors: int
    bytes: int
    receive_s: float
    load_s: float
    loaded: int
    extra: dict[str, float] = field(default_factory=dict)
    """Engine-specific numbers (e.g. bytes a loader had to detach from the buffers)."""

    _KEYS: ClassVar[tuple[str, ...]] = ("tensors", "bytes", "receive_s", "load_s", "loaded")

    @classmethod
    def from_dict(cls, d: Any) -> ReceiveReport:
        if not isinstance(d, dict):
            raise ValueError("receive report must be a map")
        try:
            extra = {str(k): float(v) for k, v in d.items() if k not in cls._KEYS}
            return cls(int(d["tensors"]), int(d["bytes"]), float(d["receive_s"]), float(d["load_s"]), int(d["loaded"]), extra)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed receive report: {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.extra)
        out.update(tensors=self.tensors, bytes=self.bytes, receive_s=self.receive_s, load_s=self.load_s, loaded=self.loaded)
        return out


def check_manifest_against(manifest: BucketManifest, expected: Mapping[str, TensorSpec]) -> list[str]:
    """Problems with loading `manifest` into an engine that holds `expected` tensors ([] = fine)."""
    problems, covered = fp8_problems(manifest.specs, expected)  # a block-FP8 layout that disagrees, with its fix
    hinted: set[tuple[str, str]] = set()  # one hint per (sent, held) pair, not one per tensor
    for spec in manifest.specs:
        want = expected.get(spec.name)
        if spec.name in covered:
            continue
        if want is None:
            problems.append(f"{spec.name}: the engine has no such tensor")
        elif want.shape != spec.shape:
            problems.append(f"{spec.name}: shape {list(spec.shape)} but the engine holds {list(want.shape)}")
        elif want.dtype != spec.dtype:
            pair = (spec.dtype, want.dtype)
            fix = "the same fix as above" if pair in hinted else _dtype_fix(*pair)
            hinted.add(pair)
            problems.append(f"{spec.name}: dtype {spec.dtype} but the engine holds {want.dtype}; {fix}")
    return problems


@dataclass(frozen=True)
class Membership:
    """An engine's answer before a sync: the version it holds (None: none or cannot say) and the
    token of the weight-sync group each of its ranks joined (None in the list: a rank in no group;
    `groups` None: the engine cannot say); `stale`: a rank says a failed sync left its weights part
    new (the version is then only the last one it completed)."""

    version: int | None
    groups: list[str | None] | None
    stale: bool = False

    def left(self, token: str) -> bool:
        """Whether a rank is not (or no longer) in the group `token`."""
        return self.groups is not None and any(g != token for g in self.groups)


class RolloutAdapter(ABC):
    """Controller-side handle of one engine; calls block and are made from worker threads."""

    name: str
    world_size: int = 1
    capabilities: EngineCapabilities = EngineCapabilities()
    """What a sync into this engine may use (`capabilities.py`; each adapter declares its own)."""
    owner: str | None = None
    """With `capabilities.claims`: the weight-sync group this handle acts for (set by `claim`, or by
    the daemon for a group that claimed the engine elsewhere); sent with every state change."""
    timeout_s: float | None = None
    """The longest one control call of this handle waits before it raises (None: no bound of its
    own). With `capabilities.bounded_calls`, a session of this one engine calls it on its own
    thread only where this bound lies within the session's `timeout_s` (`sync/fanout.py`)."""
    membership_at_validate: bool = False
    """Whether `validate` (and `validate_regions`) also reads the engine's `membership`, in the same
    engine call (`validated_membership`): a session whose engines all do asks no query of its own."""

    def claim(self, owner: str, lease_s: float) -> Any:
        """Make weight-sync group `owner` the engine's only controller for `lease_s`, renewed by its
        calls; refused while another group holds it. Engines with `capabilities.claims` implement it."""
        raise NotImplementedError(f"{type(self).__name__} cannot be claimed (capabilities.claims is False)")

    def release(self) -> None:
        """Let go of this handle's claim at once (engines with `capabilities.claims`)."""
        raise NotImplementedError(f"{type(self).__name__} cannot be claimed (capabilities.claims is False)")

    def engine_key(self) -> Hashable:
        """What identifies the engine itself (not this handle): two handles on one engine share it.

        Sessions use it to find each other's engines (one sync at a time per engine, one group per
        engine); adapters that can name their engine (a URL, an `LLM` object) override it.
        """
        return (type(self).__qualname__, id(self))

    def take_over(self, previous: RolloutAdapter) -> None:
        """Become the handle a session drives instead of `previous`, an earlier handle on the same
        engine (same `engine_key`): take whatever of its state the engine's group membership needs
        (the engine stays in the group, so the session keeps its group, plan and delta bases).
        Default: nothing to take."""

    def membership(self) -> Membership:
        """What the engine holds and, per rank, which weight-sync group it is in, in one query
        before each sync: a rank in no group or in another one than the session's restarted (or
        was taken over), so the session rejoins and seeds it instead of streaming into a group it
        left. Default: the held version, groups unknown (never checked)."""
        return Membership(self.held_version(), None)

    def finalize_with_receive(self, version: int, installed: Callable[[], InstalledReport | None] | None = None) -> None:
        """The coming unstaged `receive` may also finalize `version` in its own last engine call, once
        every byte of it landed whole (one round trip fewer a sync); `finalize(version)` is called after
        it all the same and does what is left. Told after a validate, for a sync into this engine alone
        from one sender with nothing checked between the receive and the finalize (another engine's
        receive may not fail after this one finalized), or with an installed-weight check of its one
        rank: `installed` gives the source's digests (None: finalize apart) and the engine finalizes
        there only where its own report agrees (`InstalledReport.agrees`). Default: nothing folded."""

    def validated_membership(self) -> Membership | None:
        """With `membership_at_validate`: what `membership()` would have answered, as read by the last
        `validate` (taken once: a second read is None); None where that validate could not read it."""
        return None

    def held_version(self) -> int | None:
        """The version the engine reports it holds (None: never synced or cannot say).

        New versions start one past it, so a fresh session or handle never reuses a label. An
        engine whose last sync failed part-way may report no held `version` but its newest
        finalized one as `last_version`; the larger counts."""
        return held_in(self.health())

    @abstractmethod
    def join(self, rendezvous: Rendezvous, rank_offset: int, options: JoinOptions) -> None:
        """Join the weight-sync group as ranks [rank_offset, rank_offset + world_size); collective."""

    @abstractmethod
    def validate(self, manifest: BucketManifest, encoded: bytes) -> None:
        """Raise ManifestRejectedError if the engine cannot load this manifest exactly."""

    def receive_plans(self) -> list[ReceivePlan | None]:
        """What each engine rank holds (one per rank, in rank order), stated once per join: which
        regions of which tensors (`planning.regions`); None = every tensor whole (the default)."""
        return [None] * self.world_size

    def validate_regions(self, manifest: BucketManifest, encoded: bytes, assignments: list[bytes]) -> None:
        """`validate`, with each rank's region assignment (an encoded `planning.region_wire.RegionAssignment`):
        what it receives, from which receiver sets. Engines with `capabilities.regions` implement it."""
        raise NotImplementedError(f"{type(self).__name__} takes no region delivery (capabilities.regions is False)")

    @abstractmethod
    def pause(self, mode: str) -> None: ...

    @abstractmethod
    def receive(self, manifest: BucketManifest, delta: DeltaRequest | None = None) -> ReceiveReport:
        """Block until the engine has received and loaded every tensor of `manifest`.

        `delta` is passed only to adapters with `capabilities.delta`. Adapters with `capabilities.stages` also take
        a keyword `stage` (passed only when staging): `"patches"` (a patch sync: every patch is
        checked against the live weights and kept, nothing live is written) or `"full"` (the sync
        lands in a staging copy of every weight); the engine keeps serving its current version
        until `swap`."""

    def staging_room(self, nbytes: int) -> bool:
        """Whether a dense staging copy of `nbytes` (a whole sync's bytes on one engine rank) fits
        beside the engine's weights; asked before a dense sync with `stage: auto | full`.
        Default: no room."""
        return False

    def swap(self, version: int, pause_mode: str) -> float:
        """Between two engine steps: pause per `pause_mode`, apply the staged version (patches in
        place, or copy / switch from the staging copy), run the engine's post-load step, stamp
        `version`, resume. Returns the stall: seconds the engine produced no tokens. A failure
        leaves the engine stale, as a failed `finalize` does. Engines with `stages` implement it."""
        raise NotImplementedError(f"{type(self).__name__} does not stage syncs (capabilities.stages is False)")

    def discard(self) -> None:
        """Drop a staged version after a failed stream: the engine keeps serving its old version,
        unpaused and not stale (its live weights were never touched). Engines with `stages`
        implement it; calling it with nothing staged is a no-op."""
        raise NotImplementedError(f"{type(self).__name__} does not stage syncs (capabilities.stages is False)")

    def installed_digests(self, request: InstalledRequest) -> list[InstalledReport]:
        """One report per rank (rank order): the digest of every (checkpoint name, region) of
        `request.names` the rank installed, read from its own layout (`ckpt_engine/installed.py`),
        the tensors of its layout the sync does not write, and those it cannot map back (named, not
        guessed). Asked after the stream, before `finalize` (staged: after `swap`). Engines with
        `capabilities.installed` implement it. One engine told the check with its receive
        (`checks_at_receive`) is asked in the session's own thread: its answer came with the receive,
        or the call it makes is bounded by its own timeout."""
        raise NotImplementedError(f"{type(self).__name__} cannot digest its installed weights (capabilities.installed is False)")

    @abstractmethod
    def finalize(self, version: int) -> None:
        """Post-process loaded weights, flush caches and stamp `version`; the engine stays paused."""

    @abstractmethod
    def resume(self) -> None:
        """Let the engine serve again (after `finalize`, or after a failure: the sync's hold let go)."""

    @abstractmethod
    def health(self) -> dict[str, Any]:
        """Raise if the engine is unreachable or dead; else a small status map."""

    @abstractmethod
    def leave(self) -> None:
        """Leave the weight-sync group (the group must be rebuilt before the next sync)."""

    def close(self) -> None:
        """Release local resources (connections, processes the adapter started)."""


_FLOATS = frozenset({"float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"})


def _dtype_fix(sent: str, held: str) -> str:
    """How the trainer sends `held` instead of `sent`."""
    if sent in _FLOATS and held in _FLOATS:
        return f"send it as {held}: StateDictSource(..., dtype=torch.{held}) casts floating-point tensors on the wire"
    return f"cast it to {held} in the trainer's weights (StateDictSource's dtype= casts floating-point tensors only)"


def held_in(health: Mapping[str, Any]) -> int | None:
    """The version a health report says its engine holds: the larger of its `version` and
    `last_version` (see `RolloutAdapter.held_version`); None when it names neither."""
    known = [v for v in (version_of(health.get("version")), version_of(health.get("last_version"))) if v is not None]
    return max(known, default=None)


def version_of(value: Any) -> int | None:
    """A reported version as an int (None when absent or not a non-negative int)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value >= 0 else None
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return None
