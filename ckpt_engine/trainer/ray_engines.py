"""A real vLLM engine as a Ray actor: in-process `vllm.LLM` with ckpt-engine's worker extension.

The actor wraps the existing `VllmRollout` (the in-process adapter) and serves it, plus token-in /
token-out generation, on a msgpack RPC port bound to its node IP (OS-chosen port, the job token on
every request). The daemon reaches it through the `ray_vllm` engine kind
(`ckpt_engine.trainer.ray_engine_client`); weights go only through the weight-sync group, which
the vLLM workers join from inside this actor. Ray carries only the actor's arguments and small
status maps.

vLLM runs its engine core in the actor process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): when Ray or
a SIGKILL ends the actor, nothing of the engine outlives it (no orphaned engine core holding the
weight-sync sockets). One lock orders generation and weight control on the one `LLM`; while a
sync holds the engine paused, generation answers "not serving" at once instead of waiting.

On start (first or after a Ray restart) the actor registers itself with the job's daemon by name;
it is pending (not paused: registration pauses nothing) until a sync gives it the current version.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["LLM_DEFAULTS", "VllmEngineActor"]

logger = logging.getLogger(__name__)

LLM_DEFAULTS: dict[str, Any] = {
    "load_format": "dummy", "skip_tokenizer_init": True, "enforce_eager": True, "dtype": "float32",
    "max_model_len": 64, "max_num_seqs": 32, "gpu_memory_utilization": 0.05,
}
"""In-process `LLM` arguments (dummy weights: the first sync replaces them)."""


class VllmEngineActor:
    """One rollout engine: `vllm.LLM` + `VllmRollout` served on an RPC port from inside a Ray actor."""

    def __init__(
        self, name: str, model_config: dict[str, Any], *, token: str, daemon_address: str, llm_kwargs: dict[str, Any] | None = None, timeout_s: float = 120.0
    ) -> None:
        import ray

        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core inside this process (see module doc)
        from vllm import LLM

        from ckpt_engine.control.server import RpcServer
        from ckpt_engine.daemon.client import DaemonClient
        from ckpt_engine.rollout_adapters.vllm.rollout import WORKER_EXTENSION, VllmRollout

        self.name = name
        self.host = str(ray.util.get_node_ip_address())
        self.node_id = ray.get_runtime_context().get_node_id()
        self.timeout_s = timeout_s
        self.started = time.time()
        # This node's copy of the config, read while the engine is built; removed here because a
        # killed actor (`ray.kill`) runs no finalizer.
        with tempfile.TemporaryDirectory(prefix="ckpt-ray-vllm-") as tmp:
            model_dir = Path(tmp)
            (model_dir / "config.json").write_text(json.dumps(model_config))
            t0 = time.monotonic()
            self.llm = LLM(model=str(model_dir), worker_extension_cls=WORKER_EXTENSION, **{**LLM_DEFAULTS, **(llm_kwargs or {})})
            self.start_s = time.monotonic() - t0
        self.rollout = VllmRollout(name, self.llm, timeout_s=timeout_s)
        self._lock = threading.Lock()
        self._paused = False
        self._receives = 0  # the receives this incarnation has begun
        self._hold: tuple[int, float] | None = None  # a fault drill: (receive number, seconds)
        self._holding = False
        self._manifests: dict[str, Any] = {}
        self._budget: Any = None  # the engine's ManifestBudget, asked of its workers at join
        self.server = RpcServer(self._handlers(), token=token, host=self.host, port=0).start()
        self.descriptor = {"kind": "ray_vllm", "host": self.host, "port": int(self.server.port), "world_size": int(self.rollout.world_size)}
        DaemonClient(daemon_address, token, timeout_s=timeout_s).register(name, self.descriptor)
        logger.info("vLLM engine %s up in %.1fs at %s:%d (pid %d), registered with %s", name, self.start_s, self.host, self.server.port, os.getpid(), daemon_address)

    # --- actor methods (Ray): where and how the engine is ------------------------------------
    def info(self) -> dict[str, Any]:
        return {"name": self.name, "pid": os.getpid(), "node_ip": self.host, "node_id": self.node_id, "descriptor": dict(self.descriptor), "start_s": self.start_s}

    def ping(self) -> int:
        return os.getpid()

    def holding(self) -> bool:
        """Whether a receive is held by `hold_receive` now."""
        return self._holding

    def hold_receive(self, number: int, seconds: float) -> int:
        """Fault drills: hold this incarnation's `number`-th receive (1: its first) this long before
        the workers start it (the trainer is then mid-stream, waiting on this engine). Named by its
        number, not as "the next", so a drill armed while the trainer syncs on does not depend on
        how fast it goes. Returns how many receives have begun (a drill armed after its receive
        began holds none)."""
        self._hold = (int(number), float(seconds))
        return self._receives

    # --- RPC handlers (msgpack): the daemon's adapter and the trainer's generator -------------
    def _handlers(self) -> dict[str, Any]:
        return {
            "join": self._join, "validate": self._validate, "receive": self._receive, "finalize": self._locked(self.rollout.finalize),
            "pause": self._pause, "resume": self._resume, "leave": self._locked(self.rollout.leave), "health": self._health,
            "held_version": self._locked(self.rollout.held_version), "generate": self._generate,
        }

    def _acquire(self) -> None:
        if not self._lock.acquire(timeout=self.timeout_s):
            raise TimeoutError(f"engine {self.name!r}: busy for more than {self.timeout_s:.0f}s")

    def _locked(self, fn: Any) -> Any:
        def call(**kwargs: Any) -> Any:
            self._acquire()
            try:
                return fn(**kwargs)
            finally:
                self._lock.release()

        return call

    def _join(self, rendezvous: dict[str, Any], rank_offset: int, options: dict[str, Any]) -> None:
        from ckpt_engine.engine import Rendezvous
        from ckpt_engine.rollout_adapters.base import JoinOptions

        self._locked(self.rollout.join)(rendezvous=Rendezvous.from_dict(rendezvous), rank_offset=int(rank_offset), options=JoinOptions.from_dict(options))
        self._budget = self._locked(self.rollout.manifest_budget)()  # this engine's own, never the manifest's claim

    def _validate(self, digest: str, encoded: bytes | None = None) -> dict[str, Any]:
        from ckpt_engine.manifest import decode_manifest
        from ckpt_engine.rollout_adapters.base import ManifestRejectedError

        if encoded is None and digest not in self._manifests:
            return {"need_manifest": True}
        if encoded is not None:
            if self._budget is None:
                return {"accepted": False, "problems": [f"engine {self.name!r}: validate before join (no manifest budget yet)"]}
            manifest = decode_manifest(encoded, self._budget)
            if manifest.digest != digest:
                raise ValueError(f"engine {self.name!r}: manifest digest {manifest.digest} does not match the announced {digest}")
            self._manifests = {digest: (manifest, encoded)}  # only the newest plan is kept
        manifest, raw = self._manifests[digest]
        try:
            self._locked(self.rollout.validate)(manifest=manifest, encoded=raw)
        except ManifestRejectedError as exc:
            return {"accepted": False, "problems": list(exc.problems)}
        return {"accepted": True}

    def _receive(self, digest: str) -> dict[str, Any]:
        if digest not in self._manifests:
            raise ValueError(f"engine {self.name!r}: receive for manifest {digest} that was never validated here")
        self._receives += 1
        hold = self._hold
        if hold is not None and hold[0] == self._receives:
            self._holding = True
            time.sleep(hold[1])  # the drill: ended by the kill it waits for (or by the sync's timeout)
            self._holding = False
        report = self._locked(self.rollout.receive)(manifest=self._manifests[digest][0])
        return report.to_dict()

    def _pause(self, mode: str) -> None:
        self._paused = mode != "none"
        self._locked(self.rollout.pause)(mode=mode)

    def _resume(self) -> None:
        self._locked(self.rollout.resume)()
        self._paused = False

    def _health(self) -> dict[str, Any]:
        health = self.rollout.health()  # no lock: the daemon probes while a receive runs
        return {**health, "paused": self._paused, "pid": os.getpid(), "node_ip": self.host}

    def _generate(
        self, requests: list[dict[str, Any]], temperature: float, max_tokens: int, allowed_token_ids: list[int] | None = None, ignore_eos: bool = False
    ) -> list[list[dict[str, Any]]] | None:
        """One `LLM.generate` over `requests` ([{prompt: token ids, n}]), or None while not serving."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if self._paused or self.rollout.version is None or not self._lock.acquire(timeout=self.timeout_s):
            return None
        try:
            if self._paused:
                return None
            params = [
                SamplingParams(n=int(r["n"]), max_tokens=int(max_tokens), temperature=float(temperature), allowed_token_ids=allowed_token_ids, ignore_eos=ignore_eos)
                for r in requests
            ]
            outs = self.llm.generate([TokensPrompt(prompt_token_ids=[int(t) for t in r["prompt"]]) for r in requests], params, use_tqdm=False)
        finally:
            self._lock.release()
        return [
            [{"token_ids": [int(t) for t in c.token_ids], "versions": [str(s.version) for s in (c.weight_versions or [])]} for c in sorted(o.outputs, key=lambda c: c.index)]
            for o in outs
        ]
