"""vLLM's layerwise reload as one bracket: opened before a version's first bucket loads, closed
(vLLM's post-processing) once its last one did, and never left open after a failed load.

It works after vLLM has post-processed (e.g. repacked on CPU) its weights: `initialize_layerwise_reload`
-> `model.load_weights` per bucket -> `finalize_layerwise_reload`.

Where no layer post-processes its weights (an unquantized dense model on CUDA: vLLM's unquantized
linear and embedding methods do nothing after loading there), the bracket is not needed: the
model's loaders write the live parameters in their final layout, as vLLM's first load did. Layerwise
reload would re-materialize every layer, load into it, and copy it back into the live storage (two
device copies and per-layer bookkeeping per sync); those models load straight into the live
parameters instead (`loads_in_place`), and so do unquantized MoE models on the Triton expert
kernels. Every other model (quantized, FlashInfer experts, any model on CPU) keeps the bracket.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

__all__ = ["LayerwiseReload", "detach_pending", "loads_in_place"]

logger = logging.getLogger(__name__)


class LayerwiseReload:
    """The open/closed state of one worker's layerwise reload. `model` is called each time (the
    native backend may retarget its model)."""

    def __init__(self, model: Callable[[], torch.nn.Module], vllm_config: Any) -> None:
        self._model = model
        self.vllm_config = vllm_config
        self.is_open = False
        self._in_place: tuple[int, bool] | None = None  # (id(model), whether it loads in place)
        self._open_in_place = False

    def in_place(self) -> bool:
        """Whether the current model loads straight into its live parameters (no bracket), decided
        once per model and said once."""
        model = self._model()
        if self._in_place is None or self._in_place[0] != id(model):
            why = loads_in_place(model)
            self._in_place = (id(model), why is None)
            logger.info("vLLM weight loads: %s", "straight into the live parameters (no layer post-processes its weights)" if why is None else f"through layerwise reload ({why})")
        return self._in_place[1]

    def open(self) -> None:
        """Start a reload of the model's layers (closing one still open first)."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self.close()
        self._open_in_place = self.in_place()
        if not self._open_in_place:
            with set_current_vllm_config(self.vllm_config):
                initialize_layerwise_reload(self._model())
        self.is_open = True

    @contextlib.contextmanager
    def loading(self) -> Iterator[None]:
        """The context vLLM's loaders run in."""
        from vllm.config import set_current_vllm_config

        with torch.no_grad(), set_current_vllm_config(self.vllm_config):
            yield

    def close(self) -> float:
        """Finish the reload if one is open (vLLM's post-processing); returns its seconds."""
        if not self.is_open:
            return 0.0
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        t0 = time.perf_counter()
        self.is_open = False
        if self._open_in_place:
            return 0.0
        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            finalize_layerwise_reload(self._model(), self.vllm_config.model_config)
        return time.perf_counter() - t0


def loads_in_place(model: torch.nn.Module) -> str | None:
    """None when no layer of `model` post-processes its weights after loading, so its loaders
    write the final layout into the live parameters; else the first layer that does, and why.

    Only vLLM's unquantized linear and embedding methods on CUDA qualify (their
    `process_weights_after_loading` does nothing there; on CPU they repack), and its unquantized
    routed experts on the Triton kernels (their post-processing is a `.contiguous()` of the
    stacked weights copied onto themselves; the FlashInfer kernels swap or re-block them). Any
    other quant method (FP8, ...) is assumed to transform what its loaders wrote.

    Routed experts matter most here: under layerwise reload a Qwen3-30B-A3B sync into vLLM 0.26
    ran the engine out of memory (~60 GB held beyond the model and KV cache; 2xH200), and vLLM's
    own packed path took 4 s there against 0.17 s for the raw bytes."""
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        return f"vLLM on {current_platform.device_type} post-processes unquantized weights"
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    triton = (UnquantizedMoeBackend.TRITON, UnquantizedMoeBackend.BATCHED_TRITON)
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)  # vLLM's layers may have none (norms, attention): they load as they are
        if method is None or type(method) in (UnquantizedLinearMethod, UnquantizedEmbeddingMethod):
            continue
        if type(method) is UnquantizedFusedMoEMethod:
            if method.unquantized_backend in triton:
                continue
            return f"{name} post-processes its weights ({type(method).__name__} on {method.unquantized_backend.value})"
        return f"{name} post-processes its weights ({type(method).__name__})"
    return None


def detach_pending(pairs: Iterable[tuple[str, torch.Tensor]], scanned: dict[int, tuple[list[Any], int]] | None = None) -> int:
    """Copy out the bucket tensors vLLM's layerwise reload still holds for incomplete layers.

    Those references would otherwise read the next bucket's bytes once the buffer is refilled.
    Returns the bytes copied (zero when every layer completed inside its bucket).

    `scanned` (one dict per reload, kept by the caller across its buckets): how far each layer's
    held loads were already looked at. A load held since an earlier bucket was copied out then (or
    owns its storage), so only the loads a layer took since are looked at: a layer that stays
    incomplete over many buckets (a fused-expert layer) is not walked again per bucket.
    """
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    # Views of the rotating buffer share a storage larger than themselves; a reassembled chunked
    # tensor owns its storage and stays valid, so it is not copied.
    ptrs = set()
    for _, t in pairs:
        storage = t.untyped_storage()
        if storage.nbytes() != t.nbytes:
            ptrs.add(storage.data_ptr())
    if not ptrs:
        return 0
    held: dict[int, list[tuple[dict[str, Any], str, torch.Tensor]]] = {}
    for info in list(LAYERWISE_INFO.values()):
        loads = info.loaded_weights
        if not loads:
            continue
        start = 0
        if scanned is not None:
            # `reset()` gives a processed layer a new list: a list seen before keeps its prefix.
            last = scanned.get(id(info))
            start = last[1] if last is not None and last[0] is loads else 0
            scanned[id(info)] = (loads, len(loads))
        for _, bound in loads[start:]:
            for key, value in bound.arguments.items():
                if key != "param" and isinstance(value, torch.Tensor) and (ptr := value.untyped_storage().data_ptr()) in ptrs:
                    held.setdefault(ptr, []).append((bound.arguments, key, value))
    return sum(_copy_out(views) for views in held.values())


def _copy_out(views: list[tuple[dict[str, Any], str, torch.Tensor]]) -> int:
    """Rebind held views of one buffer to a copy: one copy of the span they cover (a fused-expert
    layer held over a bucket boundary is hundreds of adjacent tensors: one allocation and one copy,
    not one each), or one clone each where the span is mostly bytes nobody holds."""
    spans = [(v.storage_offset() * v.element_size(), _extent(v) * v.element_size()) for _, _, v in views]
    lo = min(start for start, _ in spans) // 16 * 16
    hi = max(start + size for start, size in spans)
    if len(views) == 1 or hi - lo > 2 * sum(size for _, size in spans) + 4096:
        for args, key, value in views:
            args[key] = value.clone()
        return sum(v.numel() * v.element_size() for _, _, v in views)
    first = views[0][2]
    source = torch.empty(0, dtype=torch.uint8, device=first.device).set_(first.untyped_storage(), lo, (hi - lo,), (1,))
    copy = torch.empty(-(-(hi - lo) // 16) * 16, dtype=torch.uint8, device=first.device)
    copy[: hi - lo].copy_(source)
    for (args, key, value), (start, _) in zip(views, spans):
        args[key] = copy.view(value.dtype).as_strided(value.size(), value.stride(), (start - lo) // value.element_size())
    return int(hi - lo)


def _extent(t: torch.Tensor) -> int:
    """Elements from a view's first to one past its last (its footprint in its storage)."""
    if t.numel() == 0:
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
