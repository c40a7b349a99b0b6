"""vLLM worker extension: the engine-side half of the vLLM rollout adapter.

Start vLLM with
`worker_extension_cls="ckpt_engine.rollout_adapters.vllm_worker.CkptEngineWorkerExtension"`; vLLM
mixes this class into every worker, and the controller reaches its `ckpt_*` methods through
`collective_rpc` (in-process `LLM`) or the dev-mode `/collective_rpc` route (`api_server`). Control
arguments are plain msgpack/JSON values (the manifest travels as bytes, or base64 over HTTP); the
weights travel only through the weight-sync group.

Loading uses vLLM's layerwise reload (`initialize_layerwise_reload` -> `model.load_weights` per
bucket -> `finalize_layerwise_reload`), which works after vLLM has post-processed (e.g. repacked on
CPU) its weights. Each bucket's tensors are views of a rotating receive buffer; vLLM's weight
loaders copy them straight into the re-materialized layer. Only a tensor whose layer is still
incomplete when its bucket ends is kept by vLLM for later, and only that tensor is cloned (once),
because the buffer is refilled as soon as the loader returns.
"""

from __future__ import annotations

import base64
import logging
import os
import time
from typing import TYPE_CHECKING, Any

import torch

from ckpt_engine.manifest import TensorSpec
from ckpt_engine.rollout_adapters.receiver import WeightReceiver

if TYPE_CHECKING:
    from collections.abc import Iterable

__all__ = ["CkptEngineWorkerExtension", "vllm_checkpoint_specs"]

logger = logging.getLogger(__name__)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def vllm_checkpoint_specs(model: torch.nn.Module) -> tuple[dict[str, TensorSpec], list[list[str]], dict[str, str]]:
    """Checkpoint-format (HF) names and global shapes of every tensor `model.load_weights` takes.

    Applies vLLM's stacking rules (`packed_modules_mapping`: q/k/v -> qkv_proj, gate/up ->
    gate_up_proj), undoes tensor-parallel sharding and vocab padding. With tied embeddings
    `lm_head.weight` is accepted but optional. Returns (specs, groups, tied): each group lists the
    checkpoint names that fill one vLLM parameter (a manifest must send all or none of a group, or
    layerwise reload would process a half-filled parameter); `tied` maps `lm_head.weight` to the
    embedding it shares, because layerwise reload must see the tied head loaded too.
    """
    from vllm.model_executor.layers.linear import LinearBase, QKVParallelLinear
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    packed: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", {}) or {})
    specs: dict[str, TensorSpec] = {}
    groups: list[list[str]] = []
    tied: dict[str, str] = {}
    seen: set[int] = set()
    embed_name: str | None = None
    for mod_name, module in model.named_modules():
        for p_name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            dtype = _dtype_name(param.dtype)
            if isinstance(module, VocabParallelEmbedding):
                shape: tuple[int, ...] = (module.org_vocab_size, module.embedding_dim)
                if embed_name is None:
                    embed_name = full
            elif isinstance(module, LinearBase) and p_name in ("weight", "bias"):
                shape = (module.output_size, module.input_size) if p_name == "weight" else (module.output_size,)
            else:
                shape = tuple(param.shape)
            leaf = mod_name.rsplit(".", 1)[-1]
            parent = mod_name[: -len(leaf)]
            if leaf in packed and isinstance(module, LinearBase) and p_name in ("weight", "bias"):
                if isinstance(module, QKVParallelLinear):
                    sizes = [
                        module.total_num_heads * module.head_size,
                        module.total_num_kv_heads * module.head_size,
                        module.total_num_kv_heads * module.v_head_size,
                    ]
                else:
                    sizes = list(module.output_sizes)
                names = []
                for sub, rows in zip(packed[leaf], sizes):
                    name = f"{parent}{sub}.{p_name}"
                    specs[name] = TensorSpec(name, dtype, (rows, *shape[1:]))
                    names.append(name)
                groups.append(names)
            else:
                specs[full] = TensorSpec(full, dtype, shape)
                groups.append([full])
    lm_head = getattr(model, "lm_head", None)
    if embed_name is not None and lm_head is not None and "lm_head.weight" not in specs:
        e = specs[embed_name]
        specs["lm_head.weight"] = TensorSpec("lm_head.weight", e.dtype, e.shape)
        tied["lm_head.weight"] = embed_name
    return specs, groups, tied


class CkptEngineWorkerExtension:
    """Mixed into vLLM's worker class; every method runs in each worker via collective_rpc."""

    # Attributes live on the worker instance; vLLM constructs the worker, not this class.
    _ckpt: dict[str, Any]

    def _ckpt_state(self) -> dict[str, Any]:
        state = getattr(self, "_ckpt", None)
        if state is None:
            state = self._ckpt = {
                "receiver": WeightReceiver(device=self._ckpt_device()),
                "specs": None,
                "version": None,
                "reload_open": False,
                "stale": False,
                "last_report": None,
            }
        return state

    def _ckpt_device(self) -> torch.device:
        device = getattr(self, "device", None)
        return torch.device(device) if device is not None else torch.device("cpu")

    def _ckpt_model(self) -> torch.nn.Module:
        return self.model_runner.get_model()  # type: ignore[attr-defined]

    def _ckpt_rank(self) -> int:
        return int(getattr(self, "rank", 0))

    # --- group -------------------------------------------------------------------------------
    def ckpt_join(self, rendezvous: dict[str, Any], rank_offset: int, options: dict[str, Any]) -> dict[str, Any]:
        """Join the weight-sync group as rank `rank_offset + this worker's rank` (collective)."""
        state = self._ckpt_state()
        rank = int(rank_offset) + self._ckpt_rank()
        state["receiver"].join(rendezvous, rank, options)
        return {"pid": os.getpid(), "rank": rank}

    def ckpt_leave(self) -> None:
        state = self._ckpt_state()
        self._ckpt_close_reload()
        state["receiver"].leave()

    # --- validate ----------------------------------------------------------------------------
    def ckpt_expected_specs(self) -> list[list[Any]]:
        specs, _, _ = self._ckpt_specs()
        return [[s.name, s.dtype, list(s.shape)] for s in specs.values()]

    def _ckpt_specs(self) -> tuple[dict[str, TensorSpec], list[list[str]], dict[str, str]]:
        state = self._ckpt_state()
        if state["specs"] is None:
            state["specs"] = vllm_checkpoint_specs(self._ckpt_model())
        return state["specs"]

    def ckpt_validate(self, encoded: bytes | str | None, digest: str) -> dict[str, Any]:
        """Check a manifest against this worker's parameters; nothing moves. `encoded` may be base64."""
        state = self._ckpt_state()
        if isinstance(encoded, str):
            encoded = base64.b64decode(encoded)
        specs, groups, _ = self._ckpt_specs()
        receiver: WeightReceiver = state["receiver"]

        def stacked_whole(manifest: Any) -> list[str]:
            sent = {s.name for s in manifest.specs}
            problems = []
            for group in groups:
                present = [n for n in group if n in sent]
                if present and len(present) != len(group):
                    missing = [n for n in group if n not in sent]
                    problems.append(f"{', '.join(missing)}: vLLM stacks these with {', '.join(present)}; send all of them or none")
            return problems

        return receiver.validate(encoded, digest, specs, extra_check=stacked_whole)

    # --- receive and load --------------------------------------------------------------------
    def ckpt_receive(self, digest: str) -> dict[str, Any]:
        """Receive every bucket of an accepted manifest and load it (layerwise reload stays open)."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        state = self._ckpt_state()
        model = self._ckpt_model()
        self._ckpt_close_reload()
        _, _, tied = self._ckpt_specs()
        accepted = state["receiver"].accepted_manifest(digest)
        sent = {s.name for s in accepted.specs} if accepted is not None else set()
        # A tied head the trainer did not send is loaded from its embedding, or layerwise reload
        # would put the old head back.
        alias = {emb: head for head, emb in tied.items() if head not in sent and emb in sent}
        detached = [0]

        def load(pairs: list[tuple[str, torch.Tensor]]) -> int:
            loadable = pairs + [(alias[n], t) for n, t in pairs if n in alias]
            with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
                model.load_weights(loadable)
            detached[0] += _detach_pending(model, loadable)
            return len(pairs)

        state["stale"] = True
        with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
            initialize_layerwise_reload(model)
        state["reload_open"] = True
        try:
            with torch.no_grad():
                report = state["receiver"].receive(digest, load)
        except BaseException:
            self._ckpt_close_reload()  # never leave layers on the meta device
            raise
        out = report.to_dict()
        out["detached_bytes"] = detached[0]
        state["last_report"] = out
        return out

    def _ckpt_close_reload(self) -> float:
        state = self._ckpt_state()
        if not state["reload_open"]:
            return 0.0
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        t0 = time.perf_counter()
        state["reload_open"] = False
        with set_current_vllm_config(self.vllm_config), torch.no_grad():  # type: ignore[attr-defined]
            finalize_layerwise_reload(self._ckpt_model(), self.vllm_config.model_config)  # type: ignore[attr-defined]
        return time.perf_counter() - t0

    def ckpt_finalize(self, version: int) -> dict[str, Any]:
        """Post-process what was loaded (layerwise finalize), then stamp `version`."""
        state = self._ckpt_state()
        seconds = self._ckpt_close_reload()
        runner = self.model_runner  # type: ignore[attr-defined]
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            fn = getattr(runner, reset, None)
            if fn is not None:
                fn()
        state["version"], state["stale"] = int(version), False
        return {"finalize_s": seconds, "version": state["version"]}

    def ckpt_health(self) -> dict[str, Any]:
        state = self._ckpt_state()
        return {
            "pid": os.getpid(),
            "rank": self._ckpt_rank(),
            "version": state["version"],
            "stale": state["stale"],
            "buckets_received": state["receiver"].buckets_received,
            "last_report": state["last_report"],
        }


def _detach_pending(model: torch.nn.Module, pairs: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Clone the bucket tensors vLLM's layerwise reload still holds for incomplete layers.

    Those references would otherwise read the next bucket's bytes once the buffer is refilled.
    Returns the bytes cloned (zero when every layer completed inside its bucket).
    """
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    # Views of the rotating buffer share a storage larger than themselves; a reassembled chunked
    # tensor owns its storage and stays valid, so it is not cloned.
    ptrs = {t.untyped_storage().data_ptr() for _, t in pairs if t.untyped_storage().nbytes() != t.nbytes}
    cloned = 0
    for info in list(LAYERWISE_INFO.values()):
        for _, bound in info.loaded_weights:
            for key, value in bound.arguments.items():
                if key == "param" or not isinstance(value, torch.Tensor):
                    continue
                if value.untyped_storage().data_ptr() in ptrs:
                    bound.arguments[key] = value.clone()
                    cloned += value.numel() * value.element_size()
    return cloned
