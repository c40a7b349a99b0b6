"""The staged version prepared off the step path: vLLM's own load and post-processing, run on a shadow.

A staged vLLM swap used to open layerwise reload on the live model, run `model.load_weights` with the
staged tensors and vLLM's per-layer `process_weights_after_loading` (on CPU: a repack of every
linear weight into a oneDNN / sgl-kernel handle), all between two engine steps. Here the same vLLM
code runs on the staging thread, on a *shadow* of the model while the engine keeps stepping on the
live one:

- the shadow is a copy of the module tree that shares no tensor with the live model. Its tensors
  start as storage-less placeholders (class and loader attributes kept; vLLM's reload metadata is
  copied per module, so nothing the shadow's load writes can reach a live tensor): only tensors
  vLLM loads in place (`bias`, never moved to meta) are cloned;
- vLLM's layerwise reload (`initialize_layerwise_reload` -> `load_weights` ->
  `finalize_layerwise_reload`) runs on the shadow with no kernel tensors to copy back into: it
  materializes each layer the staged version touches, loads it with the model's own loaders and
  post-processes it, and the layer keeps what it made. Layers the staged version does not touch are
  never materialized, and finalize skips them: the shadow's memory and build time follow the change
  (a sync of some layers prepares only those), not the model;
- `ShadowWeights` holds, per touched live layer, the post-processed tensors under the live layer's
  kernel names (what vLLM's own reload would copy into them) and the attributes post-processing set
  (on CPU `cpu_linear`, the closure that owns the packed weight).

The swap (`ShadowWeights.swap_in`) then copies those tensors into the live ones in one pass and
moves the attributes over. It copies rather than re-points tensors: on GPU, CUDA graphs captured the
live tensors' addresses, so a pointer swap would leave the graphs reading the old version; a device
copy into the same storage keeps them valid. The attributes are plain Python objects that kernels
take at call time (no graph captures them on CPU), so they move by reference.

Where a shadow cannot be built (no reload metadata, a shape that post-processing changed, not
enough memory), the swap falls back to today's reload on the live model, said once per worker.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from types import MethodType
from typing import Any, cast

import torch

from ckpt_engine.rollout_adapters.vllm.specs import load_weights_of

__all__ = ["ShadowPreparer", "ShadowWeights", "build_shadow", "shadow_enabled"]

logger = logging.getLogger(__name__)

_MODULE_STATE = frozenset({"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"})
_MISSING = object()
_LOADER_KEYS = frozenset({"weight_loader", "_weight_loader"})
_warned: set[str] = set()

Load = Callable[[Callable[[list[tuple[str, torch.Tensor]]], Any], torch.device], None]
"""Hands the staged version to a `load_weights` (`StagedReceive.load`)."""


def shadow_enabled() -> bool:
    """Off with `CKPT_ENGINE_VLLM_SHADOW=0` (the benchmark's before/after switch)."""
    return os.environ.get("CKPT_ENGINE_VLLM_SHADOW", "1") not in ("0", "off", "false")


def warn_once(key: str, msg: str, *args: Any) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(msg, *args)


class ShadowWeights:
    """A staged version in kernel format: per touched live layer, the tensors and attributes its
    post-processed shadow holds. Built on the staging thread; `swap_in` runs between two steps."""

    def __init__(
        self, layers: list[tuple[torch.nn.Module, torch.nn.Module, dict[str, torch.Tensor]]], before: dict[int, dict[str, Any]],
        build_s: float,
    ) -> None:
        self._layers = layers
        # What post-processing did to each shadow's own attributes (`before`: its __dict__ as built):
        # those set or replaced, and those deleted. Nothing else moves to the live layer.
        self._attrs: dict[int, tuple[dict[str, Any], list[str]]] = {}
        for _, shadow, _ in layers:
            was = before[id(shadow)]
            now = {k: v for k, v in shadow.__dict__.items() if k not in _MODULE_STATE}
            self._attrs[id(shadow)] = ({k: v for k, v in now.items() if was.get(k, _MISSING) is not v}, [k for k in was if k not in now])
        self.build_s = build_s
        # What it holds: the touched layers and their tensors' bytes (on CPU a repacked linear weight is
        # an empty tensor; its packed copy lives in the layer's handle and is not counted).
        self.num_layers = len(layers)
        self.nbytes = sum(t.numel() * t.element_size() for _, _, image in layers for t in image.values())

    def check(self) -> None:
        """Raises unless every shadow tensor can be copied into its live tensor (same shape, dtype,
        device): post-processing that changes a shape needs the live reload."""
        for live, _, image in self._layers:
            live_t = _tensors(live)
            for name, t in image.items():
                lt = live_t.get(name)
                if lt is None or lt.shape != t.shape or lt.dtype != t.dtype or lt.device != t.device:
                    got = None if lt is None else (tuple(lt.shape), lt.dtype)
                    raise ValueError(f"{type(live).__name__}.{name}: post-processed {tuple(t.shape)} {t.dtype} against live {got}")

    @torch.no_grad()
    def swap_in(self) -> float:
        """Copy every post-processed tensor into its live tensor and move the attributes
        post-processing set; returns the seconds. Every rank calls it between two engine steps."""
        t0 = time.perf_counter()
        for live, shadow, image in self._layers:
            live_t = _tensors(live)
            for name, t in image.items():
                live_t[name].copy_(t)
            set_attrs, deleted = self._attrs[id(shadow)]
            live.__dict__.update(_rebind(set_attrs, shadow, live))
            for key in deleted:
                live.__dict__.pop(key, None)
        self._layers, self._attrs = [], {}
        return time.perf_counter() - t0


def _tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {n: p for n, p in module._parameters.items() if p is not None}
    out.update((n, b) for n, b in module._buffers.items() if b is not None)
    return out


def _rebind(attrs: dict[str, Any], old: object, new: object) -> dict[str, Any]:
    """Methods bound to `old` (a weight loader bound to its layer) bound to `new` instead; a loader
    still wrapped by a live layer's layerwise reload (a tensor vLLM never moves to meta, such as
    `bias`, keeps the wrapper after a reload) unwrapped, or the shadow's load would go to the live
    layer's reload state."""
    out = dict(attrs)
    for key, value in attrs.items():
        if key in _LOADER_KEYS:  # vLLM's parameter classes keep it as `_weight_loader`
            while callable(value) and getattr(value, "__name__", "") == "online_process_loader":
                value = value.__wrapped__
        if isinstance(value, MethodType) and value.__self__ is old:
            value = value.__func__.__get__(new)
        out[key] = value
    return out


def _clone(t: torch.Tensor, old: object, new: object) -> torch.Tensor:
    """A tensor of its own with `t`'s values, class and attributes (vLLM's parameter classes carry
    their loaders as attributes)."""
    c = t.data.clone()
    c.__class__ = t.__class__
    c.__dict__ = _rebind(t.__dict__, old, new)
    return c


def _placeholder(t: torch.Tensor, old: object, new: object) -> torch.Tensor:
    """A storage-less stand-in for a live tensor (its class and attributes kept): the shadow's
    reload restores each layer from vLLM's metadata and materializes only the layers it loads."""
    c = torch.empty_strided(tuple(t.size()), tuple(t.stride()), dtype=t.dtype, device="meta")
    c.__class__ = t.__class__
    c.__dict__ = _rebind(t.__dict__, old, new)
    return c


def _image(live: torch.nn.Module, shadow: torch.nn.Module, loaded: set[str]) -> dict[str, torch.Tensor]:
    """The post-processed tensors of a touched shadow layer under the live layer's kernel names: what
    vLLM's reload copies into them (`_copy_and_restore_kernel_tensors`: every parameter; a buffer the
    layer still has, unless non-persistent and not loaded). A missing name raises: the swap reloads."""
    out = {n: getattr(shadow, n) for n, p in live._parameters.items() if p is not None}
    for n, b in live._buffers.items():
        if b is None or n not in shadow._buffers or (n in live._non_persistent_buffers_set and n not in loaded):
            continue
        out[n] = shadow._buffers[n]
    return out


def _meta_copy(t: torch.Tensor, old: object) -> torch.Tensor:
    """A copy of vLLM's reload metadata tensor; `restore_layer_refs` rebinds loaders in place, so the
    shadow must not share the live layer's."""
    from vllm.model_executor.model_loader.reload.sanitize import layer_ref_sentinel

    c = torch.empty_strided(tuple(t.size()), tuple(t.stride()), dtype=t.dtype, device="meta")
    c.__class__ = t.__class__
    c.__dict__ = _rebind(t.__dict__, old, layer_ref_sentinel)
    return c


def _shadow_tree(model: torch.nn.Module) -> tuple[torch.nn.Module, list[tuple[torch.nn.Module, torch.nn.Module]]]:
    """A copy of the module tree sharing no tensor with `model` (a module reached twice, e.g. a tied
    head, is copied once); returns it and the (live, shadow) pairs. Its tensors are placeholders,
    except those vLLM's reload loads in place (`SKIP_TENSORS`, e.g. `bias`) and those of modules it
    skips (`SKIP_MODULES`): those are clones."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    from vllm.model_executor.model_loader.reload.meta import SKIP_MODULES, SKIP_TENSORS
    from vllm.model_executor.model_loader.reload.types import LayerReloadingInfo

    def own(name: str, t: torch.Tensor, m: torch.nn.Module, s: torch.nn.Module) -> torch.Tensor:
        in_place = name in SKIP_TENSORS or type(m).__name__ in SKIP_MODULES
        return _clone(t, m, s) if in_place else _placeholder(t, m, s)

    memo: dict[int, torch.nn.Module] = {}
    pairs: list[tuple[torch.nn.Module, torch.nn.Module]] = []

    def dup(m: torch.nn.Module) -> torch.nn.Module:
        if id(m) in memo:
            return memo[id(m)]
        info = LAYERWISE_INFO.get(m)
        if info is None:
            raise RuntimeError(f"{type(m).__name__} has no reload metadata (record_metadata_for_reloading)")
        s = m.__class__.__new__(m.__class__)
        memo[id(m)] = s
        s.__dict__ = _rebind(m.__dict__, m, s)
        s._parameters = {n: None if p is None else cast(torch.nn.Parameter, own(n, p, m, s)) for n, p in m._parameters.items()}  # own keeps p's class
        s._buffers = {n: None if b is None else own(n, b, m, s) for n, b in m._buffers.items()}
        s._non_persistent_buffers_set = set(m._non_persistent_buffers_set)
        s._modules = {n: None if c is None else dup(c) for n, c in m._modules.items()}
        params, buffers = info.restore_metadata
        LAYERWISE_INFO[s] = LayerReloadingInfo(
            restore_metadata=({n: _meta_copy(t, m) for n, t in params.items()}, {n: _meta_copy(t, m) for n, t in buffers.items()}),
            restore_device=info.restore_device,
        )
        pairs.append((m, s))
        return s

    return dup(model), pairs


def build_shadow(model: torch.nn.Module, vllm_config: Any, load: Load, device: torch.device) -> ShadowWeights:
    """Run vLLM's layerwise reload of the staged version (`load`) on a shadow of `model`; the live
    model is only read. Returns the touched layers' post-processed image (checked copyable)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    t0 = time.perf_counter()
    shadow, pairs = _shadow_tree(model)
    before = {id(s): {k: v for k, v in s.__dict__.items() if k not in _MODULE_STATE} for _, s in pairs}
    with torch.no_grad(), set_current_vllm_config(vllm_config):
        initialize_layerwise_reload(shadow)
        # No kernel tensors: a processed layer keeps the tensors it made (nothing to copy back into).
        # Each layer's list of buffered loads is kept: vLLM resets the layer's state (a new list)
        # once it processed it, so the list says afterwards what the layer loaded.
        loads: dict[int, list[Any]] = {}
        for _, s in pairs:
            info = LAYERWISE_INFO[s]
            info.kernel_tensors = None
            loads[id(s)] = info.loaded_weights
        load(load_weights_of(shadow), device)
        for _, s in pairs:  # untouched: finalize would process it as a first load (garbage); skip it
            info = LAYERWISE_INFO[s]
            if info.can_load() and not loads[id(s)]:
                info.reset()
        # A layer with loads pending (attention, padding) is processed by finalize.
        finalize_layerwise_reload(shadow, vllm_config.model_config)
        touched = [(m, s, _image(m, s, {n for n, _ in loads[id(s)]})) for m, s in pairs if loads[id(s)]]
    image = ShadowWeights(touched, before, time.perf_counter() - t0)
    image.check()
    return image


class ShadowPreparer:
    """What a worker hands a staged receive (`vllm_staging.Prepare`): builds the post-processed image
    once the stream is checked, or returns None (said once) so that the swap reloads as before.

    `room(nbytes, device)` says whether a shadow of `nbytes` (the touched layers materialized and
    post-processed: twice the staged bytes) fits (the worker's `Staging.shadow_room`: counted with the staging copy,
    within the staging limit)."""

    def __init__(
        self, model: Callable[[], torch.nn.Module], vllm_config: Any, device: torch.device,
        room: Callable[[int, torch.device], tuple[bool, str]],
    ) -> None:
        self._model, self._config, self._device, self._room = model, vllm_config, device, room

    def __call__(self, staged: Any) -> ShadowWeights | None:
        if not shadow_enabled():
            return None
        if self._config.quant_config is not None:  # only unquantized post-processing was checked bit for bit
            warn_once("quant", "vLLM swap: a quantized model (%s) is not prepared off the step path; the swap reloads it", type(self._config.quant_config).__name__)
            return None
        model = self._model()
        # The shadow materializes the layers the staged version touches (about the staged bytes), and
        # post-processing makes kernel-format weights of about as many again (on CPU packed outside
        # the parameters): both must fit beside the staging copy. On a GPU whose free memory the KV
        # cache took, they do not, and the swap reloads: the engine's own steps must never meet an
        # allocation the shadow took.
        fits, why = self._room(2 * int(staged.nbytes), self._device)
        if not fits:
            warn_once("room", "vLLM swap: no room to prepare the staged weights off the step path (%s); the swap reloads them", why)
            return None
        try:
            return build_shadow(model, self._config, staged.load, self._device)
        except Exception as exc:  # the staged tensors stay; the swap loads them through the live reload
            warn_once("build", "vLLM swap: preparing the staged weights on a shadow failed (%s: %s); the swap reloads them", type(exc).__name__, exc)
            return None
