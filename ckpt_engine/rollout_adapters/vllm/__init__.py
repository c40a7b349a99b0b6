"""vLLM: the handle a trainer holds, `VllmRollout`, over a channel: an in-process `LLM` or a
dev-mode `vllm serve` (`VllmServerRollout`) with the worker extension `WORKER_EXTENSION`, or vLLM's
own weight-transfer API (`WeightTransferChannel`); and the worker side they drive (`worker.py`,
`transfer_engine.py`, `receiver.py`). Importing this package imports no vLLM; docs/vllm.md."""

from ckpt_engine.rollout_adapters.vllm.native import WeightTransferChannel
from ckpt_engine.rollout_adapters.vllm.rollout import WORKER_EXTENSION, VllmRollout
from ckpt_engine.rollout_adapters.vllm.server_rollout import VllmServerRollout

__all__ = ["WORKER_EXTENSION", "VllmRollout", "VllmServerRollout", "WeightTransferChannel"]
