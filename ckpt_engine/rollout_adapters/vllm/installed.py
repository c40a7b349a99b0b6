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

What a check reads live is worked out once per model and set of names (`CheckLayout`: the keys, the
modules, what is unwritten; `LiveImages`: each whole region's view of its live tensor, checked
before each use) instead of resolving every layout name at every check (~12 ms of Python for a 7B
model's 339 tensors against a ~25 ms sync on one GPU).

The controller's side: the extension route sends the check with the receive (`vllm/routes.py`; the
hooks need the seed before the first bucket), `arm_workers` for the routes that arm apart (adapter
syncs), `worker_reports` asks for the digests after the stream where they did not ride back with it.
"""

from __future__ import annotations

import logging
import operator
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from math import prod
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ckpt_engine.installed import Folds, InstalledReport, InstalledRequest, Key, key_text, wire_keys
from ckpt_engine.planning.regions import ReceivePlan, Region

if TYPE_CHECKING:
    from ckpt_engine.installed_kernel import Folder, Readback

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
        self._check: tuple[tuple[str, ...], CheckLayout] | None = None

    def check(self, names: Sequence[str]) -> CheckLayout:
        """What a check of `names` reads here: worked out once for the names a sync sends (the same
        at every check of a session)."""
        key = tuple(names)
        if self._check is None or self._check[0] != key:
            self._check = (key, CheckLayout(self, key))
        return self._check[1]


class CheckLayout:
    """What a check of one set of names reads in one `LandingMap`: its keys, the modules they land
    in, what no landing of them writes or follows, and the live views (kept while valid)."""

    def __init__(self, landings: LandingMap, names: tuple[str, ...]) -> None:
        self.keys = [k for n in dict.fromkeys(names) for k in landings.by_name.get(n, ())]
        self.sliced = any(k[1] is not None for k in self.keys)
        """Whether some key is a region of its tensor (worked out once: a report asks after the copies)."""
        self.modules: dict[str, list[Key]] = {}
        self.whole: list[tuple[Slot, Landing]] = []
        """The slots whose region lands as one box of one tensor (read as a view of it)."""
        self.pieces: list[tuple[Key, str, list[Landing]]] = []
        """The others: assembled from their pieces at every check."""
        for key in self.keys:
            for target, group in landings.groups[key].items():
                self.modules.setdefault(target.rpartition(".")[0], []).append(key)
                image = _image_shape(group[0].root, key[1])
                if len(group) == 1 and all(hi - lo == n for (lo, hi), n in zip(group[0].box, image)):
                    self.whole.append(((key, target), group[0]))
                else:
                    self.pieces.append((key, target, group))
        sent = set(names)
        written = {la.target for k in self.keys for g in landings.groups[k].values() for la in g}
        for n in sent:
            written |= landings.touched.get(n, set())
        self.unwritten = [t for t in landings.layout if t not in written]
        self.unfollowed = {f"{n} ({landings.unfollowed[n]})" for n in sent if n in landings.unfollowed} | {
            f"{n} (no loader read it in the dry run)" for n in sent if n not in landings.by_name and n not in landings.unfollowed
        }
        self._live: tuple[frozenset[str], LiveImages] | None = None

    def live(self, model: torch.nn.Module, hooked: set[str]) -> LiveImages:
        """The views of the whole slots outside `hooked` (modules captured as they loaded), kept
        while every tensor they read stays where it was."""
        skip = frozenset(hooked)
        if self._live is None or self._live[0] != skip or not self._live[1].valid():
            slots = [(slot, la) for slot, la in self.whole if slot[1].rpartition(".")[0] not in skip]
            self._live = (skip, LiveImages(model, slots))
        return self._live[1]


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


Slot = tuple[Key, str]
"""A (checkpoint name, region) key and the layout name of the tensor it landed in."""


class LiveImages:
    """The views of `slots` (each a whole region landed as one box of one tensor: its `Landing`) in
    `model`'s live tensors; a slot whose tensor is not readable now (a layer still waiting for
    weights, a shape post-processing changed) is left to the caller (`rest`)."""

    def __init__(self, model: torch.nn.Module, slots: Sequence[tuple[Slot, Landing]]) -> None:
        self.slots: list[Slot] = []
        self.views: list[torch.Tensor] = []
        self.rest: list[Slot] = []
        self._kernel: bool | None = None
        self._folder: Folder | None = None
        self._checks: tuple[list[dict[str, Any]], list[str], list[torch.Tensor], list[int], list[torch.Size]] | None = None
        self._owners: dict[str, tuple[dict[str, Any], str, torch.Tensor, int, torch.Size]] = {}
        with torch._C.DisableTorchFunctionSubclass():  # vLLM's parameters answer in Python otherwise
            for slot, landing in slots:
                t = self._tensor(model, landing)
                if t is None:
                    self.rest.append(slot)
                else:
                    self.slots.append(slot)
                    self.views.append(t.as_strided(landing.sizes, landing.strides, t.storage_offset() + landing.offset))
        self.keys: list[Key] | None = [key for key, _ in self.slots]
        """Each slot's key when no key has two slots (a region loaded into two places), else None."""
        if len(set(self.keys)) != len(self.keys):
            self.keys = None
        self._wire: tuple[list[str], list[Any] | None] | None = None

    def wire_keys(self) -> tuple[list[str], list[Any] | None]:
        """`keys` as a report's wire form lists them (`InstalledReport.to_wire`'s names and regions), made once."""
        if self._wire is None:
            self._wire = wire_keys(self.keys or [])
        return self._wire

    def folder(self) -> Folder:
        """The fold kernel's tables for the views (`on_gpu` ones), kept with them."""
        if self._folder is None:
            from ckpt_engine.installed_kernel import Folder  # Triton: only where a GPU folds

            self._folder = Folder(self.views)
        return self._folder

    def on_gpu(self) -> bool:
        """Whether the views are CUDA images the fold kernel takes (`installed_kernel.py`: one launch)."""
        if self._kernel is None:
            self._kernel = bool(self.views) and all(v.is_cuda for v in self.views)
            if self._kernel:
                from ckpt_engine.installed_kernel import foldable  # Triton: only where a GPU folds

                self._kernel = all(map(foldable, self.views))
        return self._kernel

    def _tensor(self, model: torch.nn.Module, landing: Landing) -> torch.Tensor | None:
        """The live tensor `landing` wrote, if readable in the recorded layout (noted as an owner)."""
        owner = self._owners.get(landing.target)
        if owner is not None:
            return owner[2]
        path, _, attr = landing.target.rpartition(".")
        try:
            module = model.get_submodule(path) if path else model
        except AttributeError:
            return None
        tensors: dict[str, Any] = module._parameters if attr in module._parameters else module._buffers
        t = tensors.get(attr)
        if not isinstance(t, torch.Tensor) or t.is_meta or tuple(t.shape) != landing.target_shape or not t.is_contiguous():
            return None
        self._owners[landing.target] = (tensors, attr, t, t.data_ptr(), t.shape)
        return t

    def valid(self) -> bool:
        """Every tensor the views read is still the one its module holds, where it was (the loops
        in C: a check asks at every report)."""
        if self._checks is None:
            owners = list(self._owners.values())
            self._checks = ([o[0] for o in owners], [o[1] for o in owners], [o[2] for o in owners], [o[3] for o in owners], [o[4] for o in owners])
        holders, attrs, tensors, ptrs, shapes = self._checks
        with torch._C.DisableTorchFunctionSubclass():  # ~3 us a tensor through vLLM's parameter class
            return (
                all(map(operator.is_, map(_get, holders, attrs), tensors))
                and list(map(torch.Tensor.data_ptr, tensors)) == ptrs
                and list(map(_shape, tensors)) == shapes
            )


_get = dict.get
_shape = operator.attrgetter("shape")


class InstalledCapture:
    """One armed check on one worker: digests taken as vLLM's loaders finish each layer (before its
    post-processing), and the report. Runs in the worker process."""

    def __init__(self, model: torch.nn.Module, landings: LandingMap, request: InstalledRequest) -> None:
        self.model, self.landings, self.request = model, landings, request
        self.layout = landings.check(request.names)
        self.keys = list(self.layout.keys)
        self._sliced = self.layout.sliced
        self.folds = Folds(request.seed, request.samples)
        self.values: dict[Key, dict[str, int]] = {}
        """(name, region) -> destination -> its image in `folds` (a later load of the same layer
        replaces it; -(j + 1): the j-th live view, folded in `report`)."""
        self.missing: dict[Key, str] = {}
        self.unchecked: dict[str, str] = {}
        self._modules = self.layout.modules
        self._hooked: set[str] = set()
        """Modules whose layer was captured before post-processing in this check's load."""
        self.seconds = 0.0
        self._launched: tuple[LiveImages, Readback] | None = None
        """The digests `launch` enqueued, with the live views they fold (in their keys' order)."""
        self._expected: tuple[LiveImages, list[Any]] | None = None
        """The source's digests in the order of these live views' keys (`expect`)."""
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
            if method is None or original is None or "process_weights_after_loading" in vars(method):
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
        if len(group) == 1 and all(hi - lo == n for (lo, hi), n in zip(first.box, image)):
            self.values.setdefault(key, {})[target] = self.folds.add(views[0])
            return
        origin = [0] * len(image)
        if region is not None:
            origin[region.dim] = region.start
        whole = torch.empty(image, dtype=t.dtype, device=t.device)
        for la, view in zip(group, views):
            index = tuple(slice(lo - o, hi - o) for (lo, hi), o in zip(la.box, origin))
            whole[index].copy_(view.reshape(tuple(hi - lo for lo, hi in la.box)))
        self.values.setdefault(key, {})[target] = self.folds.add(whole)

    def _live(self) -> tuple[LiveImages, Folder | None]:
        """The live views (kept from the last check while valid) and, on a GPU, the fold kernel's
        tables for them. After the stream: worked out before it (while the trainer walks), they
        delayed the receive's start on one H200 (transfer +5.4 ms against +3.0 ms)."""
        live = self.layout.live(self.model, self._hooked)
        if self.request.samples <= 0 or not live.on_gpu():
            return live, None
        return live, live.folder()

    def _one_launch(self, live: LiveImages, folder: Folder | None) -> bool:
        """Whether every key is read as one live view in one launch (a model that loads in place, at
        every check after the first): no per-key Python on the way."""
        return folder is not None and live.keys is not None and not (self._hooked or live.rest or self.layout.pieces or self.values)

    def launch(self) -> None:
        """Enqueue the one-launch fold now, right behind the sync's last copies and before they
        finish, so that its host work runs while the device copies (on one H200 a 7B report took
        ~0.8 ms after the copies); `report` reads it back. On a stream of its own behind this
        one's work (`Folder.launch_behind`): the receive's closing wait on its copies, and the
        sender's on it, do not wait for the fold, and its digests are on the host by the report.
        Only for a receive whose every write is queued on the current stream when its last tensor
        is taken (the colocated copies of a model that loads in place); anything else folds in
        `report`."""
        t0 = time.perf_counter()
        live, folder = self._live()
        if self._one_launch(live, folder):
            assert folder is not None
            self._launched = (live, folder.launch_behind(self.request.seed, self.request.samples))
        self.seconds += time.perf_counter() - t0

    def expect(self, source: Any) -> None:
        """The source's digests (an `InstalledReport`'s wire form), told while the device copies
        (`ckpt_receive_end`): where they list the launched fold's keys in its order, `report`
        compares the digests it reads back with them and answers `agreed` without its own (no
        digest columns built or compared after the copies); else it answers its digests as ever.
        Never raises (the receive's answer is collected after it)."""
        launched = self._launched
        if launched is None or not isinstance(source, dict) or source.get("missing") or not isinstance(source.get("digests"), list):
            return
        names, regions = launched[0].wire_keys()
        if source.get("names") == names and source.get("regions") == regions:
            self._expected = (launched[0], source["digests"])

    def launching(self, queued: Callable[[], None]) -> Callable[[], None]:
        """`queued` (told once a receive queued its last copies), with `launch` first."""
        def both() -> None:
            self.launch()
            queued()
        return both

    def report(self, whole_only: bool = False) -> InstalledReport:
        """The digests of every key of the request this worker holds: captured before post-processing
        where the hook saw the layer, else read now from the live tensors (their views kept from the
        last check, `LiveImages`; on a GPU folded in one launch). `whole_only`: the sync sent whole
        tensors to a worker whose loaders read slices (no region delivery): the trainer folds whole
        tensors, which this worker does not hold; its sliced names are unchecked."""
        t0 = time.perf_counter()
        keep: set[Key] | None = None
        if whole_only and self._sliced:
            for key in [k for k in self.keys if k[1] is not None]:
                self.keys.remove(key)
                self.unchecked[key[0]] = "this worker holds a slice and the sync sent whole tensors"
            keep, self._sliced = set(self.keys), False
        request = self.request
        launched, self._launched = self._launched, None
        folded: list[int] | None = None
        if keep is None and launched is not None:  # launched behind this receive's last copies: read back
            live, folded = launched[0], launched[1].values()  # (the views were checked at the launch; nothing loads since)
        else:
            live, folder = self._live()
            if keep is None and self._one_launch(live, folder):
                assert folder is not None
                folded = folder.fold(request.seed, request.samples)
        if folded is not None:  # every key one live view, folded in one launch
            expected = self._expected
            agreed = expected is not None and expected[0] is live and folded == expected[1]  # told the source's (`expect`): one C compare
            own = {} if agreed else dict(zip(live.keys or (), folded))
            return InstalledReport(
                own, list(self.layout.unwritten), sorted(self.layout.unfollowed), [], self.seconds + time.perf_counter() - t0, agreed=agreed,
            )
        for j, ((key, target), view) in enumerate(zip(live.slots, live.views)):
            if keep is None or key in keep:
                self.values.setdefault(key, {})[target] = -(j + 1) if folder is not None else self.folds.add(view)
        rest = [(k, t, self.landings.groups[k][t]) for k, t in live.rest] + self.layout.pieces
        for key, target, group in rest:
            if target.rpartition(".")[0] not in self._hooked and (keep is None or key in keep):
                self._digest_group(key, target, group)
        keys = [k for k in self.keys if k in self.values and k not in self.missing and k[0] not in self.unchecked]
        folded = self.folds.values()
        batched = folder.fold(request.seed, request.samples) if folder is not None else []
        digests: dict[Key, int] = {}
        for k in keys:
            copies = [folded[i] if i >= 0 else batched[-i - 1] for i in self.values[k].values()]
            # several full copies of one region (a tensor loaded into two places) must agree
            digests[k] = copies[0] if len(set(copies)) == 1 else copies[0] ^ 1
        unchecked = sorted({f"{n} ({why})" for n, why in self.unchecked.items()} | self.layout.unfollowed)
        missing = sorted({key_text(k) + f": {why}" for k, why in self.missing.items()})
        return InstalledReport(digests, list(self.layout.unwritten), unchecked, missing, self.seconds + time.perf_counter() - t0)


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
