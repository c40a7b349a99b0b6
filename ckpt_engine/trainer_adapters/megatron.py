"""Megatron-core `GPTModel` training engine (TP/PP/EP) exporting Hugging Face checkpoint weights.

The model is built from a Hugging Face config (`transformers` config object, or any object with
the same attributes) through the family table in `hf_names.py`; `load_hf_weights` fills it from
HF tensors (the reverse conversion), which makes parity with the HF model testable. The
conversion itself (naming plan, TP/EP gathers, HF -> Megatron load) is `megatron_export.py`.

Export walks every pipeline stage in order. On the owning stage each parameter is gathered over
its tensor-parallel group along its `partition_dim` (layout-aware for `linear_fc1` = [gate; up]
per shard), experts over the expert-parallel group, then converted to HF names and layouts
(`linear_qkv` per query group -> q/k/v). With `export_mode="gather_to_first"` the stage then
broadcasts it over its pipeline group, so global rank 0 (`is_sender`) yields every tensor; with
`"per_stage"` each stage's first TP/DP/EP rank is a sender of its own stage (multi-sender).

Collective contract: every rank of the model-parallel world calls every public method, in the
same order. Groups come from `pg_collection` (megatron's `ProcessGroupCollection`) or, when it is
None, from `megatron.core.parallel_state` (initialized by the caller, as Megatron users do).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ckpt_engine.manifest import TensorSpec
from ckpt_engine.trainer_adapters.base import LossFn, TrainEngine
from ckpt_engine.trainer_adapters.common import TrainConfig, check_float_dtype, clip_and_step, torch_dtype
from ckpt_engine.trainer_adapters.megatron_export import (  # re-exported: the public names stay importable from here
    MegatronExporter,
    _hf,
    _partition_dim,
    check_exportable,
    head_dim_of,
)

__all__ = [
    "MegatronConfig", "MegatronTrainEngine", "MegatronExporter", "build_gpt_model", "check_exportable", "head_dim_of",
    "transformer_config_from_hf",
]

logger = logging.getLogger(__name__)

EXPORT_MODES = ("gather_to_first", "per_stage")


@dataclass(kw_only=True)
class MegatronConfig(TrainConfig):
    """Parallel layout, model build and export settings, plus the shared `TrainConfig`."""

    params_dtype: str = "float32"
    """dtype of the parameters Megatron holds (fp32 master training on CPU/tests; bf16 for speed)."""
    make_vocab_size_divisible_by: int = 128
    """Vocab padding as in Megatron-LM: rows padded to a multiple of this times TP; trimmed on export."""
    transformer_impl: str = "local"
    """"local" (pure megatron-core, runs anywhere) or "transformer_engine" (TE layer spec, CUDA)."""
    use_cpu_initialization: bool = True
    export_mode: str = "gather_to_first"
    micro_batch_size: int | None = None
    """Sequences per micro-batch in `forward_backward` (None: the whole rank batch at once)."""
    moe_token_dispatcher_type: str = "alltoall"
    """MoE token dispatcher: "alltoall" (megatron's default for EP; its constructor creates a CUDA
    stream, so it needs CUDA even to build the model) or "allgather" (builds without CUDA)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_float_dtype("MegatronConfig.params_dtype", self.params_dtype)
        if self.transformer_impl not in ("local", "transformer_engine"):
            raise ValueError(f"MegatronConfig.transformer_impl must be 'local' or 'transformer_engine', got {self.transformer_impl!r}")
        if self.export_mode not in EXPORT_MODES:
            raise ValueError(f"MegatronConfig.export_mode must be one of {EXPORT_MODES}, got {self.export_mode!r}")
        if self.make_vocab_size_divisible_by < 1:
            raise ValueError(f"MegatronConfig.make_vocab_size_divisible_by must be >= 1, got {self.make_vocab_size_divisible_by}")
        if self.moe_token_dispatcher_type not in ("alltoall", "allgather"):
            raise ValueError(
                f"MegatronConfig.moe_token_dispatcher_type must be 'alltoall' or 'allgather', got {self.moe_token_dispatcher_type!r}"
            )


# --- model construction ---------------------------------------------------------------------------


def padded_vocab_size(vocab: int, divisible_by: int, tp: int) -> int:
    multiple = divisible_by * tp
    return int(math.ceil(vocab / multiple) * multiple)


def transformer_config_from_hf(hf_config: Any, cfg: MegatronConfig, tp: int, pp: int, ep: int) -> Any:
    """megatron-core TransformerConfig equivalent to a Qwen2/Llama/Qwen3 HF config."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    family = check_exportable(hf_config)
    dtype = torch_dtype(cfg.params_dtype)
    moe = bool(family.expert)
    kw: dict[str, Any] = dict(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        num_attention_heads=hf_config.num_attention_heads,
        num_query_groups=_hf(hf_config, "num_key_value_heads", hf_config.num_attention_heads),
        kv_channels=head_dim_of(hf_config),
        ffn_hidden_size=_hf(hf_config, "moe_intermediate_size", hf_config.intermediate_size) if moe else hf_config.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=_hf(hf_config, "rms_norm_eps", 1e-6),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=bool(_hf(hf_config, "attention_bias", hf_config.model_type == "qwen2")),
        qk_layernorm="self_attention.q_layernorm.weight" in family.layer,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=_hf(hf_config, "initializer_range", 0.02),
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        sequence_parallel=False,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=cfg.use_cpu_initialization,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
    )
    if moe:
        kw.update(
            num_moe_experts=hf_config.num_experts,
            moe_router_topk=hf_config.num_experts_per_tok,
            # HF norm_topk_prob=True (Qwen3-MoE): softmax over all experts, top-k, renormalize ==
            # softmax over the top-k logits, which is megatron's pre_softmax=False; without the
            # renormalization (Qwen2-MoE default) it is softmax first, then top-k (pre_softmax=True).
            moe_router_pre_softmax=not bool(_hf(hf_config, "norm_topk_prob", False)),
            moe_token_dispatcher_type=cfg.moe_token_dispatcher_type,
            moe_grouped_gemm=False,
        )
    return TransformerConfig(**kw)


def _rope_theta(hf_config: Any) -> float:
    params = getattr(hf_config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", _hf(hf_config, "rope_theta", 10000.0)))


def build_gpt_model(hf_config: Any, cfg: MegatronConfig, pg_collection: Any = None) -> nn.Module:
    """One GPTModel chunk for this rank's pipeline stage (virtual pipelining is not used)."""
    from megatron.core.models.gpt import GPTModel

    groups = _Groups.from_megatron(pg_collection)
    tconf = transformer_config_from_hf(hf_config, cfg, groups.tp_size, groups.pp_size, groups.ep_size)
    family = check_exportable(hf_config)
    num_experts = hf_config.num_experts if family.expert else None
    if cfg.transformer_impl == "transformer_engine":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        spec = get_gpt_layer_with_transformer_engine_spec(num_experts=num_experts, qk_layernorm=tconf.qk_layernorm)
    else:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        spec = get_gpt_layer_local_spec(num_experts=num_experts, qk_layernorm=tconf.qk_layernorm, normalization="RMSNorm")
    kw: dict[str, Any] = dict(
        config=tconf,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab_size(hf_config.vocab_size, cfg.make_vocab_size_divisible_by, groups.tp_size),
        max_sequence_length=_hf(hf_config, "max_position_embeddings", 4096),
        pre_process=groups.pp_rank == 0,
        post_process=groups.pp_rank == groups.pp_size - 1,
        share_embeddings_and_output_weights=bool(_hf(hf_config, "tie_word_embeddings", False)),
        position_embedding_type="rope",
        rotary_base=int(_rope_theta(hf_config)),
    )
    if pg_collection is not None:
        kw["pg_collection"] = pg_collection
    return GPTModel(**kw)


# --- process groups -------------------------------------------------------------------------------


@dataclass
class _Groups:
    tp: Any
    pp: Any
    dp: Any
    ep: Any
    etp: Any
    mp: Any  # tensor x pipeline (grad-norm reduction)

    @classmethod
    def from_megatron(cls, pg_collection: Any = None) -> _Groups:
        if pg_collection is not None:
            g = pg_collection
            return cls(g.tp, g.pp, getattr(g, "dp", None), getattr(g, "ep", None), getattr(g, "expt_tp", None), getattr(g, "mp", None))
        from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            raise RuntimeError("call megatron.core.parallel_state.initialize_model_parallel() first, or pass pg_collection")
        return cls(
            ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_group(),
            ps.get_data_parallel_group(), ps.get_expert_model_parallel_group(),
            ps.get_expert_tensor_parallel_group(), ps.get_model_parallel_group(),
        )

    @staticmethod
    def _size(g: Any) -> int:
        return 1 if g is None else dist.get_world_size(g)

    @staticmethod
    def _rank(g: Any) -> int:
        return 0 if g is None else dist.get_rank(g)

    tp_size = property(lambda self: self._size(self.tp))
    tp_rank = property(lambda self: self._rank(self.tp))
    pp_size = property(lambda self: self._size(self.pp))
    pp_rank = property(lambda self: self._rank(self.pp))
    dp_rank = property(lambda self: self._rank(self.dp))
    ep_size = property(lambda self: self._size(self.ep))
    ep_rank = property(lambda self: self._rank(self.ep))
    etp_size = property(lambda self: self._size(self.etp))
    etp_rank = property(lambda self: self._rank(self.etp))


# --- the engine -----------------------------------------------------------------------------------


class MegatronTrainEngine(TrainEngine):
    """Megatron-core GPT training (TP/PP/EP, DP over replicas) with HF-named export.

    `hf_config` is the HF config of the model family; `model` an already built GPTModel chunk
    (default: built here with `build_gpt_model`). Initial weights: Megatron's own init, or
    `load_hf_weights(state_dict)` afterwards.
    """

    def __init__(self, hf_config: Any, *, config: MegatronConfig | None = None, model: nn.Module | None = None, pg_collection: Any = None) -> None:
        self.config = config if config is not None else MegatronConfig()
        check_exportable(hf_config)  # ValueError before any model is built
        self.hf_config = hf_config
        self.groups = _Groups.from_megatron(pg_collection)
        self.pg_collection = pg_collection
        if model is None:
            model = build_gpt_model(hf_config, self.config, pg_collection)
            if torch.cuda.is_available():
                model = model.cuda()  # before the optimizer sees the params
        self.model = model
        self.exporter = MegatronExporter(self.model, hf_config, self.config, self.groups)
        self._stages = self.exporter.stage_specs()
        g = self.groups
        first_of_stage = g.tp_rank == 0 and g.dp_rank == 0 and g.ep_rank == 0
        if self.config.export_mode == "per_stage":
            self.is_sender = first_of_stage
        else:
            self.is_sender = first_of_stage and g.pp_rank == 0
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=self.config.lr, betas=self.config.betas, eps=self.config.eps, weight_decay=self.config.weight_decay,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self.config.lr_factor)
        self.global_step = 0
        for p in self.model.parameters():
            p.main_grad = None  # megatron layers read .main_grad only under gradient_accumulation_fusion

    # --- weights -----------------------------------------------------------------------------
    def load_hf_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Initialize from full HF tensors (HF -> Megatron); every rank passes the same dict."""
        self.exporter.load_hf(state_dict)

    def metadata(self) -> list[TensorSpec]:
        """Every stage's specs ("gather_to_first") or this stage's ("per_stage"); no tensor gathers."""
        if self.config.export_mode == "per_stage":
            return list(self._stages[self.groups.pp_rank])
        return [s for stage in self._stages for s in stage]

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF tensors; every rank walks it. TP/EP gathers on the owning stage, then a PP broadcast."""
        g = self.groups
        if self.config.export_mode == "per_stage" or g.pp_size == 1:
            yield from self.exporter.iter_local()
            return
        pp_ranks = dist.get_process_group_ranks(g.pp)
        for stage, specs in enumerate(self._stages):
            local = self.exporter.iter_local() if stage == g.pp_rank else None
            for spec in specs:
                if local is not None:
                    name, t = next(local)
                    assert name == spec.name, (name, spec.name)
                    t = t.contiguous()
                else:
                    t = torch.empty(spec.shape, dtype=torch_dtype(spec.dtype), device=self._device())
                dist.broadcast(t, src=pp_ranks[stage], group=g.pp)
                yield spec.name, t
            if local is not None and next(local, None) is not None:
                raise RuntimeError(f"stage {stage} produced more tensors than its metadata lists")

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    # --- training ----------------------------------------------------------------------------
    def forward_backward(self, batch: dict[str, torch.Tensor], loss_fn: LossFn) -> dict[str, float]:
        """Megatron's pipeline schedule over micro-batches of this rank's batch; every rank calls it.

        `loss_fn` sees full-vocabulary logits [batch, seq, vocab] (gathered over TP, padding
        trimmed) on the last stage. Returns the mean micro-batch loss, broadcast to all stages.
        """
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        ids = batch["input_ids"]
        mbs = self.config.micro_batch_size or ids.shape[0]
        if ids.shape[0] % mbs:
            raise ValueError(f"batch of {ids.shape[0]} sequences is not a multiple of micro_batch_size={mbs}")
        micro = [{k: v[i : i + mbs] for k, v in batch.items()} for i in range(0, ids.shape[0], mbs)]
        seq = ids.shape[1]
        position_ids = torch.arange(seq, device=ids.device).unsqueeze(0).expand(mbs, -1)
        vocab = self.hf_config.vocab_size
        n = len(micro)

        def step(data_iter: Iterator[dict[str, torch.Tensor]], model: nn.Module) -> tuple[torch.Tensor, Any]:
            mb = next(data_iter)
            out = model(mb["input_ids"], position_ids, None)

            def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
                logits = gather_from_tensor_model_parallel_region(output)[..., :vocab]
                loss = loss_fn(logits, mb)
                # Megatron's schedule divides a 2-tuple loss by num_microbatches itself (in place,
                # megatron-core schedules.forward_step_calc_loss): no `/ n` here, and the reported
                # value is a copy so that in-place division does not reach it.
                return loss, {"loss": loss.detach().clone()}

            return out, loss_func

        fb = get_forward_backward_func()
        kw: dict[str, Any] = dict(
            forward_step_func=step, data_iterator=iter(micro), model=[self.model], num_microbatches=n,
            seq_length=seq, micro_batch_size=mbs, forward_only=False,
        )
        if self.pg_collection is not None:
            kw["pg_collection"] = self.pg_collection
        results = fb(**kw)
        loss = torch.zeros(1, dtype=torch.float32, device=self._device())
        if results:
            loss[0] = sum(float(r["loss"]) for r in results) / len(results)
        if self.groups.pp_size > 1:  # last stage knows the loss; share it
            dist.broadcast(loss, src=dist.get_process_group_ranks(self.groups.pp)[-1], group=self.groups.pp)
        self._allreduce_dp_grads()
        return {"loss": float(loss[0])}

    def _allreduce_dp_grads(self) -> None:
        g = self.groups
        if g.dp is None or dist.get_world_size(g.dp) == 1:
            return
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        for t in grads:  # plain DP average (Megatron's DDP bucketed reducer is out of scope here)
            dist.all_reduce(t, group=g.dp)
            t.div_(dist.get_world_size(g.dp))

    def grad_norm(self) -> float:
        """Global grad norm: TP-duplicated params counted once, summed over the model-parallel group."""
        sq = torch.zeros((), dtype=torch.float64, device=self._device())
        tp_rank = self.groups.tp_rank
        for p in self.model.parameters():
            if p.grad is None:
                continue
            if _partition_dim(p) is None and tp_rank != 0:
                continue
            sq += torch.linalg.vector_norm(p.grad, dtype=torch.float64).square()
        if self.groups.mp is not None:
            dist.all_reduce(sq, group=self.groups.mp)
        return math.sqrt(float(sq))

    def optimizer_step(self) -> float:
        norm = self.grad_norm()
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        if clip_and_step(self.optimizer, grads, norm, self.config.max_grad_norm, self.global_step):
            self.global_step += 1
        return norm

    def lr_scheduler_step(self) -> None:
        self.scheduler.step()

    def train_mode(self) -> None:
        self.model.train()

    def eval_mode(self) -> None:
        self.model.eval()

    # --- checkpoint --------------------------------------------------------------------------
    def save_checkpoint(self, path: str) -> None:
        """Per-rank DCP-style checkpoint of this rank's shards (same layout required to load)."""
        import torch.distributed.checkpoint as dcp

        if self.groups.dp_rank == 0:  # DP replicas hold the same shards: one writes, the others wait
            dcp.save(self._state(), checkpoint_id=self._ckpt_dir(path), no_dist=True)
        if self.groups.dp is not None:
            dist.barrier(group=self.groups.dp)

    def load_checkpoint(self, path: str) -> None:
        import torch.distributed.checkpoint as dcp

        state = self._state()
        dcp.load(state, checkpoint_id=self._ckpt_dir(path), no_dist=True)
        self.model.load_state_dict(state["model"], strict=False)
        self.optimizer.load_state_dict(state["optimizer"])
        self.global_step = int(state["trainer"]["global_step"])
        # the schedule's own position: it differs from global_step once a non-finite step was skipped
        self.scheduler.last_epoch = int(state["trainer"]["scheduler_step"])
        for group in self.optimizer.param_groups:
            group["lr"] = group["initial_lr"] * self.config.lr_factor(self.scheduler.last_epoch)

    def _ckpt_dir(self, path: str) -> str:
        g = self.groups
        return f"{path}/mp_rank_{g.tp_rank:02d}_{g.pp_rank:03d}_{g.ep_rank:03d}"

    def _state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        model_sd = {k: v for k, v in model_sd.items() if isinstance(v, torch.Tensor)}  # drop TE _extra_state
        return {"model": model_sd, "optimizer": optim_sd, "trainer": {
            "global_step": torch.tensor(self.global_step, dtype=torch.int64),
            "scheduler_step": torch.tensor(self.scheduler.last_epoch, dtype=torch.int64),
        }}
