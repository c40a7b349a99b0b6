"""The reference receiver: `TorchRefRollout`, a plain torch state dict (or HF model) in its own
process (`serve.py`, `worker.py`), for full-weight syncs, and `LoraRefRollout` for adapter-only
ones. For tests, benchmarks and users without an inference engine; docs/library.md."""

from ckpt_engine.rollout_adapters.torch_ref.lora import LoraRefRollout
from ckpt_engine.rollout_adapters.torch_ref.models import load_spec_file, write_spec_file
from ckpt_engine.rollout_adapters.torch_ref.rollout import TorchRefRollout

__all__ = ["LoraRefRollout", "TorchRefRollout", "load_spec_file", "write_spec_file"]
