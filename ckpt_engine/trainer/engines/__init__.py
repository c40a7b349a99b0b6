"""The demo trainer's training engines: FSDP2, Megatron, Megatron-FSDP(2) behind one `TrainEngine` (`base.py`).

Each engine trains its sharded model and holds the weight source its syncs read (`engine.source`,
from `ckpt_engine.sources`). The library never imports this package.
"""
