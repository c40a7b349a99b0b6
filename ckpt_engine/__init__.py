"""ckpt-engine: weight synchronization for fully-asynchronous RL.

Public API only; heavy and optional modules (vLLM, SGLang, Megatron, torch_npu) load on first use.
"""

from ckpt_engine.config import CheckpointEngineConfig, ConfigError, load_config
from ckpt_engine.registry import CheckpointEngineRegistry

__all__ = [
    "CheckpointEngineConfig",
    "CheckpointEngineRegistry",
    "ConfigError",
    "ManifestRejectedError",
    "SyncError",
    "SyncReport",
    "WeightSyncSession",
    "load_config",
    "sync_rollout_weights",
]

__version__ = "0.1.0"


def __getattr__(name: str):  # lazy: importing the package must not import torch.distributed users
    if name in ("sync_rollout_weights", "SyncReport", "SyncError", "WeightSyncSession"):
        from ckpt_engine.sync import api as sync

        return getattr(sync, name)
    if name == "ManifestRejectedError":  # an engine refused the plan: nothing moved
        from ckpt_engine.rollout_adapters.base import ManifestRejectedError

        return ManifestRejectedError
    raise AttributeError(f"module 'ckpt_engine' has no attribute {name!r}")
