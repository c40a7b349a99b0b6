"""Reference receiver: a plain torch state dict (or HF `transformers` model) in its own process.

For tests, benchmarks and users without an inference engine. `TorchRefRollout.spawn(...)` starts
`python -m ckpt_engine.rollout_adapters.torch_ref`, which serves the receiver over the msgpack RPC
of `ckpt_engine.wire` and loads every bucket into its tensors with one batched copy.
"""

from __future__ import annotations

import argparse
import logging
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import msgpack
import torch

from ckpt_engine.copies import batched_copy_
from ckpt_engine.engine import Rendezvous
from ckpt_engine.manifest import BucketManifest, TensorSpec
from ckpt_engine.rollout_adapters.base import JoinOptions, ManifestRejectedError, ReceiveReport, RolloutAdapter
from ckpt_engine.rollout_adapters.receiver import WeightReceiver
from ckpt_engine.weights import spec_of
from ckpt_engine.wire import RpcClient, RpcServer

__all__ = ["TorchRefRollout", "TorchRefWorker", "load_spec_file", "write_spec_file"]

logger = logging.getLogger(__name__)

READY_PREFIX = "CKPT_ENGINE_READY port="


def write_spec_file(path: str | os.PathLike[str], specs: list[TensorSpec]) -> None:
    Path(path).write_bytes(msgpack.packb([[s.name, s.dtype, list(s.shape)] for s in specs], use_bin_type=True))


def load_spec_file(path: str | os.PathLike[str]) -> list[TensorSpec]:
    raw = msgpack.unpackb(Path(path).read_bytes(), raw=False, max_ext_len=0)
    if not isinstance(raw, list):
        raise ValueError(f"{path}: a spec file holds a list of [name, dtype, shape]")
    return [TensorSpec(n, d, tuple(s)) for n, d, s in raw]


class TorchRefWorker:
    """The receiving process: its tensors, its receiver, its weight version."""

    def __init__(self, tensors: dict[str, torch.Tensor], model: torch.nn.Module | None = None, load_delay_s: float = 0.0) -> None:
        self.tensors = tensors
        self.model = model
        self.load_delay_s = load_delay_s
        self.receiver = WeightReceiver()
        self.version: int | None = None
        self.paused = False
        self.stale = False
        self.expected = {n: spec_of(n, t) for n, t in tensors.items()}

    @classmethod
    def from_spec_file(cls, path: str, **kw: Any) -> TorchRefWorker:
        tensors = {s.name: torch.zeros(s.shape, dtype=getattr(torch, s.dtype)) for s in load_spec_file(path)}
        return cls(tensors, **kw)

    @classmethod
    def from_hf_config(cls, model_dir: str, dtype: str, **kw: Any) -> TorchRefWorker:
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(model_dir)
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
        if self.load_delay_s:
            time.sleep(self.load_delay_s)
        batched_copy_([self.tensors[n] for n, _ in pairs], [t for _, t in pairs])
        return len(pairs)

    # --- RPC handlers (plain msgpack types in and out) ----------------------------------------
    def handlers(self) -> dict[str, Any]:
        return {
            "join": lambda rendezvous, rank, options: self.receiver.join(rendezvous, rank, options),
            "leave": self.receiver.leave,
            "validate": lambda encoded, digest: self.receiver.validate(encoded, digest, self.expected),
            "pause": self.pause,
            "receive": self.receive,
            "finalize": self.finalize,
            "resume": self.resume,
            "health": self.health,
            "get_tensor": self.get_tensor,
            "specs": lambda: [[s.name, s.dtype, list(s.shape)] for s in self.expected.values()],
        }

    def pause(self, mode: str) -> None:
        self.paused = mode != "none"

    def receive(self, digest: str) -> dict[str, Any]:
        self.stale = True  # until finalize: a failure mid-stream leaves a half-new state
        return self.receiver.receive(digest, self.load_bucket, self.tensors).to_dict()

    def finalize(self, version: int) -> None:
        self.version, self.stale = version, False

    def resume(self) -> None:
        self.paused = False

    def health(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "version": self.version,
            "paused": self.paused,
            "stale": self.stale,
            "buckets_received": self.receiver.buckets_received,
        }

    def get_tensor(self, name: str) -> dict[str, Any]:
        t = self.tensors[name].contiguous()
        return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "data": t.reshape(-1).view(torch.uint8).numpy().tobytes()}


class TorchRefRollout(RolloutAdapter):
    """Controller handle of one reference receiver process."""

    world_size = 1

    def __init__(self, name: str, host: str, port: int, process: subprocess.Popen[str] | None, timeout_s: float) -> None:
        self.name = name
        self.process = process
        self.timeout_s = timeout_s
        self.rpc = RpcClient(host, port, timeout_s)
        self._probe = RpcClient(host, port, timeout_s)  # health checks must not queue behind receive()
        self._sent_digest: str | None = None

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
    ) -> TorchRefRollout:
        """Start a receiver process holding zeros of `spec_file`'s tensors or a fresh HF model."""
        if (spec_file is None) == (model_dir is None):
            raise ValueError("give exactly one of spec_file or model_dir")
        cmd = [sys.executable, "-m", "ckpt_engine.rollout_adapters.torch_ref", "--load-delay-s", str(load_delay_s)]
        cmd += ["--spec-file", spec_file] if spec_file else ["--model-dir", str(model_dir), "--dtype", dtype]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        port = _read_ready_port(proc, name, timeout_s)
        return cls(name, "127.0.0.1", port, proc, timeout_s)

    def _call(self, method: str, timeout_s: float | None = None, **params: Any) -> Any:
        return self.rpc.call(method, timeout_s=timeout_s, **params)

    def join(self, rendezvous: Rendezvous, rank_offset: int, options: JoinOptions) -> None:
        self._sent_digest = None
        self._call("join", rendezvous=rendezvous.to_dict(), rank=rank_offset, options=options.to_dict())

    def validate(self, manifest: BucketManifest, encoded: bytes) -> None:
        # Send only the digest when this engine already holds the manifest.
        send = None if self._sent_digest == manifest.digest else encoded
        reply = self._call("validate", encoded=send, digest=manifest.digest)
        if reply.get("need_manifest"):
            reply = self._call("validate", encoded=encoded, digest=manifest.digest)
        if not reply.get("accepted"):
            raise ManifestRejectedError(self.name, list(reply.get("problems") or ["rejected"]))
        self._sent_digest = manifest.digest

    def pause(self, mode: str) -> None:
        self._call("pause", mode=mode)

    def receive(self, manifest: BucketManifest) -> ReceiveReport:
        return ReceiveReport.from_dict(self._call("receive", timeout_s=self.timeout_s * 2, digest=manifest.digest))

    def finalize(self, version: int) -> None:
        self._call("finalize", version=version)

    def resume(self) -> None:
        self._call("resume")

    def health(self) -> dict[str, Any]:
        if self.process is not None and self.process.poll() is not None:
            raise RuntimeError(f"engine {self.name!r} process exited with code {self.process.returncode}")
        return self._probe.call("health", timeout_s=min(self.timeout_s, 5.0))

    def leave(self) -> None:
        self._call("leave")

    def get_tensor(self, name: str) -> torch.Tensor:
        d = self._call("get_tensor", name=name)
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
    args = p.parse_args(argv)
    logging.basicConfig(level=os.environ.get("CKPT_ENGINE_LOG", "WARNING"))
    if args.spec_file:
        worker = TorchRefWorker.from_spec_file(args.spec_file, load_delay_s=args.load_delay_s)
    else:
        worker = TorchRefWorker.from_hf_config(args.model_dir, args.dtype, load_delay_s=args.load_delay_s)
    server = RpcServer(worker.handlers()).start()
    print(f"{READY_PREFIX}{server.port}", flush=True)
    # Exit when the parent goes away (stdin is not used; poll the parent pid).
    parent = os.getppid()
    while os.getppid() == parent:
        threading.Event().wait(1.0)


if __name__ == "__main__":
    main()
