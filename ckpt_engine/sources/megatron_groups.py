"""The process groups a Megatron engine works over (TP, PP, DP, EP, expert-TP, model-parallel).

Its own module so that the engine (`megatron.py`) and the exporter (`megatron_export.py`) both
import it downward, without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

__all__ = ["MegatronGroups"]


@dataclass
class MegatronGroups:
    tp: Any
    pp: Any
    dp: Any
    ep: Any
    etp: Any
    mp: Any  # tensor x pipeline (grad-norm reduction)
    embd: Any = None  # first + last pipeline stage: tied embedding grads are all-reduced over it
    edp: Any = None  # expert data parallel: replicas of the same experts (EP > 1)

    @classmethod
    def from_megatron(cls, pg_collection: Any = None) -> MegatronGroups:
        if pg_collection is not None:
            g = pg_collection
            return cls(
                g.tp, g.pp, getattr(g, "dp", None), getattr(g, "ep", None), getattr(g, "expt_tp", None), getattr(g, "mp", None),
                getattr(g, "embd", None), getattr(g, "expt_dp", None),
            )
        from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            raise RuntimeError("call megatron.core.parallel_state.initialize_model_parallel() first, or pass pg_collection")
        return cls(
            ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_group(),
            ps.get_data_parallel_group(), ps.get_expert_model_parallel_group(),
            ps.get_expert_tensor_parallel_group(), ps.get_model_parallel_group(),
            ps.get_embedding_group(check_initialized=False), ps.get_expert_data_parallel_group(check_initialized=False),
        )

    @staticmethod
    def _size(g: Any) -> int:
        return 1 if g is None else dist.get_world_size(g)

    @staticmethod
    def _rank(g: Any) -> int:
        return 0 if g is None else dist.get_rank(g)

    tp_size = property(lambda self: self._size(self.tp))
    tp_rank = property(lambda self: self._rank(self.tp))
    pp_size = property(lambda self: self._size(self.pp))
    pp_rank = property(lambda self: self._rank(self.pp))
    dp_size = property(lambda self: self._size(self.dp))
    dp_rank = property(lambda self: self._rank(self.dp))
    ep_size = property(lambda self: self._size(self.ep))
    ep_rank = property(lambda self: self._rank(self.ep))
    etp_size = property(lambda self: self._size(self.etp))
    etp_rank = property(lambda self: self._rank(self.etp))
