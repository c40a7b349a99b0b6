"""Megatron-core `GPTModel` -> Hugging Face conversion (naming, layouts, TP/EP gathers).

`MegatronExporter` holds one rank's conversion plan: the HF name, shape and layout of every
Megatron parameter (`hf_names.py` tables) and the export walk of a stage (TP gathers along
`partition_dim`, layout-aware for `linear_fc1`, experts over the EP group, `linear_qkv` -> q/k/v).
The sources hold the process groups and the walk over stages. Collective contract: every rank of
the model-parallel world calls `stage_specs` and `iter_local` in the same order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from ckpt_engine.manifest import TensorSpec
from ckpt_engine.sources.hf_names import (
    MegatronFamily,
    megatron_family,
    split_gate_up,
    split_qkv,
)
from ckpt_engine.sources.wire import WirePolicy, dtype_name, torch_dtype

if TYPE_CHECKING:
    from ckpt_engine.sources.megatron_groups import MegatronGroups

__all__ = ["MegatronExporter", "check_exportable", "collective_device", "head_dim_of", "megatron_core_model", "walk_to_first_stage"]


def collective_device(group: Any) -> torch.device:
    """Device of a small tensor made for a collective on `group` (counts, flags).

    NCCL takes CUDA tensors only ("No backend type associated with device type cpu"); gloo, and
    groups that also carry a CPU backend ("cpu:gloo,cuda:nccl"), take CPU tensors.
    """
    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


# --- HF config checks -----------------------------------------------------------------------------


def _hf(hf_config: Any, name: str, default: Any = None) -> Any:
    value = getattr(hf_config, name, default)
    return default if value is None else value


def head_dim_of(hf_config: Any) -> int:
    return int(_hf(hf_config, "head_dim", hf_config.hidden_size // hf_config.num_attention_heads))


def check_exportable(hf_config: Any) -> MegatronFamily:
    """The family table for `hf_config`, or ValueError for layouts the exporter cannot convert."""
    from transformers import PretrainedConfig

    if not isinstance(hf_config, PretrainedConfig):
        raise ValueError(f"the Megatron engines take the model's transformers PretrainedConfig as hf_config, got {type(hf_config).__name__}")
    family = megatron_family(hf_config.model_type)
    heads, groups = hf_config.num_attention_heads, _hf(hf_config, "num_key_value_heads", hf_config.num_attention_heads)
    if heads % groups:
        raise ValueError(f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({groups})")
    if _hf(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"only SwiGLU MLPs (hidden_act='silu') convert to linear_fc1, got {hf_config.hidden_act!r}")
    if getattr(hf_config, "sliding_window", None) and getattr(hf_config, "use_sliding_window", False):
        raise ValueError("sliding-window attention has no megatron-core GPTModel equivalent here")
    if family.expert and (_hf(hf_config, "decoder_sparse_step", 1) != 1 or list(_hf(hf_config, "mlp_only_layers", []))):
        raise ValueError(
            "MoE models with dense decoder layers (mlp_only_layers / decoder_sparse_step != 1) cannot be built: "
            "every Megatron layer here is an MoE layer"
        )
    return family




# --- conversion plan ------------------------------------------------------------------------------


@dataclass(eq=False)  # identity hash: items key dicts/sets in the expert walk
class _Item:
    """One Megatron parameter of this stage and the HF tensors it becomes.

    The parameter is looked up on its owning module at export time (`param`), because wrappers
    such as Megatron-FSDP swap module parameters between raw and distributed forms.
    """

    owner: nn.Module
    attr: str
    kind: str  # copy | qkv | gate_up | vocab
    hf_names: tuple[str, ...]
    hf_shapes: tuple[tuple[int, ...], ...]
    partition_dim: int | None  # TP split dim, None when replicated
    expert: bool = False
    local_expert: int = 0
    specs: list[TensorSpec] = field(default_factory=list)

    @property
    def param(self) -> torch.Tensor:
        return getattr(self.owner, self.attr)


def _owner(root: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return (root.get_submodule(path) if path else root), attr


class MegatronExporter:
    """Megatron <-> HF conversion for one rank's model chunk: metadata, gather, load.

    Pure bookkeeping plus the collectives of the walk; `MegatronSource` and `MegatronFSDPSource`
    share it (the FSDP variant supplies full, un-sharded-by-FSDP params).
    """

    def __init__(
        self,
        model: nn.Module,
        hf_config: Any,
        wire: WirePolicy,
        groups: MegatronGroups,
        local_tensor: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        """`local_tensor(param)` gives this TP rank's full shard of a parameter (default: its data;
        Megatron-FSDP passes a gather over the data-parallel shards)."""
        self.family = check_exportable(hf_config)
        self.hf_config = hf_config
        self.groups = groups
        self.model = model
        self.tied = bool(_hf(hf_config, "tie_word_embeddings", False))
        self.vocab = hf_config.vocab_size
        self.heads = hf_config.num_attention_heads
        self.query_groups = _hf(hf_config, "num_key_value_heads", self.heads)
        self.head_dim = head_dim_of(hf_config)
        self.num_experts = int(_hf(hf_config, "num_experts", 0))
        self.wire = wire
        self.local_tensor = local_tensor if local_tensor is not None else (lambda p: p.data)
        self.items = self._plan(model)

    # --- naming ------------------------------------------------------------------------------
    def _convert_rule(self, suffix: str, table: dict[str, Any], hf_prefix: str) -> tuple[str, tuple[str, ...]]:
        rule = table.get(suffix)
        if rule is None:
            raise ValueError(
                f"no HF name for Megatron parameter suffix {suffix!r} in the {'/'.join(self.family.model_types)} "
                "table (ckpt_engine/sources/hf_names.py): the layout cannot be exported"
            )
        if isinstance(rule, str):
            return "copy", (hf_prefix + rule,)
        kind, outs = rule
        return kind, tuple(hf_prefix + o for o in outs)

    def _plan(self, model: nn.Module) -> list[_Item]:
        items: list[_Item] = []
        module = megatron_core_model(model)
        layer_params: set[int] = set()
        layers = list(module.decoder.layers)
        by_id: dict[int, tuple[str, str, int]] = {}
        for layer in layers:
            global_idx = layer.layer_number - 1
            for name, p in layer.named_parameters():
                by_id[id(p)] = ("layer", name, global_idx)
                layer_params.add(id(p))
        for name, p in module.named_parameters():
            owner, attr = _owner(module, name)
            if id(p) in layer_params:
                _, suffix, layer_idx = by_id[id(p)]
                items.append(self._layer_item(p, owner, attr, suffix, layer_idx))
                continue
            if name == "output_layer.weight" and self.tied:
                continue  # tied: HF checkpoints carry embed_tokens only
            hf = self.family.globals_.get(name)
            if hf is None:
                raise ValueError(f"no HF name for Megatron parameter {name!r} (ckpt_engine/sources/hf_names.py)")
            kind = "vocab" if name in ("embedding.word_embeddings.weight", "output_layer.weight") else "copy"
            shape = (self.vocab, p.shape[1]) if kind == "vocab" else self._full_shape(p)
            items.append(_Item(owner, attr, kind, (hf,), (shape,), _partition_dim(p)))
        for it in items:
            it.specs = [TensorSpec(n, dtype_name(self.wire.dtype_for(n, it.param.dtype)), s) for n, s in zip(it.hf_names, it.hf_shapes)]
        return items

    def _full_shape(self, p: torch.Tensor, expert: bool = False) -> tuple[int, ...]:
        shape = list(p.shape)
        dim = _partition_dim(p)
        if dim is not None:
            shape[dim] *= self.groups.etp_size if expert else self.groups.tp_size
        return tuple(shape)

    def _layer_item(self, p: torch.Tensor, owner: nn.Module, attr: str, suffix: str, layer_idx: int) -> _Item:
        hf_prefix = f"{self.family.hf_layer_prefix}{layer_idx}."
        marker = "mlp.experts.local_experts."
        if suffix.startswith(marker):
            local_str, _, rest = suffix[len(marker) :].partition(".")
            kind, names = self._convert_rule(rest, self.family.expert, hf_prefix + "mlp.experts.{e}.")
            full = self._full_shape(p, expert=True)
            shapes = _split_shapes(kind, full, self)
            return _Item(owner, attr, kind, names, shapes, _partition_dim(p), expert=True, local_expert=int(local_str))
        if ".experts." in suffix:
            raise ValueError(f"expert layout {suffix!r} cannot be exported: use the SequentialMLP (moe_grouped_gemm=False)")
        kind, names = self._convert_rule(suffix, self.family.layer, hf_prefix)
        full = self._full_shape(p)
        return _Item(owner, attr, kind, names, _split_shapes(kind, full, self), _partition_dim(p))

    # --- metadata ----------------------------------------------------------------------------
    def local_specs(self) -> list[TensorSpec]:
        """This stage's HF specs, in export order (experts expanded over every EP rank)."""
        out: list[TensorSpec] = []
        for group in self._export_groups():
            for item, e in group:
                out.extend(self._expert_specs(item, e) if item.expert else item.specs)
        return out

    def _expert_specs(self, item: _Item, e: int) -> list[TensorSpec]:
        return [TensorSpec(s.name.replace("{e}", str(e)), s.dtype, s.shape) for s in item.specs]

    def _export_groups(self) -> list[list[tuple[_Item, int]]]:
        """Items in export order; an expert item appears once per global expert it carries."""
        ep = self.groups.ep_size
        order: list[list[tuple[_Item, int]]] = []
        pending_experts: list[_Item] = []

        def flush() -> None:
            if not pending_experts:
                return
            num_local = max(i.local_expert for i in pending_experts) + 1
            rows = []
            for r in range(ep):
                for it in pending_experts:
                    rows.append((it, r * num_local + it.local_expert))
            rows.sort(key=lambda x: x[1])  # stable: keeps fc1 before fc2 per expert
            order.append(rows)
            pending_experts.clear()

        for it in self.items:
            if it.expert:
                if pending_experts and it.hf_names[0].split(".mlp.")[0] != pending_experts[0].hf_names[0].split(".mlp.")[0]:
                    flush()
                pending_experts.append(it)
            else:
                flush()
                order.append([(it, -1)])
        flush()
        return order

    def stage_specs(self) -> list[list[TensorSpec]]:
        """Every stage's specs, known on every rank without gathering tensors (one tiny collective).

        Stages differ only in which layers they hold: each stage's spec list is rebuilt from this
        rank's plan by the stage's layer range, so only the per-stage layer counts are exchanged.
        """
        pp = self.groups.pp_size
        mine = self.local_specs()
        if pp == 1:
            return [mine]
        lp = self.family.hf_layer_prefix
        counts = torch.zeros(pp, dtype=torch.int64, device=collective_device(self.groups.pp))  # NCCL: CUDA only
        layers = sorted({int(s.name[len(lp):].split(".")[0]) for s in mine if s.name.startswith(lp)})
        counts[self.groups.pp_rank] = len(layers)
        dist.all_reduce(counts, group=self.groups.pp)
        counts = counts.cpu()
        template = [s for s in mine if s.name.startswith(f"{lp}{layers[0]}.")] if layers else []
        if not template:
            raise ValueError("every pipeline stage must hold at least one decoder layer to be exported")
        head, tail = self._global_specs()
        stages: list[list[TensorSpec]] = []
        start = 0
        for stage in range(pp):
            specs = list(head) if stage == 0 else []
            for layer in range(start, start + int(counts[stage])):
                specs += [TensorSpec(s.name.replace(f"{lp}{layers[0]}.", f"{lp}{layer}.", 1), s.dtype, s.shape) for s in template]
            start += int(counts[stage])
            if stage == pp - 1:
                specs += tail
            stages.append(specs)
        if stages[self.groups.pp_rank] != mine:
            raise ValueError("pipeline stages are not homogeneous; this exporter needs identical decoder layers")
        return stages

    def _global_specs(self) -> tuple[list[TensorSpec], list[TensorSpec]]:
        h = self.hf_config.hidden_size
        emb = TensorSpec("model.embed_tokens.weight", self._dt("model.embed_tokens.weight"), (self.vocab, h))
        tail = [TensorSpec("model.norm.weight", self._dt("model.norm.weight"), (h,))]
        if not self.tied:
            tail.append(TensorSpec("lm_head.weight", self._dt("lm_head.weight"), (self.vocab, h)))
        return [emb], tail

    def _dt(self, name: str) -> str:
        dtype = next(iter(self.items)).param.dtype
        return dtype_name(self.wire.dtype_for(name, dtype))

    # --- gather + convert --------------------------------------------------------------------
    def iter_local(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This stage's HF tensors; collectives over TP (and EP/expert-TP) groups of this stage."""
        with torch.no_grad():
            for group in self._export_groups():
                if group[0][0].expert:
                    yield from self._emit_experts(group)
                else:
                    item = group[0][0]
                    yield from self._convert(item, self._gather_tp(item, self.local_tensor(item.param), self.groups.tp), item.specs)

    def _gather_tp(self, item: _Item, local: torch.Tensor, group: Any) -> torch.Tensor | list[torch.Tensor]:
        size = 1 if group is None else dist.get_world_size(group)
        if item.partition_dim is None or size == 1:
            return local
        shards = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(shards, local.contiguous(), group=group)
        if item.kind == "gate_up":
            return shards  # each shard is [gate_part; up_part]: regrouped in _convert
        return torch.cat(shards, dim=item.partition_dim)

    def _convert(self, item: _Item, full: torch.Tensor | list[torch.Tensor], specs: list[TensorSpec]) -> Iterator[tuple[str, torch.Tensor]]:
        if item.kind == "gate_up":
            shards = full if isinstance(full, list) else [full]
            halves = [split_gate_up(s) for s in shards]
            parts: tuple[torch.Tensor, ...] = (torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves]))
        else:
            assert isinstance(full, torch.Tensor)
            if item.kind == "qkv":
                parts = split_qkv(full, self.heads, self.query_groups, self.head_dim)
            elif item.kind == "vocab":
                parts = (full[: self.vocab],)
            else:
                parts = (full,)
        for spec, t in zip(specs, parts):
            dt = torch_dtype(spec.dtype)
            yield spec.name, (t if t.dtype == dt else t.to(dt)).contiguous()

    def _emit_experts(self, group: list[tuple[_Item, int]]) -> Iterator[tuple[str, torch.Tensor]]:
        ep = self.groups.ep_size
        gathered: dict[tuple[int, int], torch.Tensor | list[torch.Tensor]] = {}
        items = list(dict.fromkeys(it for it, _ in group))
        for it in items:
            full = self._gather_tp(it, self.local_tensor(it.param), self.groups.etp)
            if ep == 1:
                gathered[(id(it), 0)] = full
                continue
            flat = full if isinstance(full, torch.Tensor) else torch.stack(full)
            outs = [torch.empty_like(flat) for _ in range(ep)]
            dist.all_gather(outs, flat.contiguous(), group=self.groups.ep)
            for r, o in enumerate(outs):
                gathered[(id(it), r)] = o if isinstance(full, torch.Tensor) else list(o.unbind(0))
        num_local = max(it.local_expert for it in items) + 1
        for it, e in group:
            yield from self._convert(it, gathered[(id(it), e // num_local)], self._expert_specs(it, e))


def walk_to_first_stage(
    exporter: MegatronExporter, stages: list[list[TensorSpec]], groups: MegatronGroups, device: torch.device
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every stage's HF tensors on every rank: each stage's walk, broadcast over the pipeline group.

    Collective on every rank of the model-parallel world, in `stages` order (`stage_specs()`).
    """
    if groups.pp_size == 1:
        yield from exporter.iter_local()
        return
    pp_ranks = dist.get_process_group_ranks(groups.pp)
    for stage, specs in enumerate(stages):
        local = exporter.iter_local() if stage == groups.pp_rank else None
        for spec in specs:
            if local is not None:
                name, t = next(local)
                assert name == spec.name, (name, spec.name)
                t = t.contiguous()
            else:
                t = torch.empty(spec.shape, dtype=torch_dtype(spec.dtype), device=device)
            dist.broadcast(t, src=pp_ranks[stage], group=groups.pp)
            yield spec.name, t
        if local is not None and next(local, None) is not None:
            raise RuntimeError(f"stage {stage} produced more tensors than its metadata lists")


def megatron_core_model(model: nn.Module) -> Any:
    """The megatron-core `GPTModel` inside `model` and any of Megatron's wrappers around it
    (DistributedDataParallel, Float16Module, the FSDP adapter and its MegatronFSDP all register
    the wrapped model as their submodule `module`; read from nn.Module's registry, since a
    runtime-checked Protocol looks attributes up statically and never sees submodules)."""
    from megatron.core.models.gpt import GPTModel

    m = model
    while not isinstance(m, GPTModel):
        inner = m._modules.get("module") if isinstance(m, nn.Module) else None
        if not isinstance(inner, nn.Module):
            raise ValueError(
                f"expected a megatron-core GPTModel, bare or inside Megatron's wrappers (DistributedDataParallel, "
                f"Float16Module, Megatron-FSDP), got {type(m).__name__}"
            )
        m = inner
    return m


def _partition_dim(p: torch.Tensor) -> int | None:
    if getattr(p, "tensor_model_parallel", False):
        return int(getattr(p, "partition_dim", 0))
    return None


def _split_shapes(kind: str, full: tuple[int, ...], ex: MegatronExporter) -> tuple[tuple[int, ...], ...]:
    rest = full[1:]
    if kind == "qkv":
        return ((ex.heads * ex.head_dim, *rest), (ex.query_groups * ex.head_dim, *rest), (ex.query_groups * ex.head_dim, *rest))
    if kind == "gate_up":
        return ((full[0] // 2, *rest), (full[0] // 2, *rest))
    return (full,)
