"""Megatron-core `GPTModel` training engine (TP/PP/EP) whose weights sync as Hugging Face tensors.

The model is built from a Hugging Face config (`transformers` config object, or any object with
the same attributes) through the family table in `ckpt_engine/sources/hf_names.py`;
`load_hf_weights` fills it from HF tensors (the reverse conversion), which makes parity with the
HF model testable. The engine's weights, as a sync reads them, are `self.source`: a
`MegatronSource` built from the model (`ckpt_engine.sources.megatron`: the export walk over
stages, and one sender per (stage, EP rank) for many senders).

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

from ckpt_engine.sources.megatron import EXPORT_MODES, MegatronSource
from ckpt_engine.sources.megatron_export import MegatronExporter, _hf, _partition_dim, check_exportable, head_dim_of, megatron_core_model
from ckpt_engine.trainer.engines.megatron_load import load_hf, vocab_padding_rows
from ckpt_engine.sources.megatron_groups import MegatronGroups
from ckpt_engine.sources.wire import WirePolicy, check_float_dtype, torch_dtype
from ckpt_engine.trainer.engines.base import LossFn, TrainEngine
from ckpt_engine.trainer.engines.common import TrainConfig, adamw_with_schedule, clip_and_step
from ckpt_engine.trainer.engines.megatron_checkpoint import load_megatron_checkpoint, save_megatron_checkpoint

__all__ = ["MegatronConfig", "MegatronTrainEngine", "build_gpt_model", "transformer_config_from_hf"]

logger = logging.getLogger(__name__)

OPTIMIZERS = ("adamw", "megatron_distributed")


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
    optimizer: str = "adamw"
    """"adamw": torch AdamW on this rank's shards, gradients averaged over DP here (runs on CPU);
    "megatron_distributed": megatron-core's DistributedDataParallel (contiguous grad buffers,
    reduce-scatter over DP) and DistributedOptimizer (fp32 main weights sharded over DP, clipping
    by the global norm), as Megatron-LM trains. Megatron applies `weight_decay` to matrices only
    (not to biases and norms), torch AdamW to every parameter."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_float_dtype("MegatronConfig.params_dtype", self.params_dtype)
        if self.transformer_impl not in ("local", "transformer_engine"):
            raise ValueError(f"MegatronConfig.transformer_impl must be 'local' or 'transformer_engine', got {self.transformer_impl!r}")
        if self.export_mode not in EXPORT_MODES:
            raise ValueError(f"MegatronConfig.export_mode must be one of {EXPORT_MODES}, got {self.export_mode!r}")
        if self.make_vocab_size_divisible_by < 1:
            raise ValueError(f"MegatronConfig.make_vocab_size_divisible_by must be >= 1, got {self.make_vocab_size_divisible_by}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"MegatronConfig.optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
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


def megatron_moe_without_te_compat() -> None:
    """megatron-core 0.16.1 without Transformer Engine: `moe_utils.RouterGatingLinearFunction`
    tests the module global `te_general_gemm`, which only its (failed) TE import defines, so every
    MoE forward raised NameError on 2xH200. Define it as None, the value its own check means as
    "no TE" (it then uses torch.mm). A no-op once TE or a fixed megatron-core defines it."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def megatron_adam(cfg: MegatronConfig, chunks: list[nn.Module], *, clip_grad: float, **kw: Any) -> Any:
    """megatron-core's distributed Adam over DDP- or FSDP-wrapped `chunks` (needs CUDA)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    dtype = torch_dtype(cfg.params_dtype)
    return get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", lr=cfg.lr, weight_decay=cfg.weight_decay, adam_beta1=cfg.betas[0], adam_beta2=cfg.betas[1],
            adam_eps=cfg.eps, clip_grad=clip_grad, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
            params_dtype=dtype, use_distributed_optimizer=True,
        ),
        chunks,
        **kw,
    )


def build_gpt_model(hf_config: Any, cfg: MegatronConfig, pg_collection: Any = None) -> nn.Module:
    """One GPTModel chunk for this rank's pipeline stage (virtual pipelining is not used)."""
    from megatron.core.models.gpt import GPTModel

    groups = MegatronGroups.from_megatron(pg_collection)
    tconf = transformer_config_from_hf(hf_config, cfg, groups.tp_size, groups.pp_size, groups.ep_size)
    family = check_exportable(hf_config)
    num_experts = hf_config.num_experts if family.expert else None
    if num_experts:
        megatron_moe_without_te_compat()
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


# --- the engine -----------------------------------------------------------------------------------


class MegatronTrainEngine(TrainEngine):
    """Megatron-core GPT training (TP/PP/EP, DP over replicas); `source` is its HF-named weights
    for the rollout (a `MegatronSource`: one sender, or one per (stage, EP rank)).

    `hf_config` is the HF config of the model family; `model` an already built GPTModel chunk
    (default: built here with `build_gpt_model`). Initial weights: Megatron's own init, or
    `load_hf_weights(state_dict)` afterwards.
    """

    def __init__(self, hf_config: Any, *, config: MegatronConfig | None = None, model: nn.Module | None = None, pg_collection: Any = None) -> None:
        self.config = config if config is not None else MegatronConfig()
        check_exportable(hf_config)  # ValueError before any model is built
        self.hf_config = hf_config
        self.groups = MegatronGroups.from_megatron(pg_collection)
        self.pg_collection = pg_collection
        if model is None:
            model = build_gpt_model(hf_config, self.config, pg_collection)
            if torch.cuda.is_available():
                model = model.cuda()  # before the optimizer sees the params
        for p in model.parameters():
            setattr(p, "main_grad", None)  # megatron layers read .main_grad only under gradient_accumulation_fusion
        with torch.no_grad():  # vocab padding rows: zero, so that a rank's state does not depend on TP
            for w, first in vocab_padding_rows(MegatronExporter(model, hf_config, WirePolicy(None, ()), self.groups)):
                w[first:].zero_()
        self.global_step = 0
        self._sched_step = 0
        self._fresh_step = True
        self.megatron_optimizer = self.config.optimizer == "megatron_distributed"
        if self.megatron_optimizer:
            model, self.optimizer = self._distributed_optimizer(model)
            self.scheduler = None
            self._apply_lr()
        else:
            self.optimizer, self.scheduler = adamw_with_schedule(model, self.config)
        self.model = model
        self.source: MegatronSource = MegatronSource(
            model, hf_config, pg_collection=pg_collection, dtype=self.config.wire_dtype, keep_fp32=self.config.keep_fp32_patterns,
            export_mode=self.config.export_mode,
        )

    def _distributed_optimizer(self, model: nn.Module) -> tuple[nn.Module, Any]:
        """Wrap `model` in megatron-core DDP and build its DistributedOptimizer over it (needs CUDA)."""
        if not torch.cuda.is_available():
            raise RuntimeError("MegatronConfig.optimizer='megatron_distributed' needs CUDA (megatron-core DDP keeps its grad buffers on the GPU)")
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads

        ddp_config = DistributedDataParallelConfig(
            use_distributed_optimizer=True, grad_reduce_in_fp32=True, overlap_grad_reduce=False, overlap_param_gather=False,
        )
        kw: dict[str, Any] = {"pg_collection": self.pg_collection} if self.pg_collection is not None else {}
        config: Any = model.config  # megatron-core's TransformerConfig (not read by the type checker)
        ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model, **kw)
        config.finalize_model_grads_func = finalize_model_grads  # DP reduce-scatter, tied-embedding all-reduce
        config.no_sync_func = ddp.no_sync
        return ddp, megatron_adam(self.config, [ddp], clip_grad=0.0, **kw)

    # --- weights -----------------------------------------------------------------------------
    def load_hf_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Initialize from full HF tensors (HF -> Megatron); every rank passes the same dict."""
        load_hf(self.source.exporter, state_dict)

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

        if self.megatron_optimizer and self._fresh_step:  # first micro-batch since the last step
            ddp: Any = self.model  # megatron-core's DistributedDataParallel (not read by the type checker)
            ddp.zero_grad_buffer()
            self.optimizer.zero_grad()
        self._fresh_step = False
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
        self._finalize_grads()
        return {"loss": float(loss[0])}

    def _finalize_grads(self) -> None:
        """What megatron's `finalize_model_grads` does for a plain (unwrapped) model: tied embedding
        grads summed over the first and last stage, then the DP average. With the distributed
        optimizer the schedule already ran megatron's own."""
        if self.megatron_optimizer:
            return
        self._allreduce_tied_embedding_grads()
        self._allreduce_dp_grads()

    def _allreduce_tied_embedding_grads(self) -> None:
        """PP > 1 with tied embeddings: the first stage's input embedding and the last stage's
        output layer are one HF tensor held twice; summing their grads over the embedding group
        keeps the two copies equal after every step (each copy gets the full gradient)."""
        core = megatron_core_model(self.model)
        g = self.groups
        if g.pp_size == 1 or not getattr(core, "share_embeddings_and_output_weights", False):
            return
        if g.embd is None or dist.get_rank() not in dist.get_process_group_ranks(g.embd):
            return
        weight = core.shared_embedding_or_output_weight()
        if weight is None:
            return
        if weight.grad is None:  # no gradient this step on this stage: contribute zeros
            weight.grad = torch.zeros_like(weight)
        dist.all_reduce(weight.grad, group=g.embd)

    def _allreduce_dp_grads(self) -> None:
        """Average gradients over data parallelism. Expert parameters under EP > 1 (megatron marks
        them `allreduce=False`) hold different experts on each EP rank: they are summed over the
        expert-DP group only, but still divided by the full DP size, because every EP rank's tokens
        already reached them through the dispatcher (what megatron's DDP does)."""
        g = self.groups
        dp = 1 if g.dp is None else dist.get_world_size(g.dp)
        if dp == 1:
            return
        edp = 1 if g.edp is None else dist.get_world_size(g.edp)
        for p in self.model.parameters():  # plain all-reduces (Megatron's bucketed DDP: optimizer="megatron_distributed")
            if p.grad is None:
                continue
            if getattr(p, "allreduce", True):
                dist.all_reduce(p.grad, group=g.dp)
            elif edp > 1:
                dist.all_reduce(p.grad, group=g.edp)
            p.grad.div_(dp)

    def grad_norm(self) -> float:
        """Global grad norm: each distinct gradient element counted once.

        Dense parameters: TP-duplicated ones (no partition_dim) counted on TP rank 0 only, summed
        over the model-parallel (TP x PP) group. Expert parameters under EP differ per EP rank:
        summed over the EP, expert-TP and PP groups instead."""
        dense = torch.zeros((), dtype=torch.float64, device=self._device())
        expert = torch.zeros((), dtype=torch.float64, device=self._device())
        g = self.groups
        for p in self.model.parameters():
            if p.grad is None:
                continue
            is_expert = not getattr(p, "allreduce", True)
            if _partition_dim(p) is None and (g.etp_rank if is_expert else g.tp_rank) != 0:
                continue
            sq = torch.linalg.vector_norm(p.grad, dtype=torch.float64).square()
            if is_expert:
                expert += sq
            else:
                dense += sq
        if g.mp is not None:
            dist.all_reduce(dense, group=g.mp)
        for group in (g.ep, g.etp, g.pp):
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(expert, group=group)
        return math.sqrt(float(dense + expert))

    def optimizer_step(self) -> float:
        """Clip by the global grad norm, step, zero grads; returns the pre-clip norm.

        A non-finite norm skips the update on every rank alike (both optimizers)."""
        if self.megatron_optimizer:
            return self._megatron_step()
        norm = self.grad_norm()
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        if clip_and_step(self.optimizer, grads, norm, self.config.max_grad_norm, self.global_step):
            self.global_step += 1
        return norm

    def _megatron_step(self) -> float:
        """megatron-core's step split open so that a non-finite norm skips the update (its fp32
        path has no grad scaler, so `step()` would apply NaNs)."""
        self._fresh_step = True
        found_inf = self.optimizer.prepare_grads()
        norm = float(self.optimizer.get_grad_norm()) if not found_inf else math.nan
        if not math.isfinite(norm):
            logger.warning("step %d: grad norm is %s, skipping the update", self.global_step, norm)
            return norm
        if self.config.max_grad_norm is not None:
            self.optimizer.clip_grad_norm(self.config.max_grad_norm)
        if self.optimizer.step_with_ready_grads():
            self.global_step += 1
        return norm

    def lr_scheduler_step(self) -> None:
        self._sched_step += 1
        if self.scheduler is not None:
            self.scheduler.step()
        else:
            self._apply_lr()

    def _apply_lr(self) -> None:
        lr = self.config.lr * self.config.lr_factor(self._sched_step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def train_mode(self) -> None:
        self.model.train()

    def eval_mode(self) -> None:
        self.model.eval()

    # --- checkpoint --------------------------------------------------------------------------
    def save_checkpoint(self, path: str) -> None:
        """Layout-independent checkpoint (full HF-named weights and AdamW moments, `megatron_checkpoint.py`):
        loads into any TP/PP/EP layout. Every rank calls it; one rank writes."""
        save_megatron_checkpoint(self, path)

    def load_checkpoint(self, path: str) -> None:
        load_megatron_checkpoint(self, path)
