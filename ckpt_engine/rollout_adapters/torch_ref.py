"""Reference receiver: a plain torch state dict (or HF `transformers` model) in its own process.

For tests, benchmarks and users without an inference engine. `TorchRefRollout.spawn(...)` starts
`python -m ckpt_engine.rollout_adapters.torch_ref`, which serves the receiver on a control port
(`ckpt_engine.control.server`: the job token it was started with, the daemon's limits) and loads
every bucket into its tensors with one batched copy.

Two guards keep a half-written engine from serving:
- `version` is the last version the engine holds *completely*: a transfer clears it until
  `finalize`, and `finalize` is refused unless a transfer completed since the last one; `resume`
  is refused while the engine is stale (only a complete sync resumes it).
- An engine belongs to one weight-sync group at a time: `claim(owner, lease_s)` by a daemon makes
  every state-changing call from anyone else fail until the owner releases it or stops renewing
  the lease (any call from the owner, including health probes, renews it).
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import torch

from ckpt_engine.copies import batched_copy_
from ckpt_engine.delta.request import DeltaRequest
from ckpt_engine.transports.base import Rendezvous
from ckpt_engine.manifest import BucketManifest, TensorSpec
from ckpt_engine.planning.fused_experts import fuse_specs
from ckpt_engine.planning.receive_sets import cut_region
from ckpt_engine.planning.regions import ReceivePlan, Region
from ckpt_engine.planning.tp_ep import tp_ep_plan
from ckpt_engine.rollout_adapters.base import JoinOptions, ManifestRejectedError, ReceiveReport, RolloutAdapter
from ckpt_engine.rollout_adapters.receiver import WeightReceiver
from ckpt_engine.control.server import ControlLimits, RpcServer
from ckpt_engine.versions import check_version
from ckpt_engine.sources.base import spec_of
from ckpt_engine.control.wire import RpcClient

__all__ = ["TorchRefRollout", "TorchRefWorker", "load_spec_file", "write_spec_file"]

logger = logging.getLogger(__name__)

READY_PREFIX = "CKPT_ENGINE_READY port="
TOKEN_ENV = "CKPT_ENGINE_TOKEN"
"""The job token reaches a spawned receiver through its environment, never its command line."""
DEFAULT_LEASE_S = 60.0


def write_spec_file(path: str | os.PathLike[str], specs: list[TensorSpec]) -> None:
    Path(path).write_bytes(msgpack.packb([[s.name, s.dtype, list(s.shape)] for s in specs], use_bin_type=True))


def load_spec_file(path: str | os.PathLike[str]) -> list[TensorSpec]:
    raw = msgpack.unpackb(Path(path).read_bytes(), raw=False, max_ext_len=0)
    if not isinstance(raw, list):
        raise ValueError(f"{path}: a spec file holds a list of [name, dtype, shape]")
    return [TensorSpec(n, d, tuple(s)) for n, d, s in raw]


class TorchRefWorker:
    """The receiving process: its tensors, its receiver, its weight version.

    As one rank of a TP / EP engine (`sharded`) it holds only its slices (`planning/tp_ep.py`):
    its tensors have the slices' shapes, and it states that plan at join."""

    def __init__(
        self, tensors: dict[str, torch.Tensor], model: torch.nn.Module | None = None, load_delay_s: float = 0.0,
        plan: ReceivePlan | None = None, expected: dict[str, TensorSpec] | None = None,
    ) -> None:
        self.tensors = tensors
        self.model = model
        self.load_delay_s = load_delay_s
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
        self._received: str | None = None
        """Digest of the transfer that completed since the last finalize (None: none did)."""
        self.expected = expected if expected is not None else {n: spec_of(n, t) for n, t in tensors.items()}
        self._own_lock = threading.Lock()
        self.owner: str | None = None
        self._lease_until = 0.0
        self._lease_s = DEFAULT_LEASE_S

    @classmethod
    def sharded(cls, specs: list[TensorSpec], layout: dict[str, int], **kw: Any) -> TorchRefWorker:
        """A TP / EP rank of the model `specs` (global shapes): zeros of its slices. `layout`:
        tp_size, tp_rank, ep_size, ep_rank, num_kv_heads (see `tp_ep_plan`); fused_experts=1: it
        holds each layer's experts stacked (`planning/fused_experts.py`), as vLLM's w13/w2 do."""
        layout = dict(layout)
        if layout.pop("fused_experts", 0):
            specs = fuse_specs(specs)[0]
        plan = tp_ep_plan(specs, **layout)
        if plan is None:
            return cls({s.name: torch.zeros(s.shape, dtype=getattr(torch, s.dtype)) for s in specs}, **kw)
        tensors = {}
        for s in specs:
            if s.name in plan.holds:
                rs = plan.holds[s.name]
                shape = cut_region(torch.empty(s.shape, device="meta"), rs[0] if rs is not None else None).shape
                tensors[s.name] = torch.zeros(shape, dtype=getattr(torch, s.dtype))
        return cls(tensors, plan=plan, expected={s.name: s for s in specs}, **kw)

    @classmethod
    def from_spec_file(cls, path: str, layout: dict[str, int] | None = None, **kw: Any) -> TorchRefWorker:
        if layout:
            return cls.sharded(load_spec_file(path), layout, **kw)
        tensors = {s.name: torch.zeros(s.shape, dtype=getattr(torch, s.dtype)) for s in load_spec_file(path)}
        return cls(tensors, **kw)

    @classmethod
    def from_hf_config(cls, model_dir: str, dtype: str, layout: dict[str, int] | None = None, **kw: Any) -> TorchRefWorker:
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(model_dir)
        if layout:
            with torch.device("meta"):
                meta = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
            specs, seen = [], set()
            for name, t in meta.state_dict().items():  # tied weights once, under their first name
                if id(t) not in seen:
                    seen.add(id(t))
                    specs.append(spec_of(name, t))
            kv = getattr(config, "num_key_value_heads", None)
            return cls.sharded(specs, {"num_kv_heads": kv, **layout} if kv is not None else layout, **kw)
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
        tensors: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for name, t in model.state_dict().items():  # tied weights appear once, under their first name
            if t.data_ptr() in seen and t.numel():
                continue
            seen.add(t.data_ptr())
            tensors[name] = t
        return cls(tensors, model=model, **kw)

    def load_bucket(self, pairs: list[tuple[str, torch.Tensor]]) -> int:
        """Whole tensors (a sync without region delivery): a sharded rank keeps its slices."""
        if self.load_delay_s:
            time.sleep(self.load_delay_s)
        if self.plan is not None:
            pairs = [(n, cut_region(t, self.regions[n])) for n, t in pairs if n in self.regions]
        batched_copy_([self.tensors[n] for n, _ in pairs], [t for _, t in pairs])
        return len(pairs)

    def load_regions(self, items: list[tuple[str, Region | None, torch.Tensor]]) -> int:
        """Region delivery: each item is one of this rank's regions, in the region's shape."""
        if self.load_delay_s:
            time.sleep(self.load_delay_s)
        batched_copy_([self.tensors[n] for n, _, _ in items], [t for _, _, t in items])
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
            "finalize": self._owned(self.finalize),
            "resume": self._owned(self.resume),
            "claim": self.claim,
            "release": self.release,
            "health": self.health,
            "get_tensor": self.get_tensor,
            "specs": lambda: [[s.name, s.dtype, list(s.shape)] for s in self.expected.values()],
        }

    # --- ownership ----------------------------------------------------------------------------
    def claim(self, owner: str, lease_s: float) -> dict[str, Any]:
        """Make `owner` (a weight-sync group) this engine's only controller for `lease_s`, renewed by its calls."""
        if not isinstance(owner, str) or not 0 < len(owner) <= 128:
            raise ValueError(f"owner must be a non-empty string of at most 128 characters, got {owner!r:.40}")
        if isinstance(lease_s, bool) or not isinstance(lease_s, (int, float)) or not 0 < lease_s <= 86400:
            raise ValueError(f"lease_s must be a number in (0, 86400], got {lease_s!r:.40}")
        with self._own_lock:
            self._check_owner_locked(owner)
            self.owner, self._lease_s = owner, float(lease_s)
            self._lease_until = time.monotonic() + self._lease_s
        return self.health()

    def release(self, owner: str) -> bool:
        with self._own_lock:
            if self.owner is None or owner != self.owner:
                return False
            self.owner = None
            return True

    def _check_owner_locked(self, owner: str | None) -> None:
        now = time.monotonic()
        if self.owner is not None and now < self._lease_until and owner != self.owner:
            who = "a caller that names no group" if owner is None else f"group {owner[:16]}"
            raise PermissionError(
                f"engine belongs to weight-sync group {self.owner[:16]} (another job or daemon); refusing {who}. "
                f"It is released when that group lets it go (leave/close) or {self._lease_until - now:.0f}s after that group was last heard from"
            )
        if owner is not None:  # the owner's calls renew its lease; an unowned engine is claimed by its first caller
            self.owner, self._lease_until = owner, now + self._lease_s

    def _owned(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(owner: str | None = None, **params: Any) -> Any:
            with self._own_lock:
                self._check_owner_locked(owner)
            return fn(**params)

        return call

    # --- engine state -------------------------------------------------------------------------
    def pause(self, mode: str) -> None:
        self.paused = mode != "none"

    def receive(self, digest: str, delta: dict[str, Any] | None = None) -> dict[str, Any]:
        # Until finalize the engine holds no complete version: a failure mid-stream leaves a mix
        # (with delta, the loader runs only after every patch checked out: a bad patch leaves the
        # old weights, still marked stale because the sync did not complete). A receive the
        # receiver refuses (busy, not joined, manifest not validated) leaves the engine as it was.
        def start() -> None:
            self.stale, self.version, self._received, self.receiving = True, None, None, True

        try:
            report = self.receiver.receive(
                digest, self.load_bucket, self.tensors, delta=delta, on_start=start, region_loader=self.load_regions
            ).to_dict()
        finally:
            self.receiving = False
        self._received = digest
        return report

    def finalize(self, version: int) -> None:
        check_version(version, "finalize version", at_least=self.last_version if self.last_version is not None else 0)
        if self._received is None:
            held = "a partially loaded state" if self.stale else f"version {self.version}"
            raise RuntimeError(f"finalize({version}): no transfer completed since the last finalize (the engine holds {held}); run a complete sync")
        self.version, self.last_version, self.stale, self._received = version, version, False, None

    def resume(self) -> None:
        if self.stale:
            raise RuntimeError("resume: the engine holds a partially loaded state (a sync failed part-way); only a complete sync resumes it")
        self.paused = False

    def health(self, owner: str | None = None) -> dict[str, Any]:
        if owner is not None:
            with self._own_lock:
                if owner == self.owner:
                    self._lease_until = time.monotonic() + self._lease_s
        return {
            "pid": os.getpid(),
            "version": self.version,
            "last_version": self.last_version,  # what a new version must exceed (held_version)
            "paused": self.paused,
            "stale": self.stale,
            "receiving": self.receiving,
            "buckets_received": self.receiver.buckets_received,
            "owned": self.owner is not None and time.monotonic() < self._lease_until,
        }

    def get_tensor(self, name: str) -> dict[str, Any]:
        t = self.tensors[name].contiguous()
        return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "data": t.reshape(-1).view(torch.uint8).numpy().tobytes()}


class TorchRefRollout(RolloutAdapter):
    """Controller handle of one reference receiver process."""

    world_size = 1
    supports_delta = True
    supports_many_senders = True
    takes_regions = True

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
        self.owner: str | None = None
        """The weight-sync group this handle acts for (set by `claim`); sent with every state change."""

    @classmethod
    def spawn(
        cls,
        name: str,
        *,
        spec_file: str | None = None,
        model_dir: str | None = None,
        dtype: str = "float32",
        load_delay_s: float = 0.0,
        timeout_s: float = 120.0,
        token: str | None = None,
        port: int = 0,
        layout: dict[str, int] | None = None,
    ) -> TorchRefRollout:
        """Start a receiver process holding zeros of `spec_file`'s tensors or a fresh HF model.

        `token` is the job token its control port will demand (a daemon that registers it must
        hold the same one); by default a fresh random one known only to this handle. `port`: its
        control port (0: a free one; an engine restarted at its address passes the old one).
        `layout`: run as one rank of a TP / EP engine holding only its slices (tp_size, tp_rank,
        ep_size, ep_rank, num_kv_heads; see `planning.tp_ep.tp_ep_plan`; fused_experts=1 holds experts stacked)."""
        if (spec_file is None) == (model_dir is None):
            raise ValueError("give exactly one of spec_file or model_dir")
        token = token if token is not None else secrets.token_hex(16)
        cmd = [sys.executable, "-m", "ckpt_engine.rollout_adapters.torch_ref", "--load-delay-s", str(load_delay_s), "--port", str(port)]
        cmd += ["--spec-file", spec_file] if spec_file else ["--model-dir", str(model_dir), "--dtype", dtype]
        for key, value in (layout or {}).items():
            if key not in _LAYOUT_KEYS or not isinstance(value, int):
                raise ValueError(f"layout keys are {', '.join(_LAYOUT_KEYS)} with int values, got {key}={value!r}")
            cmd += [f"--{key.replace('_', '-')}", str(value)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, TOKEN_ENV: token})
        port = _read_ready_port(proc, name, timeout_s)
        return cls(name, "127.0.0.1", port, proc, timeout_s, token=token)

    def _call(self, method: str, timeout_s: float | None = None, **params: Any) -> Any:
        if self.owner is not None:
            params["owner"] = self.owner
        return self.rpc.call(method, timeout_s=timeout_s, **params)

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
        extra = {"regions": regions} if regions is not None else {}
        reply = self._call("validate", encoded=send, digest=manifest.digest, **extra)
        if reply.get("need_manifest"):
            reply = self._call("validate", encoded=encoded, digest=manifest.digest, **extra)
        if not reply.get("accepted"):
            raise ManifestRejectedError(self.name, list(reply.get("problems") or ["rejected"]))
        self._sent_digest = manifest.digest

    def pause(self, mode: str) -> None:
        self._call("pause", mode=mode)

    def receive(self, manifest: BucketManifest, delta: DeltaRequest | None = None) -> ReceiveReport:
        extra = {"delta": delta.to_dict()} if delta is not None else {}
        return ReceiveReport.from_dict(self._call("receive", timeout_s=self.timeout_s * 2, digest=manifest.digest, **extra))

    def finalize(self, version: int) -> None:
        self._call("finalize", version=version)

    def resume(self) -> None:
        self._call("resume")

    def health(self) -> dict[str, Any]:
        if self.process is not None and self.process.poll() is not None:
            raise RuntimeError(f"engine {self.name!r} process exited with code {self.process.returncode}")
        params = {"owner": self.owner} if self.owner is not None else {}
        return self._probe.call("health", timeout_s=min(self.timeout_s, 5.0), **params)

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


def _read_ready_port(proc: subprocess.Popen[str], name: str, timeout_s: float) -> int:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            line = proc.stdout.readline()
            if line.startswith(READY_PREFIX):
                return int(line[len(READY_PREFIX) :].strip())
            if not line and proc.poll() is not None:
                break
        elif proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError(f"reference receiver {name!r} did not start within {timeout_s}s (exit code {proc.poll()})")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="ckpt-engine reference receiver process")
    p.add_argument("--spec-file")
    p.add_argument("--model-dir")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--load-delay-s", type=float, default=0.0, help="sleep per bucket (emulates a slow loader)")
    p.add_argument("--port", type=int, default=0, help="control port (0: a free one)")
    for key in _LAYOUT_KEYS:
        p.add_argument(f"--{key.replace('_', '-')}", type=int, default=None, help="hold only this TP / EP rank's slices (see tp_ep_plan)")
    args = p.parse_args(argv)
    logging.basicConfig(level=os.environ.get("CKPT_ENGINE_LOG", "WARNING"))
    token = os.environ.pop(TOKEN_ENV, "")
    if len(token) < 8:
        print(f"ckpt-engine reference receiver: set {TOKEN_ENV} to the job token (at least 8 characters)", file=sys.stderr)
        sys.exit(2)
    layout = {k: getattr(args, k) for k in _LAYOUT_KEYS if getattr(args, k) is not None}
    if args.spec_file:
        worker = TorchRefWorker.from_spec_file(args.spec_file, layout, load_delay_s=args.load_delay_s)
    else:
        worker = TorchRefWorker.from_hf_config(args.model_dir, args.dtype, layout, load_delay_s=args.load_delay_s)
    server = RpcServer(worker.handlers(), token=token, limits=ControlLimits(), port=args.port).start()
    print(f"{READY_PREFIX}{server.port}", flush=True)
    # Exit when the parent goes away (stdin is not used; poll the parent pid).
    parent = os.getppid()
    while os.getppid() == parent:
        threading.Event().wait(1.0)


if __name__ == "__main__":
    main()
