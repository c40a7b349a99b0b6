"""The receiving core inside a vLLM worker, shared by both ways vLLM reaches ckpt-engine.

The worker extension (`vllm_worker.py`, for any vLLM with `worker_extension_cls`) and the native
weight-transfer backend (`vllm_transfer_engine.py`, for vLLM's `WeightTransferEngine` API) differ
only in how vLLM calls them; joining the weight-sync group, checking a manifest against vLLM's own
parameters, loading buckets through layerwise reload and finalizing all live here, once.

Loading uses vLLM's layerwise reload (`initialize_layerwise_reload` -> `model.load_weights` per
bucket -> `finalize_layerwise_reload`), which works after vLLM has post-processed (e.g. repacked on
CPU) its weights. Each bucket's tensors are views of a rotating receive buffer; vLLM's weight
loaders copy them straight into the re-materialized layer. Only a tensor whose layer is still
incomplete when its bucket ends is kept by vLLM for later, and only that tensor is cloned (once),
because the buffer is refilled as soon as the loader returns.
"""

from __future__ import annotations

import base64
import binascii
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ckpt_engine.manifest import BucketManifest, TensorSpec
from ckpt_engine.planning.fused_experts import FusedExperts, fuse_plan, fuse_specs
from ckpt_engine.planning.regions import ReceivePlan, Region
from ckpt_engine.rollout_adapters.receiver import WeightReceiver
from ckpt_engine.rollout_adapters.region_assembler import RegionAssembler, held_bytes
from ckpt_engine.rollout_adapters.vllm_region_landing import RegionItem, RegionLanding
from ckpt_engine.rollout_adapters.vllm_shadow import ShadowPreparer
from ckpt_engine.rollout_adapters.vllm_staging import Sink, StagedReceive, Staging

__all__ = ["VllmReceiverCore", "vllm_checkpoint_specs"]

logger = logging.getLogger(__name__)

Specs = tuple[dict[str, TensorSpec], list[list[str]], dict[str, str]]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def vllm_checkpoint_specs(model: torch.nn.Module) -> Specs:
    """Checkpoint-format (HF) names and global shapes of every tensor `model.load_weights` takes.

    Fused expert layers (`w13` / `w2`) take one tensor per expert, named by the layer's own
    expert mapping; all of a layer's experts form one group. Applies vLLM's stacking rules (`packed_modules_mapping`: q/k/v -> qkv_proj, gate/up ->
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
    experts_cls = _routed_experts_class()
    for mod_name, module in model.named_modules():
        if experts_cls is not None and isinstance(module, experts_cls):
            group = _expert_specs(module, specs)
            if group:
                groups.append(group)
                seen.update(id(p) for p in module.parameters(recurse=False))
                continue
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


def _routed_experts_class() -> type | None:
    try:
        from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    except ImportError:  # a vLLM without it: fused experts are not recognised
        return None
    return RoutedExperts


def _expert_specs(module: torch.nn.Module, specs: dict[str, TensorSpec]) -> list[str]:
    """Per-expert checkpoint names and global shapes of one fused expert layer (`w13` / `w2`),
    from the layer's own expert mapping; [] when its layout is not the plain one."""
    weights = {"w1": "w13_weight", "w3": "w13_weight", "w2": "w2_weight"}
    layer_name = getattr(module, "layer_name", "")
    base = layer_name.rpartition(".")[0]
    params = dict(module.named_parameters(recurse=False))
    if not layer_name.endswith("experts") or not {"w13_weight", "w2_weight"} <= set(params):
        return []
    inter, hidden = int(module.moe_config.intermediate_size), int(module.hidden_size)  # type: ignore[union-attr]
    names: list[str] = []
    for _, weight_name, _, shard_id in module.get_expert_mapping():  # type: ignore[operator]
        if shard_id not in weights or not weight_name.startswith("experts."):
            return []
        name = f"{base}.{weight_name}weight" if base else f"{weight_name}weight"
        if name in specs:
            continue  # a redundant (EPLB) copy of a logical expert
        shape = (hidden, inter) if shard_id == "w2" else (inter, hidden)
        specs[name] = TensorSpec(name, _dtype_name(params[weights[shard_id]].dtype), shape)
        names.append(name)
    return names


class VllmReceiverCore:
    """One vLLM worker's receiving state: group membership, accepted manifest, open reload, version.

    `model` is called each time (the native backend may retarget its model); `runner`, when given,
    is the worker's model runner whose LoRA/encoder/multimodal caches are reset on finalize.
    Every method runs in the worker process, called by vLLM on every worker rank.
    """

    def __init__(
        self,
        model: Callable[[], torch.nn.Module],
        vllm_config: Any,
        device: str | torch.device | None,
        runner: Any = None,
    ) -> None:
        self._model = model
        self.vllm_config = vllm_config
        self.runner = runner
        self.receiver = WeightReceiver(device=torch.device(device) if device is not None else torch.device("cpu"))
        self._specs: tuple[int, Specs] | None = None
        self._stacks: tuple[int, FusedExperts] | None = None
        self._plan: tuple[int, ReceivePlan, dict[str, str]] | None = None
        self.version: Any = None
        self.reload_open = False
        self.stale = False
        self.last_report: dict[str, Any] | None = None
        self.staging = Staging()

    # --- group -------------------------------------------------------------------------------
    def join(self, rendezvous: dict[str, Any], rank: int, options: dict[str, Any]) -> None:
        """Join the weight-sync group as `rank` (collective with the sender and every worker)."""
        self.receiver.join(rendezvous, rank, options)

    def leave(self) -> None:
        self.close_reload()
        self.receiver.leave()
        self.staging.discard(drop_copy=True)

    # --- validate ----------------------------------------------------------------------------
    def specs(self) -> Specs:
        model = self._model()
        if self._specs is None or self._specs[0] != id(model):
            self._specs = (id(model), vllm_checkpoint_specs(model))
        return self._specs[1]

    def stacks(self) -> FusedExperts:
        """The stacked expert tensors a sync from `FusedExpertSource` may send in place of each
        layer's per-expert tensors (`planning/fused_experts.py`); each loads as its experts."""
        model = self._model()
        if self._stacks is None or self._stacks[0] != id(model):
            self._stacks = (id(model), fuse_specs(list(self.specs()[0].values()))[1])
        return self._stacks[1]

    def _accepts(self) -> dict[str, TensorSpec]:
        """Every name a manifest may carry: the per-expert names and the stacks."""
        return {**self.specs()[0], **{n: g.spec for n, g in self.stacks().groups.items()}}

    def _unstack(self, pairs: list[tuple[str, torch.Tensor]], held: Any = None) -> list[tuple[str, torch.Tensor]]:
        """A stack's experts as the loader takes them: expert e's tensor is the stack's row e (a
        view). `held`: the per-expert names this rank's plan holds (None: every expert)."""
        groups = self.stacks().groups
        out: list[tuple[str, torch.Tensor]] = []
        for name, tensor in pairs:
            g = groups.get(name)
            if g is None:
                out.append((name, tensor))
            else:
                out.extend((m, tensor[e]) for e, m in enumerate(g.members) if held is None or m in held)
        return out

    def expected_specs(self) -> list[list[Any]]:
        specs, _, _ = self.specs()
        return [[s.name, s.dtype, list(s.shape)] for s in specs.values()]

    def validate(self, encoded: bytes | str | None, digest: str, regions: bytes | str | None = None) -> dict[str, Any]:
        """Check a manifest against this worker's parameters; nothing moves. `encoded` may be base64.
        `regions`: this worker's region assignment (region delivery; may be base64).

        Returns `{"accepted", "need_manifest", "problems"}` (see WeightReceiver.validate).
        """
        try:
            encoded, regions = _unbase64(encoded), _unbase64(regions)
        except binascii.Error as exc:
            return {"accepted": False, "need_manifest": False, "problems": [f"corrupt manifest or region assignment: not base64 ({exc})"]}
        _, groups, _ = self.specs()
        stacks = self.stacks().groups

        def stacked_whole(manifest: BucketManifest) -> list[str]:
            sent = {s.name for s in manifest.specs}
            problems = [
                f"{n}: sent both stacked and as expert {m!r}; send one or the other"
                for n in sent & set(stacks) for m in stacks[n].members if m in sent
            ]
            sent |= {m for n in sent & set(stacks) for m in stacks[n].members}
            for group in groups:
                present = [n for n in group if n in sent]
                if present and len(present) != len(group):
                    missing = [n for n in group if n not in sent]
                    problems.append(f"{', '.join(missing)}: vLLM stacks these with {', '.join(present)}; send all of them or none")
            return problems

        return self.receiver.validate(encoded, digest, self._accepts(), extra_check=stacked_whole, regions=regions)

    # --- receive plan ------------------------------------------------------------------------
    def receive_plan(self) -> dict[str, Any]:
        """This worker's receive plan, recorded once per model from vLLM's own loaders (a dry run;
        never while a reload is open). Returns {"plan": wire form, "bytes", "model_bytes", "whole"};
        {"plan": None, "error"} when the dry run failed (the worker then receives whole tensors)."""
        from ckpt_engine.rollout_adapters.vllm_regions import record_receive_plan

        if self.reload_open:
            raise RuntimeError("cannot record a receive plan while a weight reload is open; finalize first")
        model = self._model()
        specs = self.specs()[0]
        if self._plan is None or self._plan[0] != id(model):
            # A tied head is the embedding's parameter: it is loaded from the embedding's regions
            # (see `receive`), so a trainer may leave it out.
            tied = self.specs()[2]
            try:
                plan, rec = record_receive_plan(model, {n: s for n, s in specs.items() if n not in tied}, self.vllm_config)
            except Exception as exc:  # this worker keeps today's full receive
                logger.warning("receive plan: recording failed (%s: %s); this worker receives whole tensors", type(exc).__name__, exc)
                return {"plan": None, "error": f"{type(exc).__name__}: {exc}"[:500]}
            self._plan = (id(model), plan, dict(rec.whole))
        _, plan, whole = self._plan
        needed = {n: s for n, s in specs.items() if n not in self.specs()[2]}
        model_bytes = held_bytes(ReceivePlan({n: None for n in needed}), needed)
        out = {"plan": plan.to_wire(), "bytes": held_bytes(plan, specs), "model_bytes": model_bytes, "whole": whole}
        if len(plan.holds) == len(needed) and all(rs is None for rs in plan.holds.values()):
            out["plan"] = None  # holds everything whole (no TP / EP): receive as without a plan
            plan = None
        self.receiver.set_plan(plan)
        return out

    def land(self, items: Iterable[tuple[str, Region | None, torch.Tensor]], *, poison: bool = False) -> int:
        """Load region items (no transport) through layerwise reload and finalize; the recorded plan
        says which regions make each name. Returns the names loaded."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        if self._plan is None:
            raise RuntimeError("call receive_plan() first")
        model = self._model()
        plan = self._plan[1]
        assembler = RegionAssembler(plan, self.specs()[0], self.receiver.device, poison=poison)
        alias = {emb: head for head, emb in self.specs()[2].items() if emb in plan.holds}
        self.close_reload()
        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(model)
        self.reload_open = True
        loaded = 0
        try:
            with torch.no_grad(), set_current_vllm_config(self.vllm_config):
                for name, region, tensor in items:
                    ready = assembler.add(name, region, tensor)
                    if ready:
                        model.load_weights(ready + [(alias[n], t) for n, t in ready if n in alias])
                        loaded += len(ready)
            if assembler.incomplete():
                raise RuntimeError(f"regions missing for {assembler.incomplete()[:5]}")
        finally:
            self.close_reload()
        return loaded

    # --- receive and load ---------------------------------------------------------------------
    def receive(self, digest: str, delta: dict[str, Any] | None = None) -> dict[str, Any]:
        """Receive every bucket of an accepted manifest and load it; layerwise reload stays open
        until `finalize` (or is closed here if the receive fails, never leaving meta layers).

        `delta` (a controller's delta request): patches land in this worker's base copy, are
        checked, and the full tensors then load through the same layerwise reload."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self._check_not_staging("receive")
        self.staging.discard()
        model = self._model()
        self.close_reload()
        detached = [0]

        def load(loadable: list[tuple[str, torch.Tensor]]) -> None:
            with set_current_vllm_config(self.vllm_config):
                model.load_weights(loadable)
            detached[0] += _detach_pending(model, loadable)

        self.stale = True
        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(model)
        self.reload_open = True
        try:
            out = self._stream(digest, delta, load)
        except BaseException:
            self.close_reload()
            raise
        out["detached_bytes"] = detached[0]
        self.last_report = out
        return out

    def _stream(self, digest: str, delta: dict[str, Any] | None, sink: Sink, staged: StagedReceive | None = None) -> dict[str, Any]:
        """Take every bucket of an accepted manifest and hand `sink` its loadable pairs (a tied
        head the trainer did not send rides along as its embedding's tensor). Returns the report.
        `staged`: a staged receive, which keeps region items as they are (the swap lands them)."""
        _, _, tied = self.specs()
        accepted = self.receiver.accepted_manifest(digest)
        sent = {s.name for s in accepted.specs} if accepted is not None else set()
        # A tied head the trainer did not send is loaded from its embedding, or layerwise reload
        # would put the old head back.
        alias = {emb: head for head, emb in tied.items() if head not in sent and emb in sent}

        def load(pairs: list[tuple[str, torch.Tensor]]) -> int:
            pairs = self._unstack(pairs)
            sink(pairs + [(alias[n], t) for n, t in pairs if n in alias])
            return len(pairs)

        plan = self.receiver.regions.plan  # None: this worker receives whole tensors
        landing: RegionLanding | None = None
        region_loader: Callable[[list[RegionItem]], int] | None = None
        if plan is not None and accepted is not None:
            # Region delivery: a tied head comes only as its embedding.
            fused, specs = fuse_plan(plan, accepted.specs), self._accepts()
            region_alias = {emb: head for head, emb in tied.items() if emb in plan.holds}

            def make(device: torch.device, into: Sink) -> RegionLanding:
                return RegionLanding(plan, fused, specs, device, self._unstack, region_alias, into)

            if staged is None:
                landing = make(self.receiver.device, sink)
                region_loader = landing.load
            else:
                landing, region_loader = staged.keep_regions(make)

        with torch.no_grad():
            report = self.receiver.receive(digest, load, delta=delta, region_loader=region_loader)
        if landing is not None and landing.incomplete():
            raise RuntimeError(f"region delivery ended with regions missing for {landing.incomplete()[:5]}")
        return report.to_dict()

    # --- staged receive and swap (see vllm_staging.py) ------------------------------------------
    def stage(self, digest: str, delta: dict[str, Any] | None = None) -> dict[str, Any]:
        """Start receiving an accepted manifest on a background thread, into staging; the live
        weights, the version and the engine's steps are untouched. Returns at once."""
        self._check_not_staging("staged receive")
        if self.receiver.accepted_manifest(digest) is None:
            raise RuntimeError(f"manifest {digest[:12]} was not validated on this worker; call validate() first")
        self.staging.discard()
        # With a delta request the base images (whole tensors or regions) hold the checked version
        # until the next receive: keep their views. Else each tensor or region is copied as it lands.
        keep_views = delta is not None
        self.staging.start(digest, lambda staged: self._stream(digest, delta, staged.sink, staged), keep_views, ShadowPreparer(self._model, self.vllm_config, self.receiver.device, self.staging.shadow_room))
        return {"started": True}

    def stage_status(self) -> dict[str, Any]:
        """Whether the staged receive ended: {"done", "error", "report"} (report once done)."""
        return self.staging.status()

    def swap(self, version: Any) -> dict[str, Any]:
        """Load the staged version into the live weights through layerwise reload and stamp
        `version`. Runs between two engine steps (a `collective_rpc` call), on every rank at once."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        staged = self.staging.take()  # raises unless a whole checked version is staged
        model = self._model()
        self.close_reload()
        t0 = time.perf_counter()
        self.stale = True  # until the last layer is loaded: a failure here leaves a mix
        if staged.shadow is not None:  # prepared off the step path: a copy (vllm_shadow.py); swap_in runs before finalize
            return {"load_s": staged.shadow.swap_in(), "shadow": True, **self.finalize(version), "swap_s": time.perf_counter() - t0}
        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(model)
        self.reload_open = True
        try:
            with torch.no_grad(), set_current_vllm_config(self.vllm_config):
                staged.load(model.load_weights, self.receiver.device)
        except BaseException:
            self.close_reload()
            raise
        load_s = time.perf_counter() - t0
        out = self.finalize(version)
        out.update(swap_s=time.perf_counter() - t0, load_s=load_s)
        return out

    def discard(self) -> dict[str, Any]:
        """Drop a staged version (after a failed stream elsewhere); the live weights are untouched."""
        return {"discarded": self.staging.discard()}

    def staging_room(self, nbytes: int, limit_bytes: int | None = None) -> dict[str, Any]:
        fits, why = self.staging.room(int(nbytes), self.receiver.device if self.receiver.device is not None else torch.device("cpu"), limit_bytes)
        return {"room": fits, "why": why}

    def _check_not_staging(self, what: str) -> None:
        if self.staging.running:
            raise RuntimeError(f"{what} refused: a staged receive is still streaming on this worker")

    def close_reload(self) -> float:
        """Finish layerwise reload if one is open (vLLM's post-processing); returns its seconds."""
        if not self.reload_open:
            return 0.0
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        t0 = time.perf_counter()
        self.reload_open = False
        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            finalize_layerwise_reload(self._model(), self.vllm_config.model_config)
        return time.perf_counter() - t0

    def finalize(self, version: Any) -> dict[str, Any]:
        """Post-process what was loaded, reset the runner's weight-derived caches, stamp `version`."""
        seconds = self.close_reload()
        if self.runner is not None:
            for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
                fn = getattr(self.runner, reset, None)
                if fn is not None:
                    fn()
        self.version, self.stale = version, False
        return {"finalize_s": seconds, "version": version}

    def health(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "stale": self.stale,
            "buckets_received": self.receiver.buckets_received,
            "last_report": self.last_report,
            "staged": self.staging.describe(),
            "staging_copy_bytes": self.staging.copy.nbytes,
        }


def _unbase64(value: bytes | str | None) -> bytes | None:
    """Bytes as sent in process, or base64 text as sent over HTTP (JSON carries no bytes)."""
    return base64.b64decode(value, validate=True) if isinstance(value, str) else value


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
