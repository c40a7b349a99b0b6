"""SGLang rollout engines through SGLang's own HTTP API for RL weight updates, as `RolloutAdapter`s.

An `SglangRollout` syncs through the same `WeightSyncSession` / `sync_rollout_weights()` as every
other engine. SGLang reads only its own wire, so the adapter declares it (`transport = "sglang"`,
`sglang/wire.py`): the session's group is the one the servers join through
`/init_weights_update_group`, and for every bucket of the plan the adapter posts one
`/update_weights_from_distributed` (names, dtypes, shapes; `load_format="flattened_bucket"` unless
the transport option `flattened` is false) that the sender's broadcasts then fill.

SGLang has no route that checks names and shapes before data moves (a bad name fails inside
`load_weights`, after the bytes arrived, leaving the model half-updated), so `validate` checks the
manifest first against the served model's parameters: taken from `expected_specs`, or built on the
meta device from the HF config of `/get_model_info`'s `model_path`.

Contract-tested against `tests/sglang_standin.py` (SGLang 0.5.x request schemas), not run against
SGLang itself on these machines.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from ckpt_engine.delta.request import DeltaRequest
from ckpt_engine.manifest import BucketManifest, TensorSpec
from ckpt_engine.rollout_adapters.sglang import failures
from ckpt_engine.rollout_adapters.base import JoinOptions, ManifestRejectedError, ReceiveReport, RolloutAdapter, version_of
from ckpt_engine.rollout_adapters.capabilities import EngineCapabilities
from ckpt_engine.sources.base import spec_of
from ckpt_engine.engine import Rendezvous
from ckpt_engine.registry import CheckpointEngineRegistry

__all__ = ["SGLANG_TRANSPORT", "SglangClient", "SglangRollout", "custom_process_group", "group_name_of", "hf_expected_specs"]

logger = logging.getLogger(__name__)

SGLANG_TRANSPORT = "sglang"
"""The transport name of SGLang's wire (`sglang/wire.py` SglangWireEngine), registered on import."""

# ckpt-engine pause modes -> SGLang's /pause_generation modes.
# `keep` is SGLang's `retract`: requests stay queued and their KV is recomputed under the new weights
# after /continue_generation. Under `in_place` they keep old-weight KV and SGLang refuses /flush_cache.
_PAUSE_MODES = {"keep": "retract", "abort": "abort", "recompute": "retract"}


def custom_process_group(
    host: str, port: int, rank: int, world_size: int, group_name: str, backend: str, timeout_s: float, store: Any = None
) -> Any:
    """A process group outside the default group: TCPStore at host:port, keys under `group_name`.

    Pass the store when this rank must not create it (the sender connects to the session's).
    Both the sender (`sglang/wire.py`) and the stand-in server build the group this way; SGLang's
    own `init_custom_process_group` meets at the same `tcp://host:port`.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = torch.distributed.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False)
    prefixed = torch.distributed.PrefixStore(group_name, store)
    if backend != "gloo":
        raise ValueError(f"only the gloo backend is built here, got {backend!r} (SGLang on GPU uses nccl)")
    return store, torch.distributed.ProcessGroupGloo(prefixed, rank, world_size, timeout)


def group_name_of(rendezvous: Rendezvous) -> str:
    """The SGLang group name of a weight-sync group (both ends derive it from the token)."""
    return f"ckpt_engine_{rendezvous.token[:12]}"


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
            raise RuntimeError(f"engine {self.name!r}: {path} failed: {data.get('message', data.get('error_message'))}")
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

    def load_lora_adapter(self, lora_name: str, lora_path: str, *, pinned: bool = False) -> None:
        """SGLang's `/load_lora_adapter` (`LoadLoRAAdapterReqInput`): a PEFT folder the server reads."""
        self._call("POST", "/load_lora_adapter", {"lora_name": lora_name, "lora_path": lora_path, "pinned": pinned})

    def unload_lora_adapter(self, lora_name: str) -> None:
        """SGLang's `/unload_lora_adapter`: new requests can no longer name it; SGLang frees it after
        the requests that use it finished (it answers then)."""
        self._call("POST", "/unload_lora_adapter", {"lora_name": lora_name})

    def get_model_info(self) -> dict[str, Any]:
        return self._call("GET", "/get_model_info")

    def health(self) -> None:
        self._call("GET", "/health", timeout_s=min(self.timeout_s, 5.0), probe=True)

    def close(self) -> None:
        self.http.close()
        self._probe.close()


class SglangRollout(RolloutAdapter):
    """One SGLang server (all its TP ranks) as an engine of a weight-sync session.

    Uses SGLang's wire (`transport`): leave `checkpoint_engine.backend` at `auto` (or `sglang`);
    `engine_kwargs={"sglang": {"flattened": False}}` sends one broadcast per tensor. The client is
    the caller's: `close()` leaves it open.
    """

    capabilities = EngineCapabilities(transport=SGLANG_TRANSPORT)

    def __init__(self, client: SglangClient, *, expected_specs: Sequence[TensorSpec] | None = None) -> None:
        self.client = client
        self.name = client.name
        self.world_size = client.world_size
        self._expected = {s.name: s for s in expected_specs} if expected_specs is not None else None
        self._group_name: str | None = None
        self._flattened = True
        self._paused = False

    def engine_key(self) -> Hashable:
        return ("sglang", self.client.base_url)

    def take_over(self, previous: RolloutAdapter) -> None:
        """A new handle on the same server: the group it joined, its wire and whether it paused."""
        if isinstance(previous, SglangRollout):
            self._group_name, self._flattened, self._paused = previous._group_name, previous._flattened, previous._paused

    def held_version(self) -> int | None:
        return version_of(self.client.get_weight_version())

    def join(self, rendezvous: Rendezvous, rank_offset: int, options: JoinOptions) -> None:
        flattened = options.engine_kwargs.get("flattened", True)
        if not isinstance(flattened, bool):
            raise ValueError(f"engine_kwargs.sglang.flattened must be a bool, got {flattened!r}")
        name = group_name_of(rendezvous)
        self.client.init_weights_update_group(rendezvous.host, rendezvous.port, rank_offset, rendezvous.world_size, name, "gloo")
        self._group_name, self._flattened = name, flattened

    def validate(self, manifest: BucketManifest, encoded: bytes) -> None:
        """Names and shapes against the served model's parameters, before any byte moves."""
        if self._expected is None:
            self._expected = hf_expected_specs(str(self.client.get_model_info()["model_path"]))
        problems = []
        for spec in manifest.specs:
            want = self._expected.get(spec.name)
            if want is None:
                problems.append(f"{spec.name}: the engine has no such tensor")
            elif want.shape != spec.shape:
                problems.append(f"{spec.name}: shape {list(spec.shape)} but the engine holds {list(want.shape)}")
        if problems:
            raise ManifestRejectedError(self.name, problems)

    def pause(self, mode: str) -> None:
        if mode == "none":
            return
        self.client.pause_generation(_PAUSE_MODES[mode])
        self._paused = True

    def receive(self, manifest: BucketManifest, delta: DeltaRequest | None = None) -> ReceiveReport:
        """One `/update_weights_from_distributed` per bucket, each answered once the server loaded
        what the sender's broadcasts carried."""
        if self._group_name is None:
            raise RuntimeError(f"engine {self.name!r} is in no weight-sync group; join first")
        t0 = time.perf_counter()
        nbytes = 0
        for bucket in manifest.buckets:
            specs = [TensorSpec(e.name, e.dtype, e.shape) for e in bucket.entries]
            try:
                self.client.update_weights_from_distributed(specs, self._group_name, flattened=self._flattened)
            except Exception as exc:  # the sender, waiting in this bucket's broadcast, stops at once
                failures.record(self._group_name, self.name, f"bucket {bucket.index}: {type(exc).__name__}: {exc}")
                raise
            nbytes += sum(s.nbytes for s in specs)
        seconds = time.perf_counter() - t0
        n = manifest.num_tensors
        return ReceiveReport(n, nbytes, seconds, seconds, n, {"flattened": float(self._flattened)})

    def finalize(self, version: int) -> None:
        """Flush SGLang's prefix cache (its KV was computed under the old weights), stamp `version`."""
        self.client.flush_cache()
        self.client.update_weight_version(str(version))

    def resume(self) -> None:
        if self._paused:
            self.client.continue_generation()
            self._paused = False

    def health(self) -> dict[str, Any]:
        self.client.health()
        return {}

    def leave(self) -> None:
        name, self._group_name = self._group_name, None
        if name is not None:
            self.client.destroy_weights_update_group(name)


CheckpointEngineRegistry.add(SGLANG_TRANSPORT, "ckpt_engine.rollout_adapters.sglang.wire:SglangWireEngine")
