"""Hugging Face -> Megatron-core: the reverse of the sources' export, which only the training engines
use (initial weights, a checkpoint's model and optimizer moments, the parity tests' references).

It reads the export's own plan (`MegatronExporter.items`: each parameter's HF names, kind and
`partition_dim`), so a layout the export knows loads back the same way; no collectives: every rank
holds the full HF tensors and fills its shards.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ckpt_engine.sources.megatron_export import MegatronExporter, _partition_dim, megatron_core_model

__all__ = ["load_hf", "merge_gate_up", "merge_qkv", "vocab_padding_rows"]


def load_hf(ex: MegatronExporter, hf: dict[str, torch.Tensor], target: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
    """Fill this rank's shards of `ex`'s model from full HF tensors.

    `target(param)` is the tensor to fill for a parameter (default: the parameter itself; a
    checkpoint load passes the parameter's optimizer moment of the same layout)."""
    dest = target if target is not None else (lambda p: p)
    tp, tp_rank = ex.groups.tp_size, ex.groups.tp_rank
    etp, etp_rank = ex.groups.etp_size, ex.groups.etp_rank
    num_local = max((it.local_expert for it in ex.items if it.expert), default=0) + 1
    with torch.no_grad():
        for it in ex.items:
            names = it.hf_names
            size, rank = (etp, etp_rank) if it.expert else (tp, tp_rank)
            if it.expert:
                e = ex.groups.ep_rank * num_local + it.local_expert
                names = tuple(n.replace("{e}", str(e)) for n in names)
            missing = [n for n in names if n not in hf]
            if missing:
                raise ValueError(f"HF weights lack {missing[0]!r} needed for this Megatron model")
            src = [hf[n] for n in names]
            if it.kind == "gate_up":
                if it.partition_dim is not None and size > 1:
                    full = merge_gate_up(src[0].chunk(size)[rank], src[1].chunk(size)[rank])
                else:
                    full = merge_gate_up(*src)
                _copy_into(dest(it.param), full)
                continue
            if it.kind == "qkv":
                q, k, v = src
                full = merge_qkv(q, k, v, ex.heads, ex.query_groups, ex.head_dim)
            elif it.kind == "vocab":
                padded = it.param.shape[0] * (size if it.partition_dim is not None else 1)
                full = torch.zeros((padded, *src[0].shape[1:]), dtype=src[0].dtype)
                full[: src[0].shape[0]] = src[0]
            else:
                full = src[0]
            if it.partition_dim is not None and size > 1:
                full = full.chunk(size, dim=it.partition_dim)[rank]
            _copy_into(dest(it.param), full)
        if ex.tied:
            core = megatron_core_model(ex.model)
            out = getattr(core, "output_layer", None)
            if out is not None and getattr(out, "weight", None) is not None and not core.pre_process:
                dest(out.weight).data.copy_(_vocab_shard(hf["model.embed_tokens.weight"], out.weight, tp, tp_rank))


def vocab_padding_rows(ex: MegatronExporter) -> list[tuple[torch.Tensor, int]]:
    """(parameter, first padding row in its local shard) of every vocab-padded parameter of `ex`'s model.

    Rows past the HF vocabulary exist only to make the vocab divisible by TP; they never see a
    token or a loss, and their number depends on the layout."""
    tp, tp_rank = ex.groups.tp_size, ex.groups.tp_rank
    params = [it.param for it in ex.items if it.kind == "vocab"]
    out = getattr(megatron_core_model(ex.model), "output_layer", None)
    if ex.tied and out is not None and getattr(out, "weight", None) is not None and all(out.weight is not p for p in params):
        params.append(out.weight)
    rows = []
    for p in params:
        local = p.shape[0]
        offset = tp_rank * local if _partition_dim(p) == 0 and tp > 1 else 0
        rows.append((p, max(0, min(local, ex.vocab - offset))))
    return rows


def merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int, num_query_groups: int, head_dim: int) -> torch.Tensor:
    """HF q, k, v -> Megatron's per-query-group interleaved QKV (inverse of `hf_names.split_qkv`)."""
    per = num_heads // num_query_groups
    rest = q.shape[1:]
    parts = (
        q.reshape(num_query_groups, per * head_dim, *rest),
        k.reshape(num_query_groups, head_dim, *rest),
        v.reshape(num_query_groups, head_dim, *rest),
    )
    return torch.cat(parts, dim=1).reshape(-1, *rest).contiguous()


def merge_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.cat([gate, up], dim=0)


def _copy_into(param: torch.Tensor, full: torch.Tensor) -> None:
    param.data.copy_(full.to(device=param.device, dtype=param.dtype))


def _vocab_shard(full: torch.Tensor, like: torch.Tensor, tp: int, tp_rank: int) -> torch.Tensor:
    padded = torch.zeros((like.shape[0] * tp, *full.shape[1:]), dtype=full.dtype)
    padded[: full.shape[0]] = full
    return padded.chunk(tp)[tp_rank]
