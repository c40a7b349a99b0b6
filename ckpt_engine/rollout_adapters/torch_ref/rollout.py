"""Reference receiver: a plain torch state dict (or HF `transformers` model) in its own process.

For tests, benchmarks and users without an inference engine. `TorchRefRollout.spawn(...)` starts
`python -m ckpt_engine.rollout_adapters.torch_ref` (`serve.py`), which serves the receiver on a control port
(`ckpt_engine.control.server`: the job token it was started with, the daemon's limits) and loads
every bucket into its tensors with one batched copy.

Two guards keep a half-written engine from serving:
- `version` is the last version the engine holds *completely*: a transfer clears it until
  `finalize`, and `finalize` is refused unless a transfer completed since the last one; `resume`
  is refused while the engine is stale (only a complete sync resumes it).
- An engine belongs to one weight-sync group at a time (`rollout_adapters/engine_lease.py`).

Staged syncs (issue 28): it stages (`receive(stage=...)`, `swap`, `discard`), with room for a
dense staging copy up to `--staging-budget-mb` (and the free memory), and, with
`--step-interval-s`, runs "engine steps" (`steps.py`) that read every weight under the step
lock while the next version streams in; the swap takes that lock between two steps.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from collections.abc import Hashable
from typing import Any

import torch

from ckpt_engine.delta.request import DeltaRequest
from ckpt_engine.elastic.join import PeerJoinable
from ckpt_engine.engine import Rendezvous
from ckpt_engine.installed import InstalledReport, InstalledRequest
from ckpt_engine.manifest import BucketManifest
from ckpt_engine.planning.regions import ReceivePlan
from ckpt_engine.rollout_adapters.base import JoinOptions, ManifestRejectedError, Membership, ReceiveReport, RolloutAdapter, held_in
from ckpt_engine.rollout_adapters.capabilities import EngineCapabilities
from ckpt_engine.control.wire import RpcClient
from ckpt_engine.readable import readable
from ckpt_engine.rollout_adapters.torch_ref.serve import READY_PREFIX, TOKEN_ENV, arguments

__all__ = ["TorchRefRollout"]


class TorchRefRollout(RolloutAdapter, PeerJoinable):
    """Controller handle of one reference receiver process."""

    world_size = 1
    capabilities = EngineCapabilities(
        delta=True, many_senders=True, regions=True, stages=True, stages_regions=True, installed=True, claims=True, bounded_calls=True,
    )

    def __init__(
        self, name: str, host: str, port: int, process: subprocess.Popen[str] | None, timeout_s: float, *, token: str | None = None
    ) -> None:
        if not isinstance(token, str) or len(token) < 8:
            raise ValueError(f"engine {name!r}: token must be the job token the receiver was started with (a string of at least 8 characters)")
        self.name = name
        self.process = process
        self.timeout_s: float = timeout_s
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
        memory decides). `step_interval_s`: run engine steps (`steps.py`) this far apart (None: no steps)."""
        argv = arguments(
            spec_file=spec_file, model_dir=model_dir, dtype=dtype, load_delay_s=load_delay_s, port=port,
            staging_budget_bytes=staging_budget_bytes, step_interval_s=step_interval_s, layout=layout,
        )
        token = token if token is not None else secrets.token_hex(16)
        cmd = [sys.executable, "-m", "ckpt_engine.rollout_adapters.torch_ref", *argv]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, TOKEN_ENV: token})
        port = int(read_ready_line(proc, READY_PREFIX, f"reference receiver {name!r}", timeout_s))
        return cls(name, "127.0.0.1", port, proc, timeout_s, token=token)

    def engine_key(self) -> Hashable:
        """The receiver's control address: handles rebuilt on it (every step, or by a daemon) drive one
        engine, so a session, its group and its delta chain carry on, and claims see one engine."""
        return ("torch_ref", self.rpc.host, self.rpc.port)

    def take_over(self, previous: RolloutAdapter) -> None:
        """The manifest the engine holds, its receive plans and the group it acts for."""
        if isinstance(previous, TorchRefRollout):
            self._sent_digest, self._plans, self.owner = previous._sent_digest, previous._plans, previous.owner

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
            assert armed is not None  # "installed" is sent only for an armed check
            self._reported = (armed, InstalledReport.from_wire(reply.pop("installed")))
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


def read_ready_line(proc: subprocess.Popen[str], prefix: str, what: str, timeout_s: float) -> str:
    """What follows `prefix` on the first line of `proc`'s stdout that starts with it (a child
    announcing it is ready); kills the child and raises naming `what` if none comes within
    `timeout_s` or the child exits first."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if readable(proc.stdout, 0.5):
            line = proc.stdout.readline()
            if line.startswith(prefix):
                return line[len(prefix) :].strip()
            if not line and proc.poll() is not None:
                break
        elif proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError(f"{what} did not start within {timeout_s}s (exit code {proc.poll()})")
