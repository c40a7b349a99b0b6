"""Reference receiver: a plain torch state dict (or HF `transformers` model) in its own process.

For tests, benchmarks and users without an inference engine. `TorchRefRollout.spawn(...)` starts
`python -m ckpt_engine.rollout_adapters.torch_ref`, which serves the receiver on a control port
(`ckpt_engine.control.server`: the job token it was started with, the daemon's limits) and loads
every bucket into its tensors with one batched copy.

Two guards keep a half-written engine from serving:
- `version` is the last version the engine holds *completely*: a transfer clears it until
  `finalize`, and `finalize` is refused unless a transfer completed since the last one; `resume`
  is refused while the engine is stale (only a complete sync resumes it).
- An engine belongs to one weight-sync group at a time (`engine_lease.py`).

Staged syncs (issue 28): it stages (`receive(stage=...)`, `swap`, `discard`), with room for a
dense staging copy up to `--staging-budget-mb` (and the free memory), and, with
`--step-interval-s`, runs "engine steps" (`ref_steps.py`) that read every weight under the step
lock while the next version streams in; the swap takes that lock between two steps.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from ckpt_engine.processes import read_ready_line
from ckpt_engine.copies import batched_copy_
from ckpt_engine.delta.request import DeltaRequest
from ckpt_engine.delta.warm import warmed
from ckpt_engine.elastic.join import PeerJoinable
from ckpt_engine.elastic.service import PeerService
from ckpt_engine.engine import Rendezvous
from ckpt_engine.installed import HeldDigests, InstalledReport, InstalledRequest
from ckpt_engine.manifest import BucketManifest, TensorSpec
from ckpt_engine.planning.receive_sets import cut_region
from ckpt_engine.planning.regions import ReceivePlan, Region
from ckpt_engine.rollout_adapters.base import JoinOptions, ManifestRejectedError, Membership, ReceiveReport, RolloutAdapter, held_in
from ckpt_engine.rollout_adapters.capabilities import EngineCapabilities
from ckpt_engine.rollout_adapters.engine_lease import EngineLease
from ckpt_engine.rollout_adapters.load_gate import LoadGate
from ckpt_engine.rollout_adapters.receiver import WeightReceiver
from ckpt_engine.rollout_adapters.ref_models import RefModel, load_spec_file, write_spec_file
from ckpt_engine.rollout_adapters.ref_steps import EngineSteps, staging_room
from ckpt_engine.control.server import RpcServer
from ckpt_engine.versions import check_step, check_version
from ckpt_engine.sources.base import spec_of
from ckpt_engine.control.wire import RpcClient

__all__ = ["TorchRefRollout", "TorchRefWorker", "load_spec_file", "write_spec_file"]

logger = logging.getLogger(__name__)

READY_PREFIX = "CKPT_ENGINE_READY port="
TOKEN_ENV = "CKPT_ENGINE_TOKEN"
"""The job token reaches a spawned receiver through its environment, never its command line."""


class TorchRefWorker:
    """The receiving process: its tensors, its receiver, its weight version.

    As one rank of a TP / EP engine (`sharded`) it holds only its slices (`planning/tp_ep.py`):
    its tensors have the slices' shapes, and it states that plan at join."""

    def __init__(
        self, tensors: dict[str, torch.Tensor], model: torch.nn.Module | None = None, load_delay_s: float = 0.0,
        plan: ReceivePlan | None = None, expected: dict[str, TensorSpec] | None = None, staging_budget_bytes: int | None = None,
        step_interval_s: float | None = None,
    ) -> None:
        self.tensors = tensors
        self.model = model
        self.gate = LoadGate.from_env(load_delay_s)
        self.plan = plan
        self.regions: dict[str, Region | None] = {}
        """The one region of each held tensor (None: whole), as `plan` says."""
        if plan is not None:
            for name, rs in plan.holds.items():
                if rs is not None and len(rs) != 1:
                    raise ValueError(f"the reference receiver holds one region per tensor; {name!r} has {len(rs)}")
                self.regions[name] = rs[0] if rs is not None else None
        self.receiver = WeightReceiver(plan=plan)
        self.version: int | None = None
        """The version held completely; None before the first sync and while partially loaded."""
        self.last_version: int | None = None
        """The highest version ever finalized: versions never go down."""
        self.paused = False
        self.stale = False
        self.receiving = False
        self.received: str | None = None
        """Digest of the transfer that completed since the last finalize (None: none did)."""
        self.expected = expected if expected is not None else {n: spec_of(n, t) for n, t in tensors.items()}
        self.lease = EngineLease()
        self.staging_budget_bytes = staging_budget_bytes
        """Cap on a dense staging copy (None: the free memory alone decides)."""
        self.steps = EngineSteps(tensors, lambda: self.version, step_interval_s if step_interval_s is not None else 0.0)
        if step_interval_s is not None:
            self.steps.start()
        self.peers = PeerService(self, self.receiver.exclusive, self.gate.pass_through)  # peer joins (ckpt_engine.elastic)
        self.held = HeldDigests(tensors, self.regions)  # installed-weight checks

    @classmethod
    def of(cls, model: RefModel, **kw: Any) -> TorchRefWorker:
        """A worker over `model`'s tensors (see `ref_models.py`)."""
        return cls(model.tensors, model=model.module, plan=model.plan, expected=model.expected, **kw)

    def load_bucket(self, pairs: list[tuple[str, torch.Tensor]], into: dict[str, torch.Tensor] | None = None, delay: bool = True) -> int:
        """Whole tensors (a sync without region delivery): a sharded rank keeps its slices.
        `into`: the tensors to load (default: the live ones; a staging copy for `stage="full"`)."""
        if delay:
            self.gate.pass_through()
        if self.plan is not None:
            pairs = [(n, cut_region(t, self.regions[n])) for n, t in pairs if n in self.regions]
        target = into if into is not None else self.tensors
        batched_copy_([target[n] for n, _ in pairs], [t for _, t in pairs])
        return len(pairs)

    def load_regions(
        self, items: list[tuple[str, Region | None, torch.Tensor]], into: dict[str, torch.Tensor] | None = None, delay: bool = True,
    ) -> int:
        """Region delivery: each item is one of this rank's regions, in the region's shape."""
        if delay:
            self.gate.pass_through()
        target = into if into is not None else self.tensors
        batched_copy_([target[n] for n, _, _ in items], [t for _, _, t in items])
        return len(items)

    # --- RPC handlers (plain msgpack types in and out) ----------------------------------------
    def handlers(self) -> dict[str, Any]:
        """RPC methods; those that change the engine's state carry the caller's `owner`."""
        return {
            "join": self._owned(lambda rendezvous, rank, options: self.receiver.join(rendezvous, rank, options)),
            "leave": self._owned(self.receiver.leave),
            "validate": self._owned(
                lambda encoded, digest, regions=None: self.receiver.validate(encoded, digest, self.expected, regions=regions)
            ),
            "receive_plans": self._owned(lambda: [self.plan.to_wire() if self.plan is not None else None]),
            "pause": self._owned(self.pause),
            "receive": self._owned(self.receive),
            "finalize": self._versioned(self.finalize),
            "resume": self._owned(self.resume),
            "swap": self._versioned(self.swap),
            "discard": self._owned(self.receiver.discard),
            "staging_room": self._owned(self.staging_room),
            "installed": self._owned(lambda request: self.held.report(InstalledRequest.from_wire(request)).to_wire()),
            "claim": self.claim,
            "release": self.lease.release,
            "health": self.health,
            "get_tensor": self.get_tensor,
            "steps": self.steps.since,
            "specs": lambda: [[s.name, s.dtype, list(s.shape)] for s in self.expected.values()],
            **self.peers.handlers(self._owned),
        }

    # --- ownership ----------------------------------------------------------------------------
    def claim(self, owner: str, lease_s: float) -> dict[str, Any]:
        """Make `owner` (a weight-sync group) this engine's only controller for `lease_s`, renewed by its calls."""
        self.lease.claim(owner, lease_s)
        return self.health()

    def _owned(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        return self.lease.owned_call(fn)

    def _versioned(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """A version change from a caller that claims no group (a library session, anyone with the token):
        at most MAX_VERSION_STEP past what the engine held, never the last version (none freezes them)."""
        step = lambda version, **params: fn(version=check_step(check_version(version, "version"), self.last_version or 0, "version"), **params)  # noqa: E731
        owned, bounded = self.lease.owned_call(fn), self.lease.owned_call(step)

        def call(owner: str | None = None, **params: Any) -> Any:
            return (owned if owner is not None else bounded)(owner=owner, **params)

        return call

    # --- engine state -------------------------------------------------------------------------
    def pause(self, mode: str) -> None:
        self.paused = mode != "none"
        if self.paused:
            self.steps.pause()

    def receive(self, digest: str, delta: dict[str, Any] | None = None, stage: str | None = None, installed: dict[str, Any] | None = None) -> dict[str, Any]:
        if stage is not None:
            return self._receive_staged(digest, delta, stage)
        check = InstalledRequest.from_wire(installed) if installed is not None else None  # answered once every byte landed
        # Until finalize the engine holds no complete version: a failure mid-stream leaves a mix (with delta, the loader runs
        # only after every patch checked out: a bad patch leaves the old weights, still marked stale because the sync did not
        # complete). A receive the receiver refuses (busy, not joined, manifest not validated) leaves the engine as it was.
        def start() -> None:
            self.stale, self.version, self.received, self.receiving = True, None, None, True

        try:
            report = self.receiver.receive(digest, self.load_bucket, self.tensors, delta=delta, on_start=start, region_loader=self.load_regions).to_dict()
        finally:
            self.receiving = False
        if check is not None:
            report["installed"] = self.held.report(check).to_wire()
        self.received = digest
        return report

    def staging_room(self, nbytes: int) -> bool:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"nbytes must be an int >= 0, got {nbytes!r:.40}")
        device = next((t.device for t in self.tensors.values()), torch.device("cpu"))
        return staging_room(nbytes, self.staging_budget_bytes, device)

    def _receive_staged(self, digest: str, delta: dict[str, Any] | None, stage: str) -> dict[str, Any]:
        """Into the staging area while the steps go on: the live weights, the version and the
        stale flag stay as they are until the swap."""
        into = self.receiver.staging_for(self.tensors, digest) if stage == "full" else None
        if into is not None:  # the loaders fill the staging copy as the buckets land
            loader: Callable[..., int] = lambda pairs: self.load_bucket(pairs, into)  # noqa: E731
            regions: Callable[..., int] = lambda items: self.load_regions(items, into)  # noqa: E731
        else:  # the loaders run at the swap, onto the live weights (a tensor onto itself is skipped)
            loader = lambda pairs: self.load_bucket(pairs, delay=False)  # noqa: E731
            regions = lambda items: self.load_regions(items, delay=False)  # noqa: E731

        def start() -> None:
            self.receiving = True

        try:
            destinations = into if into is not None else self.tensors
            report = self.receiver.receive(digest, loader, destinations, delta=delta, on_start=start, region_loader=regions, stage=stage)
        finally:
            self.receiving = False
        return report.to_dict()

    def swap(self, version: int, pause_mode: str) -> dict[str, float]:
        """Between two engine steps: apply the staged version, stamp `version`; the stall is the
        time no step could run. A failed swap leaves the engine paused and stale (as a failed
        finalize does)."""
        check_version(version, "swap version", at_least=self.last_version if self.last_version is not None else 0)
        if not self.receiver.staged:
            raise RuntimeError(f"swap({version}): no staged version (the engine holds version {self.version}); run a complete sync")
        with self.steps.lock:  # pause_mode: the reference engine has no requests to keep or abort
            t0 = time.monotonic()
            try:
                apply_s = self.receiver.swap()
            except BaseException:
                self.stale, self.version, self.paused = True, None, True
                self.steps.pause_locked()
                raise
            self.version, self.last_version, self.stale, self.received, self.paused = version, version, False, None, False
            self.peers.synced()
            self.steps.resume_locked()
            stall = time.monotonic() - t0
        return {"stall_s": stall, "apply_s": apply_s}

    def finalize(self, version: int) -> None:
        check_version(version, "finalize version", at_least=self.last_version if self.last_version is not None else 0)
        if self.received is None:
            held = "a partially loaded state" if self.stale else f"version {self.version}"
            raise RuntimeError(f"finalize({version}): no transfer completed since the last finalize (the engine holds {held}); run a complete sync")
        self.version, self.last_version, self.stale, self.received = version, version, False, None
        self.peers.synced()

    def resume(self) -> None:
        if self.stale:
            raise RuntimeError("resume: the engine holds a partially loaded state (a sync failed part-way); only a complete sync resumes it")
        self.paused = False
        self.steps.resume()

    def health(self, owner: str | None = None) -> dict[str, Any]:
        self.lease.renew(owner)
        return {
            "pid": os.getpid(),
            "version": self.version,
            "last_version": self.last_version,  # what a new version must exceed (held_version)
            "paused": self.paused,
            "stale": self.stale,
            "receiving": self.receiving,
            "buckets_received": self.receiver.buckets_received,
            "held": self.gate.held,  # a load waits on the hold file (load_gate.py)
            "owned": self.lease.owned,
            "staged": self.receiver.staged,
            "staging_copy_bytes": self.receiver.staging.nbytes,  # what the staging copy holds (the last staged dense sync's tensors)
            "delta_warmed": sorted(warmed()),  # the devices whose delta kernels this process loaded (delta.warm)
            "steps": self.steps.count,
            "group": self.receiver.group,  # the weight-sync group joined (None after a restart)
            "version_from": self.peers.version_from(self.version),  # "trainer sync" or "peer pull from <peer>"
        }

    def get_tensor(self, name: str) -> dict[str, Any]:
        t = self.tensors[name].contiguous()
        return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "data": t.reshape(-1).view(torch.uint8).numpy().tobytes()}


class TorchRefRollout(RolloutAdapter, PeerJoinable):
    """Controller handle of one reference receiver process."""

    world_size = 1
    capabilities = EngineCapabilities(delta=True, many_senders=True, regions=True, stages=True, stages_regions=True, installed=True, claims=True)

    def __init__(
        self, name: str, host: str, port: int, process: subprocess.Popen[str] | None, timeout_s: float, *, token: str | None = None
    ) -> None:
        if not isinstance(token, str) or len(token) < 8:
            raise ValueError(f"engine {name!r}: token must be the job token the receiver was started with (a string of at least 8 characters)")
        self.name = name
        self.process = process
        self.timeout_s = timeout_s
        self.token = token
        self.rpc = RpcClient(host, port, timeout_s, token=token)
        self._probe = RpcClient(host, port, timeout_s, token=token)  # health checks must not queue behind receive()
        self._sent_digest: str | None = None
        self._plans: list[ReceivePlan | None] | None = None
        self._armed: InstalledRequest | None = None  # the check the next unstaged receive answers in its reply
        self._reported: tuple[InstalledRequest, InstalledReport] | None = None
        self.owner: str | None = None
        """The weight-sync group this handle acts for (set by `claim`); sent with every state change."""

    @classmethod
    def spawn(
        cls, name: str, *, spec_file: str | None = None, model_dir: str | None = None, dtype: str = "float32", load_delay_s: float = 0.0,
        timeout_s: float = 120.0, token: str | None = None, port: int = 0, layout: dict[str, int] | None = None,
        staging_budget_bytes: int | None = None, step_interval_s: float | None = None,
    ) -> TorchRefRollout:
        """Start a receiver process holding zeros of `spec_file`'s tensors or a fresh HF model.

        `token` is the job token its control port will demand (a daemon that registers it must
        hold the same one); by default a fresh random one known only to this handle. `port`: its
        control port (0: a free one; an engine restarted at its address passes the old one).
        `layout`: run as one rank of a TP / EP engine holding only its slices (tp_size, tp_rank,
        ep_size, ep_rank, num_kv_heads; see `planning.tp_ep.tp_ep_plan`; fused_experts=1 holds
        experts stacked). `staging_budget_bytes`: the most a dense staging copy may take (None: the free
        memory decides). `step_interval_s`: run engine steps (`ref_steps.py`) this far apart (None: no steps)."""
        if (spec_file is None) == (model_dir is None):
            raise ValueError("give exactly one of spec_file or model_dir")
        token = token if token is not None else secrets.token_hex(16)
        cmd = [sys.executable, "-m", "ckpt_engine.rollout_adapters.torch_ref", "--load-delay-s", str(load_delay_s), "--port", str(port)]
        cmd += ["--spec-file", spec_file] if spec_file else ["--model-dir", str(model_dir), "--dtype", dtype]
        if staging_budget_bytes is not None:
            cmd += ["--staging-budget-bytes", str(int(staging_budget_bytes))]
        if step_interval_s is not None:
            cmd += ["--step-interval-s", str(float(step_interval_s))]
        for key, value in (layout or {}).items():
            if key not in _LAYOUT_KEYS or not isinstance(value, int):
                raise ValueError(f"layout keys are {', '.join(_LAYOUT_KEYS)} with int values, got {key}={value!r}")
            cmd += [f"--{key.replace('_', '-')}", str(value)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, TOKEN_ENV: token})
        port = int(read_ready_line(proc, READY_PREFIX, f"reference receiver {name!r}", timeout_s))
        return cls(name, "127.0.0.1", port, proc, timeout_s, token=token)

    def _call(self, method: str, timeout_s: float | None = None, **params: Any) -> Any:
        if self.owner is not None:
            params["owner"] = self.owner
        return self.rpc.call(method, timeout_s=timeout_s, **params)

    peer_rpc = _call

    def claim(self, owner: str, lease_s: float) -> dict[str, Any]:
        """Take the engine for weight-sync group `owner`; refused while another group holds it."""
        health = self.rpc.call("claim", owner=owner, lease_s=lease_s)
        self.owner = owner
        return health

    def release(self) -> None:
        """Let the engine go (another group may claim it); quick even if a call is still in flight."""
        owner, self.owner = self.owner, None
        if owner is not None:
            self._probe.call("release", timeout_s=min(self.timeout_s, 5.0), owner=owner)

    def join(self, rendezvous: Rendezvous, rank_offset: int, options: JoinOptions) -> None:
        self._sent_digest = None
        self._plans = None  # stated anew at every join
        self._call("join", rendezvous=rendezvous.to_dict(), rank=rank_offset, options=options.to_dict())

    def receive_plans(self) -> list[ReceivePlan | None]:
        if self._plans is None:
            (raw,) = self._call("receive_plans")
            self._plans = [ReceivePlan.from_wire(raw) if raw is not None else None]
        return self._plans

    def validate_regions(self, manifest: BucketManifest, encoded: bytes, assignments: list[bytes]) -> None:
        (regions,) = assignments
        self.validate(manifest, encoded, regions)

    def validate(self, manifest: BucketManifest, encoded: bytes, regions: bytes | None = None) -> None:
        # Send only the digest when this engine already holds the manifest.
        send = None if self._sent_digest == manifest.digest else encoded
        extra: dict[str, Any] = {"regions": regions} if regions is not None else {}
        reply = self._call("validate", encoded=send, digest=manifest.digest, **extra)
        if reply.get("need_manifest"):
            reply = self._call("validate", encoded=encoded, digest=manifest.digest, **extra)
        if not reply.get("accepted"):
            raise ManifestRejectedError(self.name, list(reply.get("problems") or ["rejected"]))
        self._sent_digest = manifest.digest

    def pause(self, mode: str) -> None:
        self._call("pause", mode=mode)

    def arm_installed(self, request: InstalledRequest) -> None:
        """The check rides on the next unstaged receive: answered in its reply (staged: asked after the swap)."""
        self._armed, self._reported = request, None

    def receive(self, manifest: BucketManifest, delta: DeltaRequest | None = None, *, stage: str | None = None) -> ReceiveReport:
        extra: dict[str, Any] = {"delta": delta.to_dict()} if delta is not None else {}
        armed, self._armed = self._armed, None
        extra.update({"stage": stage} if stage is not None else {"installed": armed.to_wire()} if armed is not None else {})
        reply = self._call("receive", timeout_s=self.timeout_s * 2, digest=manifest.digest, **extra)
        if "installed" in extra:
            self._reported = (armed, InstalledReport.from_wire(reply.pop("installed")))  # type: ignore[arg-type]
        return ReceiveReport.from_dict(reply)

    def staging_room(self, nbytes: int) -> bool:
        return bool(self._call("staging_room", nbytes=int(nbytes)))

    def swap(self, version: int, pause_mode: str) -> float:
        return float(self._call("swap", version=version, pause_mode=pause_mode)["stall_s"])

    def discard(self) -> None:
        # On the probe's connection: a discard must not queue behind a receive still in flight
        # (that receive then keeps nothing, `WeightReceiver.discard`).
        params = {"owner": self.owner} if self.owner is not None else {}
        self._probe.call("discard", timeout_s=min(self.timeout_s, 10.0), **params)

    def steps(self, since: int = 0) -> list[tuple[int, float, float, int | None, str]]:
        """The engine's step records from step `since` on: (index, start, end, version, weights digest)."""
        return [tuple(r) for r in self.rpc.call("steps", index=since)]

    def installed_digests(self, request: InstalledRequest) -> list[InstalledReport]:
        if self._reported is not None and self._reported[0] is request:  # answered with the receive
            return [self._reported[1]]
        return [InstalledReport.from_wire(self._call("installed", timeout_s=self.timeout_s * 2, request=request.to_wire()))]

    def finalize(self, version: int) -> None:
        self._call("finalize", version=version)

    def resume(self) -> None:
        self._call("resume")

    def health(self) -> dict[str, Any]:
        if self.process is not None and self.process.poll() is not None:
            raise RuntimeError(f"engine {self.name!r} process exited with code {self.process.returncode}")
        params = {"owner": self.owner} if self.owner is not None else {}
        return self._probe.call("health", timeout_s=min(self.timeout_s, 5.0), **params)

    def membership(self) -> Membership:
        health = self.health()
        return Membership(held_in(health), [health["group"] if isinstance(health.get("group"), str) else None])

    def leave(self) -> None:
        self._call("leave")

    def get_tensor(self, name: str) -> torch.Tensor:
        d = self.rpc.call("get_tensor", name=name)  # a read: no owner (the engine's get_tensor takes none)
        raw = torch.tensor(list(d["data"]), dtype=torch.uint8) if not d["data"] else torch.frombuffer(bytearray(d["data"]), dtype=torch.uint8)
        return raw.view(getattr(torch, d["dtype"])).reshape(d["shape"])

    def close(self) -> None:
        self.rpc.close()
        self._probe.close()
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


_LAYOUT_KEYS = ("tp_size", "tp_rank", "ep_size", "ep_rank", "num_kv_heads", "fused_experts")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="ckpt-engine reference receiver process")
    p.add_argument("--spec-file")
    p.add_argument("--model-dir")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--load-delay-s", type=float, default=0.0, help="sleep per bucket (emulates a slow loader)")
    p.add_argument("--port", type=int, default=0, help="control port (0: a free one)")
    p.add_argument("--staging-budget-bytes", type=int, default=None, help="cap on a dense staging copy (default: free memory)")
    p.add_argument("--step-interval-s", type=float, default=None, help="run engine steps this far apart (default: none)")
    for key in _LAYOUT_KEYS:
        p.add_argument(f"--{key.replace('_', '-')}", type=int, default=None, help="hold only this TP / EP rank's slices (see tp_ep_plan)")
    args = p.parse_args(argv)
    logging.basicConfig(level=os.environ.get("CKPT_ENGINE_LOG", "WARNING"))
    token = os.environ.pop(TOKEN_ENV, "")
    if len(token) < 8:
        print(f"ckpt-engine reference receiver: set {TOKEN_ENV} to the job token (at least 8 characters)", file=sys.stderr)
        sys.exit(2)
    layout = {k: getattr(args, k) for k in _LAYOUT_KEYS if getattr(args, k) is not None}
    kw = {"load_delay_s": args.load_delay_s, "staging_budget_bytes": args.staging_budget_bytes, "step_interval_s": args.step_interval_s}
    model = RefModel.from_spec_file(args.spec_file, layout) if args.spec_file else RefModel.from_hf_config(args.model_dir, args.dtype, layout)
    worker = TorchRefWorker.of(model, **kw)
    server = RpcServer(worker.handlers(), token=token, port=args.port).start()
    print(f"{READY_PREFIX}{server.port}", flush=True)
    parent = os.getppid()
    while os.getppid() == parent:  # exit when the parent goes away (stdin is not used)
        threading.Event().wait(1.0)


if __name__ == "__main__":
    main()
