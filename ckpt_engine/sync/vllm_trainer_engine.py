"""ckpt-engine behind vLLM's trainer-side API: `TrainerWeightTransferEngine` for `backend="ckpt_engine"`.

A trainer written against vLLM's weight-transfer API switches to ckpt-engine by its init info:

    info = CkptEngineTrainerInitInfo(rank=rank, num_workers=1, config=CheckpointEngineConfig(backend="gloo"))
    engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=ModuleSource(model))
    engine.send_weights()            # every trainer rank, after each optimizer step

The sender (rank 0) holds a `WeightSyncSession` over the engine (`VllmRollout` over a
`WeightTransferChannel`: vLLM's own routes or `LLM` methods), so a sync here is the same sync as `sync_rollout_weights()`: versions
carry on from what the engine holds, `config.delta` sends patches, the source's wire dtypes are
cast on the wire, and the `SyncReport` says the same. Other ranks only walk the source, whose
gathers are collectives. The source may be vLLM's `WeightSource` or ckpt-engine's (e.g.
`StateDictSource(model, dtype=torch.bfloat16)`). Importing this module registers the backend with
vLLM's factories.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

import torch
from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine, VLLMWeightSyncClient

from ckpt_engine.config import CheckpointEngineConfig
from ckpt_engine.rollout_adapters.vllm.compat import features_of
from ckpt_engine.rollout_adapters.vllm.native import WeightTransferChannel
from ckpt_engine.rollout_adapters.vllm.rollout import VllmRollout
from ckpt_engine.rollout_adapters.vllm.plugin import BACKEND_NAME, register
from ckpt_engine.sources.base import WeightSource
from ckpt_engine.sources.vllm import VllmWeightSourceAdapter
from ckpt_engine.sync.report import SyncReport
from ckpt_engine.sync.session import WeightSyncSession

__all__ = ["CkptEngineTrainerInitInfo", "CkptEngineTrainerWeightTransferEngine"]

logger = logging.getLogger(__name__)

if not features_of().trainer_transfer_api:  # 0.26's trainer API has other type parameters and signatures
    raise ImportError(
        f"ckpt_engine.sync.vllm_trainer_engine implements vLLM 0.32's trainer-side weight-transfer API; vLLM "
        f"{features_of().version} has another (docs/vllm.md, vLLM versions): sync through VllmRollout(name, WeightTransferChannel(client))"
    )

_FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


@dataclass
class CkptEngineTrainerInitInfo(TrainerInitInfo):
    """Trainer-side settings; the ones the workers must share travel to them at `trainer_init`."""

    backend: ClassVar[str] = BACKEND_NAME

    num_workers: int = 1
    """vLLM worker ranks that receive (tensor x pipeline x data parallel size)."""
    host: str = "127.0.0.1"
    """Address of this trainer that the workers reach to join the weight-sync group."""
    config: CheckpointEngineConfig = field(default_factory=CheckpointEngineConfig)
    """Transport, bucket size, buffers, timeout, verify, pause mode and delta, as for `sync_rollout_weights`."""
    engine_name: str = "vllm"
    """How errors name the engine."""
    stable_tensors: bool = False
    """The source's tensors stay valid and unchanged until `send_weights` returns (e.g. a plain,
    unsharded module's parameters), so the transport may send from them without copying."""
    dtype: str | None = None
    """A vLLM `WeightSource`'s floating-point tensors travel (and load) as this dtype, e.g.
    "bfloat16" for fp32 masters; None: as the source declares. (A ckpt-engine source casts by its
    own metadata, e.g. `StateDictSource(..., dtype=)`.)"""

    def __post_init__(self) -> None:
        if not isinstance(self.num_workers, int) or isinstance(self.num_workers, bool) or self.num_workers < 1:
            raise ValueError(f"num_workers must be an int >= 1, got {self.num_workers!r}")
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"host must be a non-empty address, got {self.host!r}")
        if not isinstance(self.config, CheckpointEngineConfig):
            raise ValueError(f"config must be a CheckpointEngineConfig, got {type(self.config).__name__}")
        if self.dtype is not None and self.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(_FLOAT_DTYPES)} or None, got {self.dtype!r}")


class CkptEngineTrainerWeightTransferEngine(TrainerWeightTransferEngine[CkptEngineTrainerInitInfo]):
    """Trainer side of the `ckpt_engine` backend; `send_weights` is one full sync of its session.

    Order on the sender: validate the manifest (rejected -> ManifestRejectedError, nothing moved,
    engine still serving) -> pause -> stream while the workers load -> finish (layerwise
    post-processing, version stamped) -> prefix-cache reset -> resume. Pause and reset happen when
    `client` is an `EngineControl` (both clients in `vllm/clients.py` are); with a bare vLLM client
    the caller pauses around `send_weights` itself. A failed transfer leaves the engine paused and
    stale; the group is rebuilt on the next call. Staged (`config.stage`, default auto; needs an
    `EngineControl` client): the engine generates while the version streams into its workers'
    staging and pauses only for the swap; a failed transfer leaves it serving its old weights, not
    stale (`vllm/rollout.py`).
    """

    init_info_cls = CkptEngineTrainerInitInfo

    def __init__(
        self,
        *,
        client: VLLMWeightSyncClient,
        source: Any = None,
        is_sender: bool = True,
        init_info: CkptEngineTrainerInitInfo | None = None,
    ) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.info = init_info if init_info is not None else CkptEngineTrainerInitInfo(rank=0 if is_sender else 1)
        self.config = self.info.config
        self.session: WeightSyncSession | None = None
        if self.is_sender:  # other ranks never reach the engine
            channel = WeightTransferChannel(client, num_workers=self.info.num_workers)
            engine = VllmRollout(self.info.engine_name, channel, timeout_s=self.config.timeout_s)
            self.session = WeightSyncSession([engine], self.config, host=self.info.host)

    @classmethod
    def trainer_init(
        cls,
        init_info: CkptEngineTrainerInitInfo,
        *,
        client: VLLMWeightSyncClient,
        source: Any = None,
    ) -> Self:
        """Every trainer rank calls this; the sender joins the workers into its weight-sync group
        (an engine that cannot join fails here at once, by name)."""
        if source is None:
            raise ValueError("the ckpt_engine trainer engine needs a WeightSource to send from")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, init_info=init_info)
        if engine.session is not None:
            engine.session.join()
        return engine

    @property
    def version(self) -> int:
        """The last version this engine's session stamped (0 before the first sync)."""
        return self.session.version if self.session is not None else 0

    def weight_source(self) -> WeightSource:
        """`self.source` as a ckpt-engine source (a vLLM `WeightSource` wrapped, with the init
        info's `stable_tensors` and `dtype`)."""
        if isinstance(self.source, WeightSource):
            return self.source
        if self.source is None:
            raise RuntimeError("no WeightSource: build the engine with trainer_init(..., source=...)")
        dtype = _FLOAT_DTYPES[self.info.dtype] if self.info.dtype is not None else None
        return VllmWeightSourceAdapter(self.source, is_sender=self.is_sender, stable_tensors=self.info.stable_tensors, dtype=dtype)

    def send_weights(self, version: int | None = None) -> SyncReport | None:
        """One sync on every trainer rank; the sender returns its SyncReport, the others None.

        `version` defaults to one past what the engine holds. The source is walked exactly once
        on every rank whatever happens, so ranks whose gathers are collectives stay in step even
        when the sync fails."""
        source = self.weight_source()
        if self.session is None:
            for _ in source.iter_weights():
                pass
            return None
        return self.session.sync(source, version=version)

    def shutdown(self) -> None:
        """Leave the weight-sync group on the workers and here."""
        if self.session is not None:
            self.session.close()


register()
