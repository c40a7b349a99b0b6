"""SGLang rollout engines through SGLang's own HTTP API for RL weight updates.

SGLang receives weights only in its own format: the trainer is rank 0 of a plain torch.distributed
group that the servers join through `/init_weights_update_group`, and every
`/update_weights_from_distributed` request (names, dtypes, shapes) is matched by one broadcast
from rank 0. With `load_format="flattened_bucket"` one broadcast carries a whole bucket: the
tensors' bytes concatenated without padding, as SGLang's `FlattenedTensorBucket` lays them out.
Our pipelined bucket wire (aligned offsets, chunked tensors, checksums) is not something SGLang
can read, so `SglangWeightSync` drives the transfer itself in SGLang's format: whole tensors
grouped into buckets of `bucket_size_bytes` (a larger tensor travels alone), bucket k+1 packed
while the servers load bucket k. It reports the same `SyncReport` as `WeightSyncSession`.

SGLang has no route that checks names and shapes before data moves (a bad name fails inside
`load_weights`, after the bytes arrived, leaving the model half-updated), so the manifest is
checked here first against the served model's parameters: taken from `expected_specs`, or built
on the meta device from the HF config of `/get_model_info`'s `model_path`.

Contract-tested against `tests/sglang_standin.py` (SGLang 0.5.x request schemas), not run against
SGLang itself on these machines.
"""

from __future__ import annotations

import concurrent.futures as cf
import datetime
import logging
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

import torch

from ckpt_engine.config import CheckpointEngineConfig
from ckpt_engine.sync.fanout import collect_failures, mark_stale_and_probe
from ckpt_engine.manifest import TensorSpec
from ckpt_engine.rollout_adapters.base import ManifestRejectedError, version_of
from ckpt_engine.sync.report import SyncError, SyncReport
from ckpt_engine.versions import check_version
from ckpt_engine.sources.base import WeightSource, spec_of

__all__ = ["SglangClient", "SglangWeightSync", "custom_process_group", "hf_expected_specs", "plan_flat_buckets"]

logger = logging.getLogger(__name__)

# ckpt-engine pause modes -> SGLang's /pause_generation modes.
# `keep` is SGLang's `retract`: requests stay queued and their KV is recomputed under the new weights
# after /continue_generation. Under `in_place` they keep old-weight KV and SGLang refuses /flush_cache.
_PAUSE_MODES = {"keep": "retract", "abort": "abort"}


def custom_process_group(
    host: str, port: int, rank: int, world_size: int, group_name: str, backend: str, timeout_s: float, store: Any = None
) -> Any:
    """A process group outside the default group: TCPStore at host:port, keys under `group_name`.

    Rank 0 (the trainer) hosts the store (pass it in as `store`). Both the sender here and the
    stand-in server build the group this way; SGLang's own `init_custom_process_group` meets at
    the same `tcp://host:port`.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = torch.distributed.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False)
    prefixed = torch.distributed.PrefixStore(group_name, store)
    if backend != "gloo":
        raise ValueError(f"only the gloo backend is built here, got {backend!r} (SGLang on GPU uses nccl)")
    return store, torch.distributed.ProcessGroupGloo(prefixed, rank, world_size, timeout)


def plan_flat_buckets(specs: Sequence[TensorSpec], bucket_size_bytes: int) -> list[list[TensorSpec]]:
    """Whole tensors in order, grouped up to `bucket_size_bytes`; a larger tensor goes alone."""
    buckets: list[list[TensorSpec]] = []
    current: list[TensorSpec] = []
    size = 0
    for spec in specs:
        if current and size + spec.nbytes > bucket_size_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(spec)
        size += spec.nbytes
    if current:
        buckets.append(current)
    return buckets


def hf_expected_specs(model_path: str) -> dict[str, TensorSpec]:
    """Checkpoint names/shapes of the HF model at `model_path`, built on the meta device (no weights)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {n: spec_of(n, t) for n, t in model.state_dict().items()}


class SglangClient:
    """One SGLang server's HTTP routes, with the request bodies SGLang's io_struct defines."""

    def __init__(self, name: str, base_url: str, *, timeout_s: float = 300.0, tp_size: int = 1) -> None:
        import requests

        self.name = name
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.world_size = tp_size
        self.http = requests.Session()
        self._probe = requests.Session()

    def _call(self, method: str, path: str, body: Any = None, timeout_s: float | None = None, probe: bool = False) -> Any:
        session = self._probe if probe else self.http
        timeout = timeout_s if timeout_s is not None else self.timeout_s
        resp = session.request(method, f"{self.base_url}{path}", json=body, timeout=timeout)
        try:
            data = resp.json()
        except ValueError:
            data = resp.text
        if resp.status_code != 200:
            raise RuntimeError(f"engine {self.name!r}: {path} answered {resp.status_code}: {str(data)[:500]}")
        if isinstance(data, dict) and data.get("success") is False:
            raise RuntimeError(f"engine {self.name!r}: {path} failed: {data.get('message')}")
        return data

    def init_weights_update_group(self, host: str, port: int, rank_offset: int, world_size: int, group_name: str, backend: str) -> None:
        body = {"master_address": host, "master_port": port, "rank_offset": rank_offset, "world_size": world_size,
                "group_name": group_name, "backend": backend}
        self._call("POST", "/init_weights_update_group", body)

    def update_weights_from_distributed(self, specs: Sequence[TensorSpec], group_name: str, *, flattened: bool) -> None:
        body = {"names": [s.name for s in specs], "dtypes": [s.dtype for s in specs], "shapes": [list(s.shape) for s in specs],
                "group_name": group_name, "flush_cache": False, "abort_all_requests": False,
                "load_format": "flattened_bucket" if flattened else None}
        self._call("POST", "/update_weights_from_distributed", body)

    def destroy_weights_update_group(self, group_name: str) -> None:
        self._call("POST", "/destroy_weights_update_group", {"group_name": group_name})

    def pause_generation(self, mode: str) -> None:
        self._call("POST", "/pause_generation", {"mode": mode})

    def continue_generation(self) -> None:
        self._call("POST", "/continue_generation", {})

    def flush_cache(self) -> None:
        self._call("POST", "/flush_cache")

    def update_weight_version(self, version: str) -> None:
        self._call("POST", "/update_weight_version", {"new_version": version, "abort_all_requests": False})

    def get_weight_version(self) -> str:
        return str(self._call("GET", "/get_weight_version")["weight_version"])

    def get_model_info(self) -> dict[str, Any]:
        return self._call("GET", "/get_model_info")

    def health(self) -> None:
        self._call("GET", "/health", timeout_s=min(self.timeout_s, 5.0), probe=True)

    def close(self) -> None:
        self.http.close()
        self._probe.close()


class SglangWeightSync:
    """The trainer side for SGLang servers: owns the group (rank 0) and drives every sync."""

    def __init__(
        self,
        servers: Sequence[SglangClient],
        config: CheckpointEngineConfig | None = None,
        *,
        host: str = "127.0.0.1",
        expected_specs: Sequence[TensorSpec] | None = None,
        flattened: bool = True,
    ) -> None:
        self.config = config if config is not None else CheckpointEngineConfig(backend="gloo")
        self.servers = list(servers)
        self.host = host
        self.flattened = flattened
        self.bucket_size_bytes = self.config.bucket_size_bytes if self.config.bucket_size_bytes is not None else 256 << 20
        self._expected: dict[str, dict[str, TensorSpec]] = {}
        if expected_specs is not None:
            self._expected = {s.name: {t.name: t for t in expected_specs} for s in self.servers}
        self._group: Any = None
        self._store: Any = None
        self.group_name = ""
        self.version = 0
        self.stale: set[str] = set()
        self._lock = threading.Lock()
        self._pool = cf.ThreadPoolExecutor(max_workers=max(4, 2 * len(self.servers)), thread_name_prefix="ckpt-sglang")

    # --- group ---------------------------------------------------------------------------------
    def _ensure_group(self) -> None:
        if self._group is not None:
            return
        world = 1 + sum(s.world_size for s in self.servers)
        if self._store is None:  # port 0: a free port from the OS; the servers join at host:port
            self._store = torch.distributed.TCPStore(
                self.host, 0, world, is_master=True, wait_for_workers=False,
                timeout=datetime.timedelta(seconds=self.config.timeout_s),
            )
        port = self._store.port
        self.group_name = f"ckpt_engine_{uuid.uuid4().hex[:12]}"
        offsets, rank = [], 1
        for s in self.servers:
            offsets.append(rank)
            rank += s.world_size
        backend = "gloo"
        futures = {
            s.name: self._pool.submit(s.init_weights_update_group, self.host, port, off, world, self.group_name, backend)
            for s, off in zip(self.servers, offsets)
        }
        try:
            _, self._group = custom_process_group(
                self.host, port, 0, world, self.group_name, backend, self.config.timeout_s, store=self._store
            )
            probe_t = torch.zeros(1)
            self._group.broadcast(probe_t, 0).wait(datetime.timedelta(seconds=self.config.timeout_s))
        except Exception as exc:
            failed = self._wait_all(futures, "join")
            self._group = None
            raise SyncError("join", failed or {"sender": str(exc)}, sorted(self.stale)) from exc
        failed = self._wait_all(futures, "join")
        if failed:
            self._group = None
            raise SyncError("join", failed, sorted(self.stale))

    def _wait_all(self, futures: dict[str, cf.Future[Any]], stage: str) -> dict[str, str]:
        return collect_failures(futures, stage, self.config.timeout_s)

    def _fan_out(self, stage: str, fn: Any) -> None:
        failed = self._wait_all({s.name: self._pool.submit(fn, s) for s in self.servers}, stage)
        if failed:
            self._break(failed)
            raise SyncError(stage, failed, sorted(self.stale))

    def _break(self, failed: dict[str, str]) -> None:
        mark_stale_and_probe(self.servers, failed, self.stale)
        if self._group is not None and hasattr(self._group, "abort"):
            try:
                self._group.abort()
            except Exception as exc:
                logger.warning("abort of the SGLang weight group failed: %s", exc)
        self._group = None

    # --- one sync ----------------------------------------------------------------------------
    def validate(self, specs: Sequence[TensorSpec]) -> None:
        """Reject before any byte moves: names/shapes against each server's model."""
        rejected = []
        for s in self.servers:
            expected = self._expected.get(s.name)
            if expected is None:
                expected = self._expected[s.name] = hf_expected_specs(str(s.get_model_info()["model_path"]))
            problems = []
            for spec in specs:
                want = expected.get(spec.name)
                if want is None:
                    problems.append(f"{spec.name}: the engine has no such tensor")
                elif want.shape != spec.shape:
                    problems.append(f"{spec.name}: shape {list(spec.shape)} but the engine holds {list(want.shape)}")
            if problems:
                rejected.append(ManifestRejectedError(s.name, problems))
        if len(rejected) == 1:
            raise rejected[0]
        if rejected:
            raise ManifestRejectedError(", ".join(e.engine for e in rejected), [p for e in rejected for p in e.problems])

    def sync(self, source: WeightSource, *, version: int | None = None) -> SyncReport:
        """One sync; a second caller waits its turn for at most timeout_s, then is refused.

        `version` defaults to one past the newest version any server reports (or this object's
        last one), so a new SglangWeightSync never reuses a label; an older one is refused."""
        if not self._lock.acquire(timeout=self.config.timeout_s):
            raise RuntimeError(f"another sync on these SGLang servers has run for more than timeout_s={self.config.timeout_s}s")
        try:
            return self._sync(source, version)
        finally:
            self._lock.release()

    def _next_version(self, requested: int | None) -> int:
        held = {s.name: version_of(s.get_weight_version()) for s in self.servers}
        newest = max([v for v in held.values() if v is not None] + [self.version])
        if requested is None:
            return check_version(newest + 1, "the next version")
        check_version(requested, "version")
        ahead = {n: v for n, v in held.items() if v is not None and v > requested}
        if ahead:
            raise ValueError(f"version {requested} is older than what servers hold ({ahead}); versions only grow")
        return requested

    def _sync(self, source: WeightSource, version: int | None) -> SyncReport:
        t0 = time.perf_counter()
        seconds: dict[str, float] = {}
        specs = list(source.metadata())
        if not specs:
            raise ValueError(f"the weight source ({type(source).__name__}) lists no tensors: refusing to stamp an empty sync as a new version")
        new_version = self._next_version(version)
        self.validate(specs)
        seconds["validate"] = time.perf_counter() - t0
        self._ensure_group()
        t = time.perf_counter()
        if self.config.pause_mode != "none":
            mode = _PAUSE_MODES[self.config.pause_mode]
            self._fan_out("pause", lambda s: s.pause_generation(mode))
        seconds["pause"] = time.perf_counter() - t

        t = time.perf_counter()
        buckets = plan_flat_buckets(specs, self.bucket_size_bytes)
        stats = self._stream(buckets, source, seconds)
        seconds["transfer"] = time.perf_counter() - t

        t = time.perf_counter()
        version_str = str(new_version)

        def finalize(s: SglangClient) -> None:
            s.flush_cache()
            s.update_weight_version(version_str)

        self._fan_out("finalize", finalize)
        seconds["finalize"] = time.perf_counter() - t
        t = time.perf_counter()
        if self.config.pause_mode != "none":
            self._fan_out("resume", lambda s: s.continue_generation())
        seconds["resume"] = time.perf_counter() - t
        self.stale.clear()
        self.version = new_version
        seconds["total"] = time.perf_counter() - t0
        total = sum(s.nbytes for s in specs)
        return SyncReport(
            version=new_version, bytes=total, tensors=len(specs), buckets=len(buckets), engines=len(self.servers),
            seconds=seconds, gbps=total / seconds["transfer"] / 1e9 if seconds["transfer"] > 0 else 0.0,
            receivers={"format": {"load_format": "flattened_bucket" if self.flattened else "per_tensor", **stats}},
        )

    def _stream(self, buckets: list[list[TensorSpec]], source: WeightSource, seconds: dict[str, float]) -> dict[str, Any]:
        """Per bucket: post the update to every server, broadcast its bytes, collect the replies."""
        it = iter(source.iter_weights())
        pending: dict[str, cf.Future[Any]] = {}
        pack_s = 0.0
        broadcasts = 0
        try:
            for bucket in buckets:
                t = time.perf_counter()
                tensors = []
                for spec in bucket:
                    name, tensor = next(it)
                    if name != spec.name:
                        raise ValueError(f"the weight source yielded {name!r} where its metadata put {spec.name!r}")
                    tensors.append(tensor.detach().to(torch.device("cpu"), getattr(torch, spec.dtype)).contiguous())
                if self.flattened:
                    payloads = [torch.cat([x.reshape(-1).view(torch.uint8) for x in tensors])]
                else:
                    payloads = tensors
                pack_s += time.perf_counter() - t
                # The previous bucket's loads must finish before SGLang takes the next request.
                self._collect(pending, "transfer")
                pending = {
                    s.name: self._pool.submit(s.update_weights_from_distributed, bucket, self.group_name, flattened=self.flattened)
                    for s in self.servers
                }
                for payload in payloads:
                    work = self._group.broadcast(payload, 0)
                    work.wait(datetime.timedelta(seconds=self.config.timeout_s))
                    broadcasts += 1
            self._collect(pending, "transfer")
        except SyncError:
            raise
        except Exception as exc:
            failed = self._wait_all(pending, "transfer") if pending else {}
            dead = {}
            for s in self.servers:
                try:
                    s.health()
                except Exception as h_exc:
                    dead[s.name] = f"died during the transfer ({h_exc})"
            failed = dead or failed or {"sender": f"{type(exc).__name__}: {exc}"}
            self._break(failed)
            raise SyncError("transfer", failed, sorted(self.stale)) from exc
        seconds["pack"] = pack_s
        return {"broadcasts": broadcasts}

    def _collect(self, pending: dict[str, cf.Future[Any]], stage: str) -> None:
        if not pending:
            return
        failed = self._wait_all(pending, stage)
        if failed:
            self._break(failed)
            raise SyncError(stage, failed, sorted(self.stale))

    def close(self) -> None:
        """Destroy the group on every server (best effort) and release ours."""
        if self._group is not None:
            for s in self.servers:
                try:
                    s.destroy_weights_update_group(self.group_name)
                except Exception as exc:
                    logger.warning("engine %s did not destroy the weight group: %s", s.name, exc)
            self._group = None
        self._pool.shutdown(wait=False, cancel_futures=True)
