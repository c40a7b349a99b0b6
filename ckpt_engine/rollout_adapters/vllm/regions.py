"""Record a vLLM worker's receive plan from vLLM's own weight loaders (a dry run, nothing written).

Every HF tensor is handed to `model.load_weights` as a placeholder: a meta tensor of its global
shape whose views (narrow, chunk, select, t, view, slicing ... whatever aliases it) are followed by
their geometry. Each op that reads a placeholder view's elements — the final `copy_` into a
parameter, but also arithmetic, a dtype conversion, a copying reshape — records the box of the HF
tensor that view covers; nothing reaches the parameters (the loader's copies are swallowed, and the
parameters are vLLM's meta stand-ins of layerwise reload). The boxes of one tensor become its
regions along the one dimension that moves the fewest elements.

So fused QKV under GQA, gate_up, vocab shards and per-expert TP slices need no model-specific code.
The recorded regions are exactly what the loader reads when the real tensor comes: the regions then
land through the same loader (see `region_assembler.py`), so the engine ends as a full load leaves
it. What cannot be bounded falls back to the whole tensor for that name, logged once: a loader that
raises on a placeholder (it needs data: `.item()`, boolean masks), a read through a view that is not
a box of the tensor, or a whole-tensor op before any slicing. Names the loader never touches
or reads nothing from (another EP rank's experts: looked at, then skipped) are absent. Not seen: a
loader that installs the HF tensor itself as a parameter (`nn.Parameter(w)`) without any copy or
`.data =` assignment; vLLM's loaders copy.

The same dry run records where each box lands (`vllm/installed.py`'s `Landing`: every `copy_` of a
box read in C order into a view of a parameter or buffer of the same shape), for installed-weight
checks; names it cannot follow so are `unfollowed`.
"""

from __future__ import annotations

import functools
import logging
import types
from math import prod
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ckpt_engine.manifest import TensorSpec
from ckpt_engine.planning.regions import ReceivePlan, Region
from ckpt_engine.rollout_adapters.region_footprint import Box, box_of_view, regions_of_boxes
from ckpt_engine.rollout_adapters.vllm.installed import Landing
from ckpt_engine.rollout_adapters.vllm.specs import load_weights_of

__all__ = ["DryRun", "PlanRecording", "dry_run", "planned", "record_receive_plan", "trace_loader"]

logger = logging.getLogger(__name__)

@dataclass
class PlanRecording:
    """What one dry run saw: the reads per name, and why names fell back to whole tensors."""

    specs: Mapping[str, TensorSpec]
    boxes: dict[str, list[Box]] = field(default_factory=dict)
    whole: dict[str, str] = field(default_factory=dict)
    computed: dict[str, str] = field(default_factory=dict)
    """Names read by an op other than a copy into a destination (arithmetic, a dtype conversion ...)."""
    targets: dict[int, tuple[str, torch.Tensor]] = field(default_factory=dict)
    """The model's parameters and buffers during the dry run, by storage: their layout names."""
    landings: list[Landing] = field(default_factory=list)
    unfollowed: dict[str, str] = field(default_factory=dict)
    """Names whose landing is not a plain copy of a box (installed-weight checks leave them unchecked)."""
    touched: dict[str, set[str]] = field(default_factory=dict)
    """Name -> the layout tensors any of its writes reached (followed or not)."""

    def land(self, name: str, src: torch.Tensor, root: torch.Tensor, dest: Any, how: str) -> None:
        """A write of (a view of) `name` into `dest`: a `Landing` if it is a plain copy of a box."""
        target = self.targets.get(dest.untyped_storage()._cdata) if isinstance(dest, torch.Tensor) else None
        if target is not None:
            self.touched.setdefault(name, set()).add(target[0])
        if name in self.unfollowed or src.numel() == 0:
            return
        why = None
        box = box_of_view(tuple(root.shape), tuple(src.shape), tuple(src.stride()), int(src.storage_offset()))
        if how != "copy_":
            why = f"written by {how}"
        elif target is None:
            why = "copied into a tensor that is not a parameter or buffer of the model"
        elif box is None or not _is_box_in_c_order(tuple(root.shape), box, src):
            why = f"read as a view {list(src.shape)} stride {list(src.stride())} that is not a box in C order (a transpose?)"
        elif tuple(dest.shape) != tuple(src.shape) or dest.dtype != src.dtype:
            why = f"copied {list(src.shape)} into {list(dest.shape)} {dest.dtype} (broadcast or cast)"
        if why is not None:
            self.unfollowed[name] = why
            return
        assert target is not None and box is not None
        tensor = target[1]
        self.landings.append(Landing(
            name, box, tuple(root.shape), target[0], tuple(tensor.shape), tuple(dest.shape), tuple(dest.stride()),
            dest.storage_offset() - tensor.storage_offset(),
        ))

    def read(self, name: str, view: torch.Tensor, root: torch.Tensor, op: str | None = None) -> None:
        if name in self.whole:
            return
        if op is not None:
            self.computed.setdefault(name, op)
        if view.dtype != root.dtype:
            self.whole[name] = f"read as {view.dtype}"
            return
        box = box_of_view(tuple(root.shape), tuple(view.shape), tuple(view.stride()), int(view.storage_offset()))
        if box is None:
            self.whole[name] = f"view {list(view.shape)} stride {list(view.stride())} is not a box of the tensor"
            return
        self.boxes.setdefault(name, []).append(box)

    def fall_back(self, name: str, reason: str) -> None:
        self.whole.setdefault(name, reason)

    def plan(self) -> ReceivePlan:
        """Names read -> regions (None: whole); names never read are left out (a loader that looks at
        a tensor and then skips it, as for another EP rank's expert, reads nothing)."""
        holds: dict[str, tuple[Region, ...] | None] = {}
        for name, spec in self.specs.items():
            if name in self.whole:
                holds[name] = None
            elif name in self.boxes:
                regions = regions_of_boxes(spec.shape, self.boxes[name])
                if regions == ():
                    continue  # only empty reads
                if regions is None and name in self.computed:
                    self.whole[name] = f"{self.computed[name]} reads the whole tensor"
                holds[name] = regions
        return ReceivePlan(holds)


class _Placeholder(torch.Tensor):
    """A meta tensor standing for one HF tensor; its aliases stay placeholders of the same name."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]  # the recording mode does the work (torch's stubs: a classmethod here)
    _ckpt_name: str
    _ckpt_root: torch.Tensor
    _ckpt_rec: PlanRecording


# Calls that put their tensor arguments into a destination (`copy_`, `dest[i] = p`, `param.data = p`).
_SINK_NAMES = frozenset({"copy_", "__setitem__", "__set__"})


class _RecordingMode(TorchFunctionMode):
    """Sees every torch call of the dry run (also `dest[i] = p` and `param.data = p`, which a tensor
    subclass alone does not): follows aliases of placeholders, records what reads them, and
    swallows every write of a placeholder into a destination."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs if kwargs is not None else {}
        placeholders = [a for a in _walk((args, kwargs)) if isinstance(a, _Placeholder)]
        if not placeholders:
            return func(*args, **kwargs)
        if getattr(func, "__name__", "") in _SINK_NAMES:
            dest = args[0] if args else None
            for p in placeholders:
                if p is not dest:
                    p._ckpt_rec.read(p._ckpt_name, p, p._ckpt_root)
                    p._ckpt_rec.land(p._ckpt_name, p, p._ckpt_root, dest, func.__name__)
            if dest is not None and not isinstance(dest, _Placeholder):
                return dest if func.__name__ == "copy_" else None  # nothing is written
        out = func(*args, **kwargs)
        tensors = [o for o in _walk(out) if isinstance(o, torch.Tensor)]
        for p in placeholders:
            if any(not (o.is_meta and torch._C._is_alias_of(o, p._ckpt_root)) for o in tensors):  # type: ignore[attr-defined]  # not in torch's stubs
                p._ckpt_rec.read(p._ckpt_name, p, p._ckpt_root, _op_name(func))  # a new tensor made from its elements
        return _wrap(out, placeholders)


def _coalesced(sizes: tuple[int, ...], strides: tuple[int, ...]) -> list[tuple[int, int]]:
    """A view's walk in C order as (size, stride) runs: size-1 dimensions dropped, adjacent ones merged."""
    out: list[tuple[int, int]] = []
    for z, s in zip(sizes, strides):
        if z == 1:
            continue
        if out and out[-1][1] == z * s:
            out[-1] = (out[-1][0] * z, s)
        else:
            out.append((z, s))
    return out


def _is_box_in_c_order(shape: tuple[int, ...], box: Box, view: torch.Tensor) -> bool:
    """Whether `view` walks exactly the elements of `box` of a contiguous tensor of `shape`, in C order."""
    h = [prod(shape[d + 1 :]) for d in range(len(shape))]
    sizes = tuple(hi - lo for lo, hi in box)
    if prod(sizes) != view.numel() or view.storage_offset() != sum(lo * s for (lo, _), s in zip(box, h)):
        return False
    return _coalesced(sizes, tuple(h)) == _coalesced(tuple(view.shape), tuple(view.stride()))


def _op_name(func: Any) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)


def _walk(value: Any) -> Iterator[Any]:
    if isinstance(value, (list, tuple)):
        for v in value:
            yield from _walk(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _walk(v)
    else:
        yield value


def _wrap(out: Any, placeholders: list[_Placeholder]) -> Any:
    """Keep aliases of a placeholder as placeholders (their geometry is followed); the rest plain."""
    if isinstance(out, (list, tuple)):
        wrapped = [_wrap(o, placeholders) for o in out]
        if all(w is o for w, o in zip(wrapped, out)):
            return out  # keeps torch.Size, named tuples and the like as they are
        return wrapped if isinstance(out, list) else tuple(wrapped)
    if not isinstance(out, torch.Tensor) or isinstance(out, _Placeholder) or not out.is_meta:
        return out
    for p in placeholders:
        if torch._C._is_alias_of(out, p._ckpt_root):  # type: ignore[attr-defined]  # not in torch's stubs
            return _placeholder_of(out, p._ckpt_name, p._ckpt_root, p._ckpt_rec)
    return out


def _placeholder_of(meta: torch.Tensor, name: str, root: torch.Tensor, rec: PlanRecording) -> _Placeholder:
    p = meta.as_subclass(_Placeholder)
    p._ckpt_name, p._ckpt_root, p._ckpt_rec = name, root, rec
    return p


def _placeholders(specs: Mapping[str, TensorSpec], rec: PlanRecording) -> Iterator[tuple[str, torch.Tensor]]:
    for name, spec in specs.items():
        root = torch.empty(spec.shape, dtype=getattr(torch, spec.dtype), device="meta")
        yield name, _placeholder_of(root, name, root, rec)


def record_receive_plan(model: torch.nn.Module, specs: Mapping[str, TensorSpec], vllm_config: Any) -> tuple[ReceivePlan, PlanRecording]:
    """Dry-run `model.load_weights` over placeholders of `specs` (HF name -> spec) and return the
    regions each name's loader reads, with the recording (fallback reasons).

    Runs in a vLLM worker between syncs (never while a reload is open). The model's layers are put
    on vLLM's meta stand-ins (`initialize_layerwise_reload`), their original loaders run against
    placeholders, and the served tensors are put back untouched.
    """
    with dry_run(model, vllm_config) as run:
        rec = run.record(specs)
    return planned(rec), rec


def planned(rec: PlanRecording) -> ReceivePlan:
    """`rec`'s plan, its whole-tensor fallbacks logged once."""
    plan = rec.plan()
    if rec.whole:
        shown = "; ".join(f"{n}: {why}" for n, why in list(rec.whole.items())[:8])
        more = f" (and {len(rec.whole) - 8} more)" if len(rec.whole) > 8 else ""
        logger.warning("receive plan: %d tensors fall back to whole tensors: %s%s", len(rec.whole), shown, more)
    return plan


@dataclass
class DryRun:
    """The model on vLLM's meta stand-ins with its original loaders (inside `dry_run`): `layout` is
    what the loaders write into, by storage (name, tensor); `record` traces them over some specs."""

    model: torch.nn.Module
    layout: dict[int, tuple[str, torch.Tensor]]
    loaders: list[str]
    """The loader each layout tensor with one is loaded by (its function's module and qualified name,
    in walk order): a loader replaced since vLLM built the model changes it."""

    def record(self, specs: Mapping[str, TensorSpec]) -> PlanRecording:
        rec = PlanRecording(specs)
        rec.targets = self.layout
        trace_loader(load_weights_of(self.model), specs, rec)
        rec.targets = {}
        return rec


@contextmanager
def dry_run(model: torch.nn.Module, vllm_config: Any) -> Iterator[DryRun]:
    """The model's layers on vLLM's meta stand-ins (`initialize_layerwise_reload`) with their original
    loaders for the span of the block (any number of recordings), the served tensors put back after."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload
    from vllm.model_executor.model_loader.reload.layerwise import (
        LAYERWISE_INFO,
        _get_original_loader,
        _place_kernel_tensors,
    )
    from vllm.model_executor.model_loader.reload.utils import get_layer_tensors

    layout: dict[int, tuple[str, torch.Tensor]] = {}
    saved: list[tuple[Any, Any]] = []  # (a vLLM parameter, the loader that rides on it)
    with set_current_vllm_config(vllm_config), torch.no_grad():
        initialize_layerwise_reload(model)
        try:
            for path, module in model.named_modules():  # the meta stand-ins loaders write into
                for attr, tensor in get_layer_tensors(module).items():
                    layout.setdefault(tensor.untyped_storage()._cdata, (f"{path}.{attr}" if path else attr, tensor))
            # Call the original loaders: the layerwise wrappers would count copies and process layers.
            for module in model.modules():
                for tensor in get_layer_tensors(module).values():
                    loader = getattr(tensor, "weight_loader", None)
                    if loader is not None and loader.__name__ == "online_process_loader":
                        saved.append((tensor, loader))
                        tensor.weight_loader = _get_original_loader(tensor)
            loaders = [f"{name}={_loader_name(t.weight_loader)}" for name, t in layout.values() if hasattr(t, "weight_loader")]
            yield DryRun(model, layout, loaders)
        finally:
            for tensor, loader in saved:
                tensor.weight_loader = loader
            for layer in model.modules():
                info = LAYERWISE_INFO.get(layer)
                if info is not None and info.can_load():
                    if info.kernel_tensors is not None:
                        _place_kernel_tensors(layer, info)
                    info.reset()
            if hasattr(model, "_original_do_torchao_reload"):
                model._do_torchao_reload = model._original_do_torchao_reload


def _loader_name(loader: Any) -> str:
    """A loader's stable name across processes: its function's module and qualified name."""
    while isinstance(loader, functools.partial):
        loader = loader.func
    fn = loader.__func__ if isinstance(loader, types.MethodType) else loader
    if isinstance(fn, types.FunctionType):
        return f"{fn.__module__}.{fn.__qualname__}"
    return f"{type(fn).__module__}.{type(fn).__qualname__}"


def trace_loader(load: Callable[[Iterable[tuple[str, torch.Tensor]]], Any], specs: Mapping[str, TensorSpec], rec: PlanRecording | None = None) -> PlanRecording:
    """Run `load` (a `load_weights`) over placeholders of `specs` under the recording mode and
    return what it read; its destinations must accept writes that never happen (meta tensors)."""
    rec = rec if rec is not None else PlanRecording(specs)
    with _RecordingMode():
        _load_all(load, list(_placeholders(specs, rec)), rec)
    return rec


def _load_all(load: Callable[[Iterable[tuple[str, torch.Tensor]]], Any], items: list[tuple[str, torch.Tensor]], rec: PlanRecording) -> None:
    """`load` over every item; a loader that raises marks its name whole and the rest go on."""
    pos = 0
    while pos < len(items):
        current = [pos]

        def feed(start: int) -> Iterator[tuple[str, torch.Tensor]]:
            for i in range(start, len(items)):
                current[0] = i
                yield items[i]
            current[0] = len(items)

        try:
            result = load(feed(pos))
            if isinstance(result, Iterator):
                for _ in result:  # a lazy loader loads as it is consumed
                    pass
            return
        except Exception as exc:  # a loader that needs data (or refuses a name): whole tensor
            name = items[current[0]][0] if current[0] < len(items) else "?"
            rec.fall_back(name, f"the loader raised {type(exc).__name__}: {str(exc)[:120]}")
            pos = current[0] + 1
