"""Where a receiver puts together a tensor that travels in chunks (split over buckets or senders)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ckpt_engine.manifest import TensorMeta
from ckpt_engine.pipeline.plan_state import PlanState
from ckpt_engine.pipeline.wire_views import flat_bytes, has_wire_layout
from ckpt_engine.sources.wire import torch_dtype

__all__ = ["assembly_of", "chunk_landed"]


def assembly_of(state: PlanState, e: TensorMeta, destinations: Mapping[str, torch.Tensor] | None, device: torch.device) -> torch.Tensor:
    """Where a chunked tensor is reassembled: in its destination when the loader offers one with
    the wire layout (no extra memory, no final copy); otherwise in a reassembly tensor kept across
    syncs of one plan (a fresh host allocation of a large tensor costs a page fault per 4 KiB on
    every sync; the CUDA caching allocator would reuse it anyway)."""
    dest = destinations.get(e.name) if destinations is not None else None
    if dest is not None and has_wire_layout(dest, e, device):
        return flat_bytes(dest)
    asm = state.assembly.get(e.name)
    if asm is None:
        asm = state.assembly[e.name] = torch.empty(e.nbytes, dtype=torch.uint8, device=device)
    return asm


def chunk_landed(
    state: PlanState, e: TensorMeta, view: torch.Tensor | None, remaining: dict[str, int],
    destinations: Mapping[str, torch.Tensor] | None, device: torch.device,
) -> torch.Tensor | None:
    """A chunk of a tensor split over buckets has arrived (copied into its reassembly tensor from
    `view`, or already received there when `view` is None): the whole tensor once its last chunk
    is in, else None."""
    asm = assembly_of(state, e, destinations, device)
    if view is not None:
        asm[e.chunk_offset : e.chunk_offset + e.chunk_size].copy_(view)
    remaining[e.name] -= e.chunk_size
    return asm.view(torch_dtype(e.dtype)).view(e.shape) if remaining[e.name] == 0 else None
