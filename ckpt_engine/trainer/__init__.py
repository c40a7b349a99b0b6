"""The fully-async trainer skeleton: config, synthetic task, rollout workers, trainer loop, demo.

Registers the `tiny` TrainEngine (ckpt_engine.trainer.task:TinyTrainEngine) so `trainer.backend`
selects it like any other backend.
"""

from ckpt_engine.trainer.engines.base import TrainEngineRegistry

TrainEngineRegistry.register("tiny", "ckpt_engine.trainer.task:TinyTrainEngine")
