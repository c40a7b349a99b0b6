"""Installed-weight checks inside a vLLM worker (issue 42 item 5): where each checkpoint region
landed in vLLM's own layout, and the digests of what is there after a sync.

Where a region lands is recorded once per model by the receive plan's dry run (`vllm/regions.py`):
every `copy_` of a checkpoint tensor's box into a parameter or buffer is a `Landing` (the box, the
destination tensor's layout name, the destination view's geometry in it). So fused QKV, gate_up,
TP slices and stacked experts are followed through vLLM's own loaders, with no model-specific code.
A landing is kept only when the loader reads a box of the tensor in C order and copies it into a
view of the same shape: a read through a permuted view (a transpose), a copy into something that is
not a parameter or buffer, a broadcast or an indexed store make the name `unchecked` (named, never
guessed). The map is recorded before any fault that appears later (a loader changed, a race, a
skipped tensor), and a loader that transposes from the start is named as unchecked.

What is digested is what the loaders wrote into vLLM's tensors: for a layer vLLM post-processes
(every layer with a `quant_method`: on CPU the linear weights are repacked for oneDNN and the
parameter left empty, quantized layers are converted), right after its loaders ran and before the
post-processing (a hook on `process_weights_after_loading`, only while a checked sync loads); for
the others (norms, biases, buffers) the live tensor when the check asks. A layer still waiting for
weights when the check asks (a loader skipped one of its tensors) has its names `missing`. The
parameters and persistent buffers of vLLM's layout that no landing of the sync's names writes are
`unwritten` (the attention layers' `_k_scale` and the like, a buffer nothing syncs).

The controller's side: `arm_workers` tells every worker the check before the stream (the hooks need
the seed), `worker_reports` asks for the digests after it; `VllmRollout` calls both.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from math import prod
from typing import Any, Protocol

import torch

from ckpt_engine.installed import Folds, InstalledReport, InstalledRequest, Key
from ckpt_engine.planning.regions import ReceivePlan, Region

__all__ = ["InstalledCapture", "Landing", "LandingMap", "arm_workers", "layout_names", "resolve_tensor", "worker_reports"]

logger = logging.getLogger(__name__)

Box = tuple[tuple[int, int], ...]
_TAG = "_ckpt_installed_path"
"""A live layer's path, set on it while a check is armed (a staged sync's shadow copies it)."""


@dataclass(frozen=True)
class Landing:
    """One copy of a checkpoint tensor's box into a tensor of vLLM's layout, recorded in the dry run."""

    name: str
    box: Box
    root: tuple[int, ...]
    """The checkpoint tensor's shape."""
    target: str
    """The destination's layout name (`model.layers.0.self_attn.qkv_proj.weight`)."""
    target_shape: tuple[int, ...]
    sizes: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int
    """The destination view: its geometry relative to the destination tensor's first element."""


class LandingMap:
    """Where every checkpoint name of one worker's model lands (a dry run's landings), the layout's
    parameters and persistent buffers, and the names whose landing could not be followed."""

    def __init__(
        self, landings: Sequence[Landing], layout: Sequence[str], unfollowed: Mapping[str, str], touched: Mapping[str, set[str]],
        plan: ReceivePlan | None,
    ) -> None:
        self.layout = list(layout)
        self.unfollowed = dict(unfollowed)
        self.touched = {n: set(t) for n, t in touched.items()}
        self.groups: dict[Key, dict[str, list[Landing]]] = {}
        """(name, region) -> destination tensor -> the landings that make the region there."""
        for landing in landings:
            if landing.name in self.unfollowed:
                continue
            key = (landing.name, _region_of(plan, landing))
            self.groups.setdefault(key, {}).setdefault(landing.target, []).append(landing)
        self.by_name: dict[str, list[Key]] = {}
        for key in self.groups:
            self.by_name.setdefault(key[0], []).append(key)


def _region_of(plan: ReceivePlan | None, landing: Landing) -> Region | None:
    regions = plan.holds.get(landing.name) if plan is not None else None
    for r in regions or ():
        lo, hi = landing.box[r.dim]
        if r.start <= lo and hi <= r.start + r.length:
            return r
    return None


def _image_shape(root: tuple[int, ...], region: Region | None) -> tuple[int, ...]:
    return root if region is None else tuple(region.length if d == region.dim else n for d, n in enumerate(root))


class _Layout(Protocol):
    def get_submodule(self, target: str) -> torch.nn.Module: ...


def resolve_tensor(model: _Layout, target: str) -> torch.Tensor | None:
    """The model's parameter or buffer at layout name `target` (None: not a tensor there)."""
    path, _, attr = target.rpartition(".")
    try:
        module = model.get_submodule(path) if path else model
    except AttributeError:
        return None
    t = getattr(module, attr, None)
    return t if isinstance(t, torch.Tensor) else None


class InstalledCapture:
    """One armed check on one worker: digests taken as vLLM's loaders finish each layer (before its
    post-processing), and the report. Runs in the worker process."""

    def __init__(self, model: torch.nn.Module, landings: LandingMap, request: InstalledRequest) -> None:
        self.model, self.landings, self.request = model, landings, request
        self.keys = [k for n in dict.fromkeys(request.names) for k in landings.by_name.get(n, ())]
        self.folds = Folds(request.seed, request.samples)
        self.values: dict[Key, dict[str, int]] = {}
        """(name, region) -> destination -> its image in `folds` (a later load of the same layer replaces it)."""
        self.missing: dict[Key, str] = {}
        self.unchecked: dict[str, str] = {}
        modules: dict[str, list[Key]] = {}
        for key in self.keys:
            for target in self.landings.groups[key]:
                modules.setdefault(target.rpartition(".")[0], []).append(key)
        self._modules = modules
        self._hooked: set[str] = set()
        """Modules whose layer was captured before post-processing in this check's load."""
        self.seconds = 0.0
        self._batch: list[torch.Tensor] | None = None
        """Live CUDA images read in `report`, folded in one launch (`installed_kernel.py`); an image's
        index -(j + 1) in `values` is the j-th of them."""
        self._foldable: Callable[[torch.Tensor], bool] = lambda t: False
        self._patched: list[Any] = []
        self._tagged: list[torch.nn.Module] = []

    def install(self) -> None:
        """From the arm to the report: every layer of the check that vLLM post-processes (in a live
        reload, or on the shadow a staged sync prepares: `vllm/shadow.py` copies a layer's attributes,
        its tag and its quant method included) is digested right before. Each live layer is tagged with
        its path; the hook sits on the layer's quant method instance."""
        for path in self._modules:
            module = self.model.get_submodule(path) if path else self.model
            module.__dict__[_TAG] = path
            self._tagged.append(module)
            method = getattr(module, "quant_method", None)
            original = getattr(method, "process_weights_after_loading", None)
            if original is None or "process_weights_after_loading" in vars(method):
                continue  # no post-processing, or already hooked (a method shared by layers)
            method.process_weights_after_loading = self._hook(original)
            self._patched.append(method)

    def remove(self) -> None:
        for method in self._patched:
            vars(method).pop("process_weights_after_loading", None)
        for module in self._tagged:
            module.__dict__.pop(_TAG, None)
        self._patched, self._tagged = [], []

    def _hook(self, original: Any) -> Any:
        def process_weights_after_loading(layer: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            path = layer.__dict__.get(_TAG)
            if path in self._modules:
                self._capture(path, layer)
            return original(layer, *args, **kwargs)

        return process_weights_after_loading

    def _capture(self, path: str, layer: torch.nn.Module) -> None:
        t0 = time.perf_counter()
        self._hooked.add(path)
        for key in self._modules[path]:
            for target, group in self.landings.groups[key].items():
                if target.rpartition(".")[0] == path:
                    self._digest_group(key, target, group, layer)
        self.seconds += time.perf_counter() - t0

    def _digest_group(self, key: Key, target: str, group: list[Landing], layer: torch.nn.Module | None = None) -> None:
        name, region = key
        t = resolve_tensor(self.model, target) if layer is None else getattr(layer, target.rpartition(".")[2], None)
        if t is None or t.is_meta:
            self.missing[key] = f"{target} is not loaded (its layer still waits for weights: a loader skipped some)"
            return
        first = group[0]
        if tuple(t.shape) != first.target_shape or not t.is_contiguous():
            self.unchecked[name] = f"{target} is {list(t.shape)} after vLLM's post-processing (recorded {list(first.target_shape)}); not readable"
            return
        image = _image_shape(first.root, region)
        if sum(prod(hi - lo for lo, hi in la.box) for la in group) != prod(image):
            self.unchecked[name] = f"its region lands in {target} in pieces that do not cover it once"
            return
        views = [t.as_strided(la.sizes, la.strides, t.storage_offset() + la.offset) for la in group]
        origin = [0] * len(image)
        if region is not None:
            origin[region.dim] = region.start
        if len(group) == 1 and all(hi - lo == n for (lo, hi), n in zip(first.box, image)):
            if layer is None and self._batch is not None and self._foldable(views[0]):
                self._batch.append(views[0])
                self.values.setdefault(key, {})[target] = -len(self._batch)
                return
            self.values.setdefault(key, {})[target] = self.folds.add(views[0])
            return
        whole = torch.empty(image, dtype=t.dtype, device=t.device)
        for la, view in zip(group, views):
            index = tuple(slice(lo - o, hi - o) for (lo, hi), o in zip(la.box, origin))
            whole[index].copy_(view.reshape(tuple(hi - lo for lo, hi in la.box)))
        self.values.setdefault(key, {})[target] = self.folds.add(whole)

    def report(self, whole_only: bool = False) -> InstalledReport:
        """The digests of every key of the request this worker holds: captured before post-processing
        where the hook saw the layer, else read now from the live tensors. `whole_only`: the sync sent
        whole tensors to a worker whose loaders read slices (no region delivery): the trainer folds
        whole tensors, which this worker does not hold; its sliced names are unchecked."""
        t0 = time.perf_counter()
        if whole_only:
            for key in [k for k in self.keys if k[1] is not None]:
                self.keys.remove(key)
                self.unchecked[key[0]] = "this worker holds a slice and the sync sent whole tensors"
        fold_images: Callable[[Sequence[torch.Tensor], int, int], list[int]] | None = None
        if self.request.samples > 0 and _on_cuda(self.model):
            from ckpt_engine.installed_kernel import fold_images, foldable  # Triton: only where a GPU folds

            self._batch, self._foldable = [], foldable
        for key in self.keys:
            for target, group in self.landings.groups[key].items():
                if target.rpartition(".")[0] not in self._hooked:
                    self._digest_group(key, target, group)
        keys = [k for k in self.keys if k in self.values and k not in self.missing and k[0] not in self.unchecked]
        folded = self.folds.values()
        batched: list[int] = []
        if self._batch and fold_images is not None:
            batched = fold_images(self._batch, self.request.seed, self.request.samples)
        answers = [folded[i] if i >= 0 else batched[-i - 1] for k in keys for i in self.values[k].values()]
        digests: dict[Key, int] = {}
        pos = 0
        for k in keys:
            copies = answers[pos : pos + len(self.values[k])]
            pos += len(copies)
            # several full copies of one region (a tensor loaded into two places) must agree
            digests[k] = copies[0] if len(set(copies)) == 1 else copies[0] ^ 1
        sent = set(self.request.names)
        written = {la.target for k in self.keys for g in self.landings.groups[k].values() for la in g}
        for n in sent:
            written |= self.landings.touched.get(n, set())
        unwritten = [t for t in self.landings.layout if t not in written]
        unchecked = sorted(
            {f"{n} ({why})" for n, why in self.unchecked.items()}
            | {f"{n} ({self.landings.unfollowed[n]})" for n in sent if n in self.landings.unfollowed}
            | {f"{n} (no loader read it in the dry run)" for n in sent if n not in self.landings.by_name and n not in self.landings.unfollowed}
        )
        missing = sorted({_key_text(k) + f": {why}" for k, why in self.missing.items()})
        return InstalledReport(digests, unwritten, unchecked, missing, self.seconds + time.perf_counter() - t0)


def _on_cuda(model: torch.nn.Module) -> bool:
    first = next(model.parameters(), None)
    return first is not None and first.is_cuda


def _key_text(key: Key) -> str:
    name, r = key
    return name if r is None else f"{name}[dim {r.dim}: {r.start}:{r.start + r.length}]"


class _Workers(Protocol):
    """What the controller-side functions need of a vLLM handle's channel (`vllm/clients.py`)."""

    def collective_rpc(self, method: str, kwargs: dict[str, Any], timeout_s: float) -> list[Any]: ...


def arm_workers(channel: _Workers, request: InstalledRequest, timeout_s: float) -> None:
    """Before the stream: every worker learns the check (its seed and the names) and records where
    regions land if it has not yet (a dry run of its loaders, once per model)."""
    channel.collective_rpc("ckpt_installed_arm", {"request": request.to_wire()}, timeout_s)


def worker_reports(channel: _Workers, request: InstalledRequest, timeout_s: float) -> list[InstalledReport]:
    """After the stream (before finalize; staged: after the swap): one report per worker rank."""
    return [InstalledReport.from_wire(r) for r in channel.collective_rpc("ckpt_installed", {"request": request.to_wire()}, timeout_s)]


def layout_names(model: torch.nn.Module) -> list[str]:
    """vLLM's layout: every parameter and persistent buffer of the live model, once per storage
    (a tied head is its embedding); integer buffers (expert maps, masks) are bookkeeping, not weights."""
    seen: set[int] = set()
    out: list[str] = []
    for path, module in model.named_modules():
        tensors = [(a, t, True) for a, t in module._parameters.items() if t is not None]
        tensors += [(a, t, False) for a, t in module._buffers.items() if t is not None and a not in module._non_persistent_buffers_set]
        for attr, t, is_param in tensors:
            key = t.untyped_storage()._cdata
            if key in seen or (not is_param and not (t.is_floating_point() or t.is_complex())):
                continue
            seen.add(key)
            out.append(f"{path}.{attr}" if path else attr)
    return out
