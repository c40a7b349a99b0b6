"""No FP8 sync pays a compile: the sender loads its quantize kernels when it joins the group
(`fp8/warm.py`, from `SyncGroup.build`), once per process, device and dtype.

On the CPU box nothing compiles (the eager recipe quantizes), so this checks the contract the GPU
relies on: with `wire_dtype: fp8` the warm-up runs at the join, before any sync, and never again
in the syncs that follow; without an FP8 wire it does not run. Real session, a reference engine.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import torch

from ckpt_engine import CheckpointEngineConfig, WeightSyncSession
from ckpt_engine.fp8 import fp8_specs, warm
from ckpt_engine.rollout_adapters.torch_ref import TorchRefRollout, write_spec_file
from ckpt_engine.sources.base import StateDictSource
from refengines import spawn_engine

FP8 = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.25, timeout_s=30, wire_dtype="fp8", verify=True)


def _model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"model.layers.0.self_attn.q_proj.weight": (256, 192), "model.layers.0.mlp.down_proj.weight": (192, 300), "model.norm.weight": (192,)}
    return {n: (torch.randn(s, generator=g) * 0.02).bfloat16() for n, s in shapes.items()}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TorchRefRollout]:
    path = tmp_path_factory.mktemp("fp8warm") / "fp8.msgpack"
    write_spec_file(path, fp8_specs(StateDictSource(_model(0)).metadata()))
    e = spawn_engine("fp8-warm", spec_file=str(path), timeout_s=60)
    yield e
    e.close()


def _loads(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == warm.__name__]


@pytest.fixture
def fresh_process(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """This test process as if nothing had quantized yet (the record is process-wide)."""
    monkeypatch.setattr(warm, "_WARMED", set())
    caplog.set_level(logging.INFO, logger=warm.__name__)


def test_an_fp8_sender_loads_its_quantize_kernels_at_the_join_once(engine: TorchRefRollout, fresh_process: None, caplog: pytest.LogCaptureFixture) -> None:
    session = WeightSyncSession([engine], FP8)
    try:
        session.join()
        assert len(_loads(caplog)) == 1, _loads(caplog)
        assert warm.warmed() == {("cpu", d) for d in (torch.bfloat16, torch.float16, torch.float32)}
        for seed in (1, 2):
            session.sync(StateDictSource(_model(seed)))
        assert len(_loads(caplog)) == 1  # the syncs loaded nothing
    finally:
        session.close()
    assert warm.warm_up(torch.device("cpu")) == []  # a later group of this process: already loaded


def test_a_sender_without_an_fp8_wire_loads_no_quantize_kernel(engine: TorchRefRollout, fresh_process: None, caplog: pytest.LogCaptureFixture) -> None:
    session = WeightSyncSession([engine], CheckpointEngineConfig(backend="gloo", timeout_s=30))
    try:
        session.join()
    finally:
        session.close()
    assert _loads(caplog) == [] and warm.warmed() == frozenset()


@pytest.mark.gpu
def test_the_warm_up_runs_both_cuda_kernels_of_every_dtype(fresh_process: None, caplog: pytest.LogCaptureFixture) -> None:
    # On a GPU the warm-up goes through the Triton kernels (the one-weight and the grouped one) of
    # each dtype, once; the bench's first_s row shows that the first sync then pays no compile.
    device = torch.device("cuda", 0)
    assert warm.warm_up(device) == [torch.bfloat16, torch.float16, torch.float32]
    assert warm.warm_up(device) == [] and len(_loads(caplog)) == 1
    from ckpt_engine.fp8.quantize import quantize_block_fp8, quantize_block_fp8_reference

    w = (torch.randn(300, 200, device=device) * 0.02).bfloat16()
    q, s = quantize_block_fp8(w)
    rq, rs = quantize_block_fp8_reference(w.cpu())
    assert torch.equal(q.cpu().view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s.cpu(), rs)
