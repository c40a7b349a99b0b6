"""Received tensors copied straight into a vLLM model's live parameters, where vLLM's loaders would
only copy them there.

A model that loads in place (`vllm/reload.py`: no layer post-processes its weights, an unquantized
model on CUDA) is written by its loaders in its final layout. For such a model the loaders are pure
Python routing: each checkpoint tensor's boxes are copied into views of fused parameters (QKV,
gate_up), and that routing costs more than the copies (a 7B sync's loads took ~2x one device copy of
its bytes on an H200). The receive plan's dry run (`vllm/regions.py`) already recorded every copy a
loader makes (`Landing`: the box read, the parameter, the view written), so those copies are made
here directly, batched per bucket, and vLLM's loader runs only for what the record does not cover.

A name is copied directly only when the dry run saw nothing but plain copies of it: no whole-tensor
read, no arithmetic on its elements, no write it could not follow, every layout tensor it touched
written by a recorded landing, and its boxes covering the tensor exactly once. A tensor whose shape
or dtype differs from the record at receive time goes through vLLM's loader as before.
`CKPT_ENGINE_VLLM_DIRECT=0` turns this off (the benchmark's before/after switch).
"""

from __future__ import annotations

import functools
import logging
import os
import weakref
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from math import prod
from typing import TYPE_CHECKING

import torch

from ckpt_engine.copies import copy_large_alone_
from ckpt_engine.pipeline.plan_state import SharedBucket
from ckpt_engine.rollout_adapters.vllm.installed import Landing, resolve_tensor
from ckpt_engine.rollout_adapters.vllm.regions import PlanRecording

if TYPE_CHECKING:
    from ckpt_engine.copy_kernel import FusedCopy

__all__ = ["DirectLoads", "direct_enabled", "with_direct"]

logger = logging.getLogger(__name__)

Pairs = list[tuple[str, torch.Tensor]]


def direct_enabled() -> bool:
    return os.environ.get("CKPT_ENGINE_VLLM_DIRECT", "1") not in ("0", "off", "false")


class _Copies:
    """One name's recorded copies: the boxes read and the live views they land in."""

    __slots__ = ("dtype", "dsts", "root", "slices")

    def __init__(self, root: tuple[int, ...], dtype: torch.dtype, slices: list[tuple[slice, ...] | None], dsts: list[torch.Tensor]) -> None:
        self.root, self.dtype, self.slices, self.dsts = torch.Size(root), dtype, slices, dsts


class DirectLoads:
    """The recorded copies of every name of one model that vLLM's loaders only copy."""

    def __init__(self, model: torch.nn.Module, rec: PlanRecording) -> None:
        by_name: dict[str, list[Landing]] = {}
        for landing in rec.landings:
            by_name.setdefault(landing.name, []).append(landing)
        self._copies: dict[str, _Copies] = {}
        self.replayed = 0
        """Buckets whose kept copies were replayed since this object was made."""
        self._kept: dict[int, _Kept] = {}
        """Per `SharedBucket` (by id, checked by a weak reference) whose pairs were all copied here: its
        copies, dropped when the bucket goes (they hold the mapped tensors they read)."""
        self.copied = 0
        """Tensors copied directly since this object was made (receive reports read the change)."""
        skipped: dict[str, str] = {}
        for name, landings in by_name.items():
            why = _refused(name, landings, rec)
            copies = None if why else _live_copies(model, landings)
            if copies is None:
                skipped[name] = why or "its parameter is not where the dry run saw it"
                continue
            self._copies[name] = copies
        logger.info("vLLM loads: %d tensors copied straight into the live parameters, %d through vLLM's loaders%s",
                    len(self._copies), len(skipped), f" (e.g. {next(iter(skipped.items()))})" if skipped else "")

    def __len__(self) -> int:
        return len(self._copies)

    def load(self, pairs: Pairs) -> Pairs:
        """Copy every pair the record covers (boxes of `copies.ALONE_BYTES` and up one `copy_` each, the
        others in one batched copy); returns the others, for vLLM's loader. A `SharedBucket` the
        record covered whole last time has its copies replayed (`_Kept`): no Python per tensor."""
        if type(pairs) is SharedBucket:
            kept = self._kept.get(id(pairs))
            if kept is not None and kept.bucket() is pairs:
                kept.run()
                self.copied += len(pairs)
                self.replayed += 1
                return []
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        rest: Pairs = []
        for name, tensor in pairs:
            copies = self._copies.get(name)
            if copies is None or tensor.dtype != copies.dtype or tensor.shape != copies.root:
                rest.append((name, tensor))
                continue
            dsts += copies.dsts
            srcs += [tensor if index is None else tensor[index] for index in copies.slices]  # None: all of it (most: a slice costs ~3 us)
        copy_large_alone_(dsts, srcs)
        self.copied += len(pairs) - len(rest)
        if type(pairs) is SharedBucket and not rest:
            self._kept[id(pairs)] = _Kept(weakref.ref(pairs, functools.partial(_forget, self._kept, id(pairs))), dsts, srcs)
        return rest


def _forget(kept: dict[int, _Kept], key: int, bucket: weakref.ref[SharedBucket]) -> None:
    """A bucket is gone (a new offer or plan, the group left): its copies, and the mapped tensors
    they read, go with it."""
    if (entry := kept.get(key)) is not None and entry.bucket is bucket:
        del kept[key]


class _Kept:
    """The copies of one `SharedBucket`: its tensors (or the boxes of them) into the live views. Its
    pairs are the same objects at every sync of one plan and offer, and the views are this record's,
    so nothing is checked per tensor again: on a GPU the fusable pairs go as one kept `FusedCopy`
    launch (built at the first replay: a bucket seen once costs no table), the rest as before."""

    __slots__ = ("bucket", "copy", "dsts", "srcs")

    def __init__(self, bucket: weakref.ref[SharedBucket], dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
        self.bucket, self.dsts, self.srcs = bucket, dsts, srcs
        self.copy: FusedCopy | None = None

    def run(self) -> None:
        if self.copy is None and self.srcs and self.srcs[0].is_cuda:
            from ckpt_engine.copy_kernel import FusedCopy, fusable  # Triton, imported where a GPU copies

            fuse = [fusable(d, s) for d, s in zip(self.dsts, self.srcs)]
            self.copy = FusedCopy([d for d, f in zip(self.dsts, fuse) if f], [s for s, f in zip(self.srcs, fuse) if f])
            self.dsts = [d for d, f in zip(self.dsts, fuse) if not f]
            self.srcs = [s for s, f in zip(self.srcs, fuse) if not f]
        if self.copy is not None:
            self.copy.launch()
        if self.dsts:
            copy_large_alone_(self.dsts, self.srcs)


def with_direct(
    load_weights: Callable[[Pairs], object], direct: DirectLoads | None, loading: Callable[[], AbstractContextManager[object]],
) -> Callable[[Pairs], None]:
    """`load_weights` inside `loading()` (vLLM's config, no autograd), with what `direct` covers
    copied directly first, outside it: a bucket that leaves nothing to vLLM's loader does not enter
    vLLM's config (~10 us a bucket on the CPU box)."""
    def load(pairs: Pairs) -> None:
        rest = direct.load(pairs) if direct is not None else pairs
        if rest:
            with loading():
                load_weights(rest)
    return load


def _refused(name: str, landings: Sequence[Landing], rec: PlanRecording) -> str:
    """Why `name` must go through vLLM's loader ('' when its copies can be made directly)."""
    if name in rec.unfollowed:
        return rec.unfollowed[name]
    if name in rec.whole:
        return rec.whole[name]
    if name in rec.computed:
        return f"the loader computes with it ({rec.computed[name]})"
    if rec.touched.get(name, set()) != {la.target for la in landings}:
        return "the loader writes tensors no recorded copy explains"
    root = landings[0].root
    if any(la.root != root for la in landings) or sum(prod(hi - lo for lo, hi in la.box) for la in landings) != prod(root):
        return "its recorded copies do not cover the tensor exactly once"
    return ""


def _live_copies(model: torch.nn.Module, landings: Sequence[Landing]) -> _Copies | None:
    """The live views of `landings` (None when a parameter is not as the dry run recorded it)."""
    slices: list[tuple[slice, ...] | None] = []
    dsts: list[torch.Tensor] = []
    dtype = None
    for la in landings:
        live = resolve_tensor(model, la.target)
        if live is None or live.is_meta or tuple(live.shape) != la.target_shape or not live.is_contiguous():
            return None
        if dtype is not None and live.dtype != dtype:
            return None
        dtype = live.dtype
        dsts.append(live.as_strided(la.sizes, la.strides, live.storage_offset() + la.offset))
        whole = all(lo == 0 and hi == n for (lo, hi), n in zip(la.box, la.root))
        slices.append(None if whole else tuple(slice(lo, hi) for lo, hi in la.box))
    assert dtype is not None
    return _Copies(landings[0].root, dtype, slices, dsts)
