"""Block-FP8 on the wire (`checkpoint_engine.wire_dtype: fp8`): a layer around any weight source.

`Fp8WireSource(source)` lists the source's tensors in the block-FP8 checkpoint layout
(`fp8/layout.py`) and quantizes lazily while the sender walks, on the device the source yields
each weight on, never a staged copy of the model; the quantized tensors are temporaries of the
walk, so the pipeline packs them. On CUDA, consecutive weights of a source whose tensors stay
valid (`stable_tensors`, or `fresh_tensors`), and weights the walk casts to their wire dtype itself
(its own temporaries), are quantized together, up to `GROUP_BYTES`, in one kernel launch
(`fp8/quantize_kernel.py`): a 30B-A3B walk has 18,432 expert weights, and a launch each cost
more host time than the bf16 sync takes. Any other weight (a gathering walk's, e.g. FSDP2's or
Megatron's, whose tensor may be overwritten once the next is asked for) is quantized alone, as
it comes; `last_walk` counts which path each weight took. A walk of a `stable_tensors` source is
recorded and replayed by the next sync of the same tensors (`fp8_walk.py`): its grouping and
launch tables are worked out once, not per weight and sync. From the sync after that, where the
sender offers its buckets and `fill_slots` is on, the walk writes each one into the sender's slot
itself (`fp8_fill.py`): no tensor a weight, and nothing for the sender to check or pack.

`ShardedFp8WireSource(source)`: each sender quantizes its own rows of a weight, which is exact
only when its row range starts and ends on a 128-row block boundary (or the tensor's end); any
other shard is refused by name while the sync is planned, before anything pauses.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from ckpt_engine.config import WIRE_DTYPES
from ckpt_engine.fp8.layout import BLOCK, SCALE_NAME, fp8_specs, quantizes, scale_name, scale_shape, weight_of
from ckpt_engine.fp8.quantize import quantize_block_fp8
from ckpt_engine.manifest import DTYPE_ITEMSIZE, TensorSpec
from ckpt_engine.planning.ownership import OwnerMap, Shard
from ckpt_engine.sources.base import WeightSource
from ckpt_engine.fp8.direct import OFFER
from ckpt_engine.sources.fp8_fill import Fills, fill_walk
from ckpt_engine.sources.fp8_walk import GroupKernel, Quantized, WalkCounts, WalkPlan, Walker, to_wire
from ckpt_engine.sources.sharded import ShardedWeightSource
from ckpt_engine.sources.wire import torch_dtype

__all__ = ["GROUP_BYTES", "Fp8WireSource", "ShardedFp8WireSource", "WalkCounts", "fp8_wire"]

GROUP_BYTES = 256 << 20
"""Input bytes one grouped quantize launch takes at most: the group's outputs stay alive until the
pipeline has packed its last weight, and its first bucket waits for the whole launch."""


def _group_kernel(w: torch.Tensor) -> GroupKernel | None:
    """The grouped quantize for `w`'s device: the Triton kernels on CUDA, none elsewhere (the eager
    recipe, one weight at a time)."""
    return _cuda_kernels() if w.is_cuda else None


@functools.cache
def _cuda_kernels() -> GroupKernel:
    """`fp8/quantize_kernel.py`, imported once, where a GPU quantizes (it needs Triton)."""
    from ckpt_engine.fp8 import quantize_kernel

    return quantize_kernel


def _plan(spec: TensorSpec) -> Quantized:
    return Quantized(spec, torch_dtype(spec.dtype), torch.Size(spec.shape), spec.nbytes, scale_name(spec.name))


@dataclass
class _Layout:
    """What the FP8 wire derives from a source's metadata, tensor by tensor: its specs by name, the
    quantized weights' plans and the wire's specs. A sync wraps the trainer's source anew
    (`fp8_wire`), and for Qwen3-30B-A3B deriving them took 0.12-0.38 s of host a sync (2-core CPU
    box), more than the bf16 sync of the model on 2xH200: kept across syncs for the same metadata."""

    source_specs: list[TensorSpec]
    specs: dict[str, TensorSpec]
    quantized: dict[str, Quantized]
    wire_specs: list[TensorSpec]
    walk: WalkPlan | None = None
    """The last recorded walk of a stable source of this metadata (`fp8_walk.py`)."""
    fills: Fills | None = None
    """How a sender's buckets are filled from that walk (`fp8_fill.py`), for the last bucket layout."""

    def fills_for(self, key: str) -> Fills:
        if self.fills is None or self.fills.key != key:
            self.fills = Fills(key)
        return self.fills


_LAYOUTS: list[_Layout] = []
_LAYOUTS_MAX = 4
"""Layouts kept, the latest used first (a process rarely syncs more than one model)."""


def _layout(specs: list[TensorSpec]) -> _Layout:
    """The layout of `specs`: a kept one where the metadata is equal (a source that lists the same
    spec objects every sync, as `StateDictSource` does, makes that one pass of identity checks)."""
    for kept in _LAYOUTS:
        if kept.source_specs == specs:
            return kept
    made = _Layout(specs, {s.name: s for s in specs}, {s.name: _plan(s) for s in specs if quantizes(s)}, fp8_specs(specs))
    _LAYOUTS.insert(0, made)
    del _LAYOUTS[_LAYOUTS_MAX:]
    return made


def _quantize(spec: TensorSpec, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_block_fp8(to_wire(spec, t), BLOCK)


class Fp8WireSource(WeightSource):
    """A source's weights in the block-FP8 checkpoint layout (module docstring); one trainer rank
    sends (as the wrapped source says). Every other attribute is the wrapped source's."""

    stable_tensors = False

    @property
    def fresh_tensors(self) -> bool:  # type: ignore[override]
        """Codes and scales are new memory of this walk; what passes unquantized is the wrapped
        source's, so the walk is fresh only where those stay valid too."""
        return self.source.stable_tensors or self.source.fresh_tensors

    def __init__(self, source: WeightSource) -> None:
        if isinstance(source, Fp8WireSource):
            raise ValueError("the weight source is already on an FP8 wire")
        self.source = source
        layout = self._layout = _layout(list(source.metadata()))
        self._specs, self._quantized, self._wire_specs = layout.specs, layout.quantized, layout.wire_specs
        self.last_walk = WalkCounts()
        """Which path each quantized weight of the latest walk took (so far, while it runs)."""
        self.fill_slots = False
        """Whether a walk may write the buckets a sender offers into its slots itself (`fp8_fill.py`),
        yielding no tensor for them; read when the walk starts. Off unless whoever drives the walk
        says nothing but the sender reads what it yields (an installed-weight check folds each
        tensor by name as it passes, and would find the filled ones missing)."""

    @property
    def is_sender(self) -> bool:  # type: ignore[override]
        return self.source.is_sender

    @property
    def process_group(self) -> object:
        return self.source.process_group

    @property
    def device(self) -> torch.device | None:
        return self.source.device

    def metadata(self) -> list[TensorSpec]:
        return list(self._wire_specs)

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        # Weights may wait for a grouped launch while later ones are read: only where they stay valid
        # (the source's own tensors), or are this walk's own (a cast to the wire dtype made here).
        stable = self.source.stable_tensors
        walker = Walker(self._quantized, _group_kernel, GROUP_BYTES, stable or self.source.fresh_tensors)
        self.last_walk = walker.counts
        layout = self._layout
        it = iter(self.source.iter_weights())
        offer = OFFER.get() if stable and self.fill_slots and layout.walk is not None else None
        if offer is not None and not layout.fills_for(offer.key).refused:  # the sender's slots are filled in place
            yield from fill_walk(walker, layout.fills_for(offer.key), offer, it)
        elif stable and layout.walk is not None:  # the same tensors as last sync: its record replays
            yield from walker.replay(layout.walk, it)
        else:
            yield from walker.walk(it, record=[] if stable else None)
        if walker.missed or walker.recorded is not None:
            layout.walk = walker.recorded


class ShardedFp8WireSource(Fp8WireSource, ShardedWeightSource):
    """`Fp8WireSource` for a source that sends from every trainer rank: each rank quantizes the
    rows it owns (see the module docstring for the block-boundary rule)."""

    source: ShardedWeightSource

    def __init__(self, source: ShardedWeightSource) -> None:
        super().__init__(source)
        self._made: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        """Quantized pieces of this walk, by weight name, until both halves were handed out."""

    @property
    def fresh_tensors(self) -> bool:  # type: ignore[override]
        """As `Fp8WireSource`'s, and with many senders the unquantized pieces are the wrapped
        source's `local_piece`s: fresh only where those stay valid too."""
        return (self.source.stable_tensors and self.source.stable_pieces) or self.source.fresh_tensors

    @property
    def sender_index(self) -> int:  # type: ignore[override]
        return self.source.sender_index

    @property
    def num_senders(self) -> int:  # type: ignore[override]
        return self.source.num_senders

    @property
    def sends(self) -> bool:  # type: ignore[override]
        return self.source.sends

    @property
    def collective_pieces(self) -> bool:  # type: ignore[override]
        return self.source.collective_pieces

    def sharded_refusal(self) -> str | None:
        return self.source.sharded_refusal()

    def owners(self) -> OwnerMap:
        """The wrapped source's shards in FP8 bytes, and the scale rows that go with them."""
        out: dict[str, list[Shard]] = {}
        for name, shards in self.source.owners().items():
            spec = self._specs[name]
            if not quantizes(spec):
                out[name] = list(shards)
                continue
            out[name], out[scale_name(name)] = _fp8_shards(spec, shards)
        return out

    def local_piece(self, name: str) -> torch.Tensor:
        weight = weight_of(name)
        if weight is not None and weight in self._specs and quantizes(self._specs[weight]):
            return self._half(weight, 1)
        spec = self._specs.get(name)
        if spec is not None and quantizes(spec):
            return self._half(name, 0)
        return self.source.local_piece(name)

    def _half(self, weight: str, which: int) -> torch.Tensor:
        made = self._made.get(weight)
        if made is None:
            made = self._made[weight] = _quantize(self._specs[weight], self.source.local_piece(weight))
            self.last_walk.alone += 1
        return made[which]

    def assist_piece(self, name: str) -> None:
        weight = weight_of(name)
        if weight is not None and weight in self._specs and quantizes(self._specs[weight]):
            return  # the weight's own call assisted its sender's gather
        self.source.assist_piece(name)

    def begin_pieces(self) -> None:
        self._made.clear()
        self.last_walk = WalkCounts()
        self.source.begin_pieces()

    def end_pieces(self) -> None:
        self._made.clear()
        self.source.end_pieces()


def _fp8_shards(spec: TensorSpec, shards: Sequence[Shard]) -> tuple[list[Shard], list[Shard]]:
    """A weight's row shards in FP8 bytes, and the shards of its scales; refused by name unless every
    shard's rows start and end on a block boundary (or the tensor's end)."""
    row_bytes = spec.nbytes // spec.shape[0] if spec.shape[0] else 0
    rows_all = spec.shape[0]
    per_row = spec.numel // rows_all if rows_all else 0  # FP8 bytes of one dim-0 row
    scale = scale_shape(spec.shape)
    scale_row_bytes = (DTYPE_ITEMSIZE[SCALE_NAME] * scale[-1] * (scale[-2] if len(spec.shape) == 3 else 1))
    block = 1 if len(spec.shape) == 3 else BLOCK[0]  # stacked experts: dim 0 counts experts, whole ones quantize alone
    weights, scales = [], []
    for sh in shards:
        if sh.start % row_bytes or sh.stop % row_bytes:
            raise ValueError(f"{spec.name}: sender {sh.sender}'s shard (bytes [{sh.start}, {sh.stop})) is not whole rows; block-FP8 needs whole rows")
        r0, r1 = sh.start // row_bytes, sh.stop // row_bytes
        if r0 % block or (r1 % block and r1 != rows_all):
            raise ValueError(
                f"{spec.name}: sender {sh.sender} holds rows [{r0}, {r1}), which do not fall on {BLOCK[0]}-row block boundaries, "
                f"so it cannot quantize them alone (checkpoint_engine.wire_dtype=fp8 with senders=all needs shards in whole blocks: "
                f"use senders=rank0, or a number of senders that cuts every weight into multiples of {BLOCK[0]} rows)"
            )
        weights.append(Shard(sh.sender, r0 * per_row, r1 * per_row))
        scales.append(Shard(sh.sender, (r0 // block) * scale_row_bytes, -(-r1 // block) * scale_row_bytes))
    return weights, scales


def fp8_wire(source: WeightSource, wire_dtype: str | None) -> WeightSource:
    """`source` on the wire `checkpoint_engine.wire_dtype` names: as it is (None), or block-FP8."""
    if wire_dtype is None or isinstance(source, Fp8WireSource):
        return source
    if wire_dtype != "fp8":
        raise ValueError(f"checkpoint_engine.wire_dtype must be one of {', '.join(WIRE_DTYPES)} or unset, got {wire_dtype!r}")
    if isinstance(source, ShardedWeightSource):
        return ShardedFp8WireSource(source)
    return Fp8WireSource(source)
