"""vLLM general plugin: registers the `ckpt_engine` weight-transfer backend in every vLLM process.

Installed as the `vllm.general_plugins` entry point `ckpt_engine` (see pyproject.toml), so
`--weight-transfer-config '{"backend": "ckpt_engine"}'` works with no user code. Registration is by
module path: nothing of ckpt-engine's transfer code is imported until vLLM creates the engine.
vLLM may call this several times per process; only the first registers.
"""

from __future__ import annotations

__all__ = ["BACKEND_NAME", "register"]

BACKEND_NAME = "ckpt_engine"
"""The name in `--weight-transfer-config '{"backend": "ckpt_engine"}'` and in both vLLM factories."""

_WORKER = ("ckpt_engine.rollout_adapters.vllm.transfer_engine", "CkptEngineWeightTransferEngine")
_TRAINER = ("ckpt_engine.sync.vllm_trainer_engine", "CkptEngineTrainerWeightTransferEngine")


def register() -> None:
    """Register the worker and trainer sides under the name `ckpt_engine` (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    if BACKEND_NAME not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND_NAME, *_WORKER)
    if BACKEND_NAME not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND_NAME, *_TRAINER)
