"""The sender's device comes from its weight source's tensors or the configuration, never from the
process's current CUDA device by accident (a trainer on cuda:1 with cuda:0 current joined NCCL
from the engine's GPU). The device objects are plain values here; tests/test_vllm_cuda.py runs the
same into a real CUDA vLLM engine."""

from __future__ import annotations

import pytest
import torch

from ckpt_engine import CheckpointEngineConfig
from ckpt_engine.sources.base import StateDictSource, tensors_device
from ckpt_engine.sync.group import SyncGroup

pytestmark = pytest.mark.fast


def group(backend: str, device: str | None = None, **kwargs: object) -> SyncGroup:
    config = CheckpointEngineConfig(backend=backend, **kwargs)  # type: ignore[arg-type]
    return SyncGroup(config, backend, "127.0.0.1", device, None)


def test_the_sender_takes_its_sources_device() -> None:
    g = group("nccl")
    g.take_device(torch.device("cuda", 1))
    assert g.device == torch.device("cuda", 1)
    c = group("colocated")
    c.take_device(torch.device("cuda", 0))
    assert c.device == torch.device("cuda", 0)


def test_host_tensors_and_host_transports_change_nothing() -> None:
    g = group("nccl")
    g.take_device(torch.device("cpu"))
    g.take_device(None)
    assert g.device is None
    h = group("gloo")
    h.take_device(torch.device("cuda", 1))  # gloo reads device tensors through the host
    assert h.device is None


@pytest.mark.parametrize("where", ["config", "session"])
def test_a_named_device_other_than_the_tensors_is_refused_by_name(where: str) -> None:
    if where == "config":
        g = group("nccl", engine_kwargs={"nccl": {"device": "cuda:0"}})
    else:
        g = group("nccl", device="cuda:0")
    with pytest.raises(ValueError, match=r"on cuda:1 but the nccl sender is set to cuda:0 .*engine_kwargs\.nccl\.device"):
        g.take_device(torch.device("cuda", 1))
    ok = group("nccl", engine_kwargs={"nccl": {"device": "cuda:1"}})
    ok.take_device(torch.device("cuda", 1))  # the same device: no refusal


def test_a_sources_device_is_read_off_its_tensors() -> None:
    meta = torch.empty(2, device="meta")
    assert StateDictSource({"a": torch.zeros(2), "b": torch.zeros(3)}).device == torch.device("cpu")
    assert tensors_device([torch.zeros(2), meta]) == torch.device("meta")  # host tensors beside one device
    assert tensors_device([]) is None
