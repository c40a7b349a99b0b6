"""vLLM general plugin: registers the `ckpt_engine` weight-transfer backend in every vLLM process.

Installed as the `vllm.general_plugins` entry point `ckpt_engine` (see pyproject.toml), so
`--weight-transfer-config '{"backend": "ckpt_engine"}'` works with no user code. Registration is by
module path: nothing of ckpt-engine's transfer code is imported until vLLM creates the engine.
vLLM may call this several times per process; only the first registers. It also gives every engine
core made in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) its step lock as it is made
(`steps_locked_from_the_start`). The trainer side follows
0.32's trainer API; on a vLLM whose API has another shape (0.26, `vllm/compat.py`) it is not
registered, and trainers there sync through `VllmRollout(name, WeightTransferChannel(client))`.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["BACKEND_NAME", "register", "steps_locked_from_the_start"]

BACKEND_NAME = "ckpt_engine"
"""The name in `--weight-transfer-config '{"backend": "ckpt_engine"}'` and in both vLLM factories."""

_WORKER = ("ckpt_engine.rollout_adapters.vllm.transfer_engine", "CkptEngineWeightTransferEngine")
_TRAINER = ("ckpt_engine.sync.vllm_trainer_engine", "CkptEngineTrainerWeightTransferEngine")

logger = logging.getLogger(__name__)
_steps_locked = False


def register() -> None:
    """Register the worker and trainer sides under the name `ckpt_engine` (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    from ckpt_engine.rollout_adapters.vllm.compat import features_of

    steps_locked_from_the_start()
    if BACKEND_NAME not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND_NAME, *_WORKER)
    if BACKEND_NAME in WeightTransferTrainerFactory._registry:
        return
    features = features_of()
    if features.trainer_transfer_api:
        WeightTransferTrainerFactory.register_engine(BACKEND_NAME, *_TRAINER)
    else:
        logger.info(
            "ckpt_engine: vLLM %s's trainer-side weight-transfer API is not the one ckpt-engine's trainer engine "
            "implements (0.32's): only the worker side is registered; sync through VllmRollout(name, "
            "WeightTransferChannel(client))", features.version,
        )


def steps_locked_from_the_start() -> None:
    """Every engine core vLLM's `InprocClient` makes from now on holds its step lock at each step
    (`vllm/engine_core.py`'s `step_lock`) from its first, not from its first handle's: a handle made
    while another thread's `generate` was inside a step then let a sync's pause through before that
    step ended, and the copies after it could land between two of its layers (once per process)."""
    global _steps_locked
    if _steps_locked:
        return
    from vllm.v1.engine.core_client import InprocClient

    made = InprocClient.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        made(self, *args, **kwargs)
        from ckpt_engine.rollout_adapters.vllm.engine_core import step_lock

        step_lock(self.engine_core)

    InprocClient.__init__ = __init__
    _steps_locked = True
