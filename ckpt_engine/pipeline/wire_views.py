"""Tensors in their wire layout: dtype names, byte views, and the checks the loops share."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ckpt_engine.checksum import CHECKSUM_BYTES
from ckpt_engine.delta.layout import align8
from ckpt_engine.manifest import TensorMeta
from ckpt_engine.sources.wire import dtype_name, torch_dtype

__all__ = ["SourceMismatch", "checked_weight", "entry_view", "flat_bytes", "has_wire_layout", "message", "next_item", "next_weight"]


class SourceMismatch(ValueError):
    """The weight source yielded what its own metadata does not say (a name, shape, dtype or count):
    a trainer-side bug, so a failed sync names the source, not the engines the abort cut off."""


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def entry_view(buf: torch.Tensor, e: TensorMeta) -> torch.Tensor:
    """Entry `e`'s bytes in a bucket image `buf`: typed and shaped for a whole tensor, raw for a chunk."""
    raw = buf[e.bucket_offset : e.bucket_offset + e.chunk_size]
    if e.is_whole:
        return raw.view(torch_dtype(e.dtype)).view(e.shape)
    return raw


def message(buf: torch.Tensor, nbytes: int, verify: bool) -> torch.Tensor:
    """What travels for a packed bucket in slot memory `buf`: its bytes, plus (with verify) padding
    and the checksum."""
    return buf[: align8(nbytes) + CHECKSUM_BYTES if verify else nbytes]


def has_wire_layout(t: torch.Tensor, e: TensorMeta, device: torch.device) -> bool:
    return t.is_contiguous() and t.device == device and t.dtype == torch_dtype(e.dtype) and tuple(t.shape) == e.shape


def next_weight(it: Iterator[tuple[str, torch.Tensor]], e: TensorMeta, piece_bytes: int | None = None) -> torch.Tensor:
    """The source's next tensor, checked against the manifest entry that expects it.

    `piece_bytes`: the sender sends only this many bytes of the tensor; the yielded tensor holds
    exactly those (its shard, any shape) or is the whole tensor (a replicated one, which the
    sender slices). Without it the full shape is required."""
    name, tensor = next_item(it, e)
    return checked_weight(name, tensor, e, piece_bytes)


def next_item(it: Iterator[tuple[str, torch.Tensor]], e: TensorMeta) -> tuple[str, torch.Tensor]:
    """The source's next (name, tensor), where the manifest expects entry `e`."""
    try:
        return next(it)
    except StopIteration:
        raise SourceMismatch(f"the weight source ended before {e.name!r}, which its metadata lists") from None


def checked_weight(name: str, tensor: torch.Tensor, e: TensorMeta, piece_bytes: int | None = None) -> torch.Tensor:
    """`tensor`, yielded as `name` where the manifest expects entry `e` (see next_weight), or a
    ValueError naming what does not match."""
    if name != e.name:
        raise SourceMismatch(f"the weight source yielded {name!r} where its metadata put {e.name!r}")
    wire = torch_dtype(e.dtype)
    if piece_bytes is None:
        if tuple(tensor.shape) != e.shape:
            raise SourceMismatch(f"{name}: the weight source yielded shape {tuple(tensor.shape)}, its metadata says {e.shape}")
    elif tensor.numel() * wire.itemsize != piece_bytes and tuple(tensor.shape) != e.shape:
        raise SourceMismatch(
            f"{name}: this sender owns {piece_bytes} bytes of it, the weight source yielded {tensor.numel()} elements of {e.dtype}"
        )
    if tensor.dtype != wire and not (tensor.is_floating_point() and wire.is_floating_point):
        # Casting between float formats is the wire-dtype policy; anything else is a bug upstream.
        fix = (f"set the wire dtype in the source, e.g. StateDictSource(..., dtype=torch.{e.dtype})" if tensor.is_floating_point()
               else "a source casts only floating-point tensors to the wire dtype: yield it as its metadata says")
        raise SourceMismatch(f"{name}: the weight source yielded {dtype_name(tensor.dtype)}, its metadata says {e.dtype} ({fix})")
    return tensor
