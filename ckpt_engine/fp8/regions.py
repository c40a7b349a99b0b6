"""Receive plans over a block-FP8 layout: a rank holding a slice of a quantized weight holds the
scales of exactly those blocks.

Why it is refused rather than approximated: a slice that starts or ends inside a 128-row (or
128-column) block shares that block's one scale with the neighbouring rank, so neither rank's
scales describe its own slice alone; vLLM refuses such a TP layout too (`validate_fp8_block_shape`).
"""

from __future__ import annotations

from collections.abc import Sequence

from ckpt_engine.fp8.layout import BLOCK, FP8_NAME, weight_of
from ckpt_engine.manifest import TensorSpec
from ckpt_engine.planning.regions import Region

__all__ = ["fit_scales"]


def _scale_region(weight: TensorSpec, region: Region) -> Region:
    ndim = len(weight.shape)
    if region.dim < ndim - 2:  # stacked experts: the scales of whole experts
        return region
    block = BLOCK[region.dim - (ndim - 2)]
    size, stop = weight.shape[region.dim], region.start + region.length
    if region.start % block or (stop % block and stop != size):
        raise ValueError(
            f"{weight.name}: this rank holds [{region.start}, {stop}) of dim {region.dim}, which does not fall on {block}-element "
            f"block boundaries, so no scale tensor describes its slice alone: use a TP size that cuts every FP8 weight into whole "
            f"{block} x {block} blocks"
        )
    return Region(region.dim, region.start // block, -(-stop // block) - region.start // block)


def fit_scales(specs: Sequence[TensorSpec], holds: dict[str, tuple[Region, ...] | None]) -> None:
    """Make `holds` (a receive plan's, by name; absent: not held, None: whole) hold every block-FP8
    weight's `_scale_inv` exactly as its weight is held: the scales of the same blocks, or none.
    ValueError naming the weight whose slice is not in whole blocks."""
    by_name = {s.name: s for s in specs}
    for spec in specs:
        weight = weight_of(spec.name)
        w = by_name.get(weight) if weight is not None else None
        if w is None or w.dtype != FP8_NAME or len(w.shape) < 2:
            continue
        holds.pop(spec.name, None)
        if weight in holds:
            regions = holds[weight]
            holds[spec.name] = None if regions is None else tuple(_scale_region(w, r) for r in regions)
