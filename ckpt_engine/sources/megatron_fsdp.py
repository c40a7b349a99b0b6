"""`MegatronFSDPSource`: the weights of a megatron-core `GPTModel` sharded by Megatron-FSDP.

The chunk is wrapped by megatron-core's `FullyShardedDataParallel` adapter (strategies
`no_shard | optim | optim_grads | optim_grads_params`). Export shares `MegatronSource`'s naming
and TP/PP/EP walk; what differs is how a rank gets its TP-local full parameter: every chunk (not
only the first: later chunks would keep stale or half-gathered weights, a known bug in a peer
implementation) finishes its parameter gathers first (`sync_params_for_export`), and a DTensor
sharded over the data-parallel mesh is gathered with `gather_uneven_dtensor_to_full_tensor`
(uneven shards, a rank with 0 rows included).

One sender only: the data-parallel replicas hold FSDP shards, not whole tensors. Needs CUDA;
importing this module never fails. Collective contract as in `megatron.py`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from ckpt_engine.sources.megatron import MegatronSource
from ckpt_engine.sources.wire import DEFAULT_KEEP_FP32

__all__ = ["SHARDING_STRATEGIES", "MegatronFSDPSource", "megatron_fsdp_available"]

SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")

try:  # import guard: CPU CI imports this module without CUDA (and often without megatron-fsdp)
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import HAVE_MEGATRON_FSDP as _HAVE_FSDP

    _IMPORT_ERROR: str | None = None if _HAVE_FSDP else "megatron-core was installed without megatron_fsdp"
except Exception as exc:  # ImportError, or a version clash between megatron-core and megatron-fsdp
    _IMPORT_ERROR = f"{type(exc).__name__}: {exc}"


def megatron_fsdp_available() -> tuple[bool, str]:
    """(usable here, why not): megatron-fsdp importable and CUDA present."""
    if _IMPORT_ERROR is not None:
        return False, f"megatron-fsdp cannot be imported ({_IMPORT_ERROR}); install megatron-core>=0.16 with its fsdp extra"
    if not torch.cuda.is_available():
        return False, "Megatron-FSDP needs CUDA GPUs (its parameter and gradient buffers live on the current CUDA device)"
    return True, ""


def _local_full(p: torch.Tensor) -> torch.Tensor:
    """This TP rank's full parameter: gather FSDP's (possibly uneven, possibly empty) DP shards."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(p, DTensor):
        return p.data
    if all(isinstance(pl, Replicate) for pl in p.placements):
        return p.to_local()
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import gather_uneven_dtensor_to_full_tensor

    return gather_uneven_dtensor_to_full_tensor(p).to_local()


def _has_model_weight_buffer(inner: Any) -> bool:
    """Whether any parameter group of a MegatronFSDP module has a model-weight buffer to gather into."""
    groups = getattr(getattr(inner, "param_and_grad_buffer", None), "parameter_groups", None)
    if groups is None:  # another megatron-fsdp layout: let start_param_sync decide
        return True
    return any(getattr(g, "model_weight_buffer", None) is not None for g in groups)


class MegatronFSDPSource(MegatronSource):
    """The HF-named weights of Megatron-FSDP-wrapped model chunks (one chunk a rank: virtual
    pipeline chunks are not exported yet). `sharding_strategy`: the one the chunks were wrapped
    with. The other arguments are `MegatronSource`'s."""

    def __init__(
        self,
        chunks: list[nn.Module],
        hf_config: Any,
        *,
        sharding_strategy: str,
        pg_collection: Any = None,
        dtype: torch.dtype | str | None = None,
        keep_fp32: Sequence[str] = DEFAULT_KEEP_FP32,
        export_mode: str = "gather_to_first",
    ) -> None:
        if sharding_strategy not in SHARDING_STRATEGIES:
            raise ValueError(f"sharding_strategy must be one of {', '.join(SHARDING_STRATEGIES)}, got {sharding_strategy!r}")
        if len(chunks) != 1:
            raise ValueError("virtual pipeline chunks are not exported yet: pass one model chunk per rank")
        self.chunks = list(chunks)
        self.sharding_strategy = sharding_strategy
        super().__init__(
            chunks[0], hf_config, pg_collection=pg_collection, dtype=dtype, keep_fp32=keep_fp32, export_mode=export_mode,
            local_tensor=_local_full,
        )
        self._refusal = "Megatron-FSDP syncs from one sender (its data-parallel ranks hold FSDP shards); use senders=rank0"
        self.sender_index, self.num_senders, self.sends, self.collective_pieces = 0, 1, True, False

    def sync_params_for_export(self) -> None:
        """Finish every chunk's parameter gather pipeline (collective on every rank).

        `optim` / `optim_grads` refresh their unsharded compute weights from the updated main weights
        (forced here). `no_shard` has no model-weight buffer: its module holds the optimizer's weights,
        updated in place, and `start_param_sync(force_sync=True)` would gather into a None buffer
        (megatron-core 0.16.1 checks the buffer only after that call).
        """
        for chunk in self.chunks:
            inner: Any = chunk.module  # MegatronFSDP (megatron-core's own classes are not read by the type checker)
            inner.synchronize_param_gather()
            if self.sharding_strategy in ("optim", "optim_grads") and _has_model_weight_buffer(inner):
                inner.start_param_sync(force_sync=True)  # compute weights <- updated main params
                inner.synchronize_param_gather()

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        self.sync_params_for_export()
        yield from super().iter_weights()
