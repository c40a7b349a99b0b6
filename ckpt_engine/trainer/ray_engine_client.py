"""The trainer's side of a `VllmEngineActor`: the daemon's adapter and the rollout worker's generator.

Both talk msgpack RPC to the port the actor reported (descriptor `{"kind": "ray_vllm", "host",
"port", "world_size"}`), with the job token on every request. The generator looks the engine's
address up in the daemon's membership on every call, so an engine that Ray restarted (new
process, new port) is used again as soon as it has registered and been synced.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Mapping
from typing import Any

import torch

from ckpt_engine.delta.request import DeltaRequest
from ckpt_engine.engine import Rendezvous
from ckpt_engine.manifest import BucketManifest
from ckpt_engine.rollout_adapters.base import JoinOptions, ManifestRejectedError, ReceiveReport, RolloutAdapter, version_of
from ckpt_engine.trainer.lm_task import TokenTask
from ckpt_engine.trainer.rollout import Generation
from ckpt_engine.trainer.vllm_rollout import parse_choice_version
from ckpt_engine.control.wire import RpcClient

__all__ = ["ENGINE_KIND", "RayVllmEngineClient", "RayVllmGenerator", "ray_vllm_factory", "register_ray_vllm_kind"]

logger = logging.getLogger(__name__)

ENGINE_KIND = "ray_vllm"


class RayVllmEngineClient(RolloutAdapter):
    """Daemon-side handle of one `VllmEngineActor` (control over RPC; weights over the group)."""

    def __init__(self, name: str, host: str, port: int, timeout_s: float, *, world_size: int = 1, token: str) -> None:
        self.name = name
        self.host, self.port = host, port
        self.world_size = world_size
        self.timeout_s: float = timeout_s
        self.rpc = RpcClient(host, port, timeout_s, token=token)
        self._probe = RpcClient(host, port, min(timeout_s, 30.0), token=token)  # health must not queue behind receive()

    def engine_key(self) -> Hashable:
        return (ENGINE_KIND, self.host, self.port)

    def held_version(self) -> int | None:
        return version_of(self.rpc.call("held_version"))

    def join(self, rendezvous: Rendezvous, rank_offset: int, options: JoinOptions) -> None:
        self.rpc.call("join", rendezvous=rendezvous.to_dict(), rank_offset=rank_offset, options=options.to_dict())

    def validate(self, manifest: BucketManifest, encoded: bytes) -> None:
        reply = self.rpc.call("validate", digest=manifest.digest)
        if reply.get("need_manifest"):
            reply = self.rpc.call("validate", digest=manifest.digest, encoded=encoded)
        if not reply.get("accepted"):
            raise ManifestRejectedError(self.name, [str(p) for p in reply.get("problems") or ["rejected"]])

    def pause(self, mode: str) -> None:
        self.rpc.call("pause", mode=mode)

    def receive(self, manifest: BucketManifest, delta: DeltaRequest | None = None) -> ReceiveReport:
        if delta is not None:  # no capabilities.delta: the daemon never passes one
            raise ValueError(f"engine {self.name!r} ({ENGINE_KIND}) takes no delta syncs")
        return ReceiveReport.from_dict(self.rpc.call("receive", timeout_s=self.timeout_s * 2, digest=manifest.digest))

    def finalize(self, version: int) -> None:
        self.rpc.call("finalize", version=version)

    def resume(self) -> None:
        self.rpc.call("resume")

    def health(self) -> dict[str, Any]:
        health = self._probe.call("health")
        if not isinstance(health, dict):
            raise RuntimeError(f"engine {self.name!r}: health answered {health!r:.100}")
        return health

    def leave(self) -> None:
        self.rpc.call("leave")

    def close(self) -> None:
        self.rpc.close()
        self._probe.close()


def ray_vllm_factory(name: str, params: Mapping[str, Any], timeout_s: float, token: str | None = None) -> RolloutAdapter:
    """Engine kind `ray_vllm`: a `VllmEngineActor`'s RPC port, started with this job's token."""
    unknown = sorted(set(params) - {"host", "port", "world_size"})
    if unknown:
        raise ValueError(f"{ENGINE_KIND} engine descriptor: unknown key(s) {', '.join(unknown)}; allowed: kind, host, port, world_size")
    host, port, world = params.get("host"), params.get("port"), params.get("world_size", 1)
    if not isinstance(host, str) or not 0 < len(host) <= 255:
        raise ValueError(f"{ENGINE_KIND} engine descriptor: host must be a non-empty string, got {host!r:.80}")
    for key, value, high in (("port", port, 65535), ("world_size", world, 4096)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= high:
            raise ValueError(f"{ENGINE_KIND} engine descriptor: {key} must be an int in [1, {high}], got {value!r:.80}")
    if not isinstance(token, str):
        raise ValueError(f"{ENGINE_KIND} engine {name!r}: the daemon has no job token to reach it with")
    return RayVllmEngineClient(name, host, port, timeout_s, world_size=world, token=token)  # type: ignore[arg-type]


def register_ray_vllm_kind() -> None:
    """Make `ray_vllm` descriptors resolvable in this process (idempotent)."""
    from ckpt_engine.daemon.adapters import register_engine_kind

    register_engine_kind(ENGINE_KIND, f"{__name__}:ray_vllm_factory")


class RayVllmGenerator:
    """Samples the task's answers from a `VllmEngineActor`: one RPC per call, vLLM batches the prompts.

    Each sample's version is the one vLLM stamped on the token (a call whose answers do not all come
    from one complete version is discarded, as for the HTTP generator)."""

    def __init__(self, name: str, resolve: Callable[[], tuple[str, int] | None], task: TokenTask, *, token: str, timeout_s: float = 60.0) -> None:
        self.name = name
        self.task = task
        self.timeout_s = timeout_s
        self._resolve = resolve
        self._token = token
        self._addr: tuple[str, int] | None = None
        self._rpc: RpcClient | None = None
        self.discarded = 0

    def _client(self) -> RpcClient | None:
        addr = self._resolve()
        if addr != self._addr:
            if self._rpc is not None:
                self._rpc.close()
            self._addr = addr
            self._rpc = None if addr is None else RpcClient(addr[0], addr[1], self.timeout_s, token=self._token)
        return self._rpc

    def _sample(self, prompts: torch.Tensor, temperature: float) -> Generation | None:
        rpc = self._client()
        if rpc is None:  # not a member now (dropped, restarting)
            return None
        values = [int(v) for v in prompts.tolist()]
        groups: dict[int, list[int]] = {}
        for i, v in enumerate(values):
            groups.setdefault(v, []).append(i)
        requests = [{"prompt": self.task.prompt_ids(v), "n": len(idx)} for v, idx in groups.items()]
        reply = rpc.call("generate", requests=requests, temperature=temperature, max_tokens=1, allowed_token_ids=self.task.answer_token_ids())
        if reply is None:
            return None
        actions = torch.empty(len(values), dtype=torch.long)
        versions: set[int | None] = set()
        for (v, idx), choices in zip(groups.items(), reply):
            if len(choices) != len(idx):
                raise RuntimeError(f"engine {self.name!r}: expected {len(idx)} choices, got {len(choices)}")
            for i, c in zip(idx, choices):
                if len(c["token_ids"]) != 1:
                    raise RuntimeError(f"engine {self.name!r}: expected one answer token, got {c['token_ids']!r:.100}")
                actions[i] = self.task.token_to_answer(c["token_ids"][0])
                versions.add(parse_choice_version({"weight_versions": [{"version": s, "start": 0} for s in c["versions"]]}))
        if len(versions) != 1 or None in versions:
            self.discarded += 1
            return None
        return Generation(actions, versions.pop())  # type: ignore[arg-type]

    def generate(self, prompts: torch.Tensor) -> Generation | None:
        return self._sample(prompts, 1.0)

    def greedy(self, prompts: torch.Tensor) -> torch.Tensor | None:
        gen = self._sample(prompts, 0.0)
        return None if gen is None else gen.actions

    def complete(self, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
        """Greedy continuations (no EOS stop) and the version labels vLLM stamped on them."""
        rpc = self._client()
        reply = None if rpc is None else rpc.call("generate", requests=[{"prompt": p, "n": 1} for p in prompts], temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        if reply is None:
            return {"tokens": None, "versions": None}
        return {"tokens": [r[0]["token_ids"] for r in reply], "versions": sorted({v for r in reply for v in r[0]["versions"]})}

    def close(self) -> None:
        if self._rpc is not None:
            self._rpc.close()
