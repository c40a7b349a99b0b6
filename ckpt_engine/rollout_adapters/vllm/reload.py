"""vLLM's layerwise reload as one bracket: opened before a version's first bucket loads, closed
(vLLM's post-processing) once its last one did, and never left open after a failed load.

It works after vLLM has post-processed (e.g. repacked on CPU) its weights: `initialize_layerwise_reload`
-> `model.load_weights` per bucket -> `finalize_layerwise_reload`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

__all__ = ["LayerwiseReload", "detach_pending"]


class LayerwiseReload:
    """The open/closed state of one worker's layerwise reload. `model` is called each time (the
    native backend may retarget its model)."""

    def __init__(self, model: Callable[[], torch.nn.Module], vllm_config: Any) -> None:
        self._model = model
        self.vllm_config = vllm_config
        self.is_open = False

    def open(self) -> None:
        """Start a reload of the model's layers (closing one still open first)."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self.close()
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
        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            finalize_layerwise_reload(self._model(), self.vllm_config.model_config)
        return time.perf_counter() - t0


def detach_pending(pairs: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Clone the bucket tensors vLLM's layerwise reload still holds for incomplete layers.

    Those references would otherwise read the next bucket's bytes once the buffer is refilled.
    Returns the bytes cloned (zero when every layer completed inside its bucket).
    """
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    # Views of the rotating buffer share a storage larger than themselves; a reassembled chunked
    # tensor owns its storage and stays valid, so it is not cloned.
    ptrs = {t.untyped_storage().data_ptr() for _, t in pairs if t.untyped_storage().nbytes() != t.nbytes}
    cloned = 0
    for info in list(LAYERWISE_INFO.values()):
        for _, bound in info.loaded_weights:
            for key, value in bound.arguments.items():
                if key == "param" or not isinstance(value, torch.Tensor):
                    continue
                if value.untyped_storage().data_ptr() in ptrs:
                    bound.arguments[key] = value.clone()
                    cloned += value.numel() * value.element_size()
    return cloned
