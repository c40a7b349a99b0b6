"""SGLang HTTP adapter against `tests/sglang_standin.py` (SGLang's RL weight-update API, CPU/gloo),
synced through the same `WeightSyncSession` / `sync_rollout_weights()` as every other engine.

Contract test: the stand-in follows SGLang 0.5.x request schemas and receive semantics; SGLang itself
cannot be installed on these machines.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
import torch

from ckpt_engine import CheckpointEngineConfig, WeightSyncSession, sync_rollout_weights
from ckpt_engine.rollout_adapters.base import ManifestRejectedError
from ckpt_engine.sources.base import StateDictSource
from helpers_sglang import standin, tiny_model, write_model_dir

pytest.importorskip("transformers")
pytest.importorskip("requests")

PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("qwen2-sglang"))


@pytest.fixture(scope="module")
def servers(model_dir: Path) -> Iterator[list[object]]:
    from ckpt_engine.rollout_adapters.sglang import SglangClient

    with ExitStack() as stack:
        clients = []
        for i in range(2):
            _, url = stack.enter_context(standin(model_dir))
            clients.append(SglangClient(f"sglang-{i}", url, timeout_s=60.0))
            stack.callback(clients[-1].close)
        yield clients


@torch.no_grad()
def greedy(model: torch.nn.Module, n: int = 8) -> list[int]:
    ids, out = torch.tensor([PROMPT]), []
    for _ in range(n):
        nxt = int(model(ids).logits[0, -1].argmax())
        out.append(nxt)
        ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


def generate(client: object) -> tuple[list[int], str]:
    r = client._call("POST", "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0}})  # type: ignore[attr-defined]
    return r["output_ids"], r["meta_info"]["weight_version"]


def engines_of(servers: list[object]) -> list[object]:
    from ckpt_engine.rollout_adapters.sglang import SglangRollout

    return [SglangRollout(c) for c in servers]  # type: ignore[arg-type]


def config(**kw: object) -> CheckpointEngineConfig:
    import ckpt_engine.rollout_adapters.sglang.rollout  # noqa: F401  (registers the `sglang` transport named in engine_kwargs)

    return CheckpointEngineConfig(bucket_size_mb=0.05, timeout_s=60.0, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("flattened", [True, False], ids=["flattened_bucket", "per_tensor"])
def test_sync_matches_trainer_and_changes_on_second_sync(servers: list[object], model_dir: Path, flattened: bool) -> None:
    from ckpt_engine.sync.api import close_sessions

    cfg = config(engine_kwargs={"sglang": {"flattened": flattened}})
    try:
        held = max(int(v) if v.isdigit() else 0 for v in (c.get_weight_version() for c in servers))  # type: ignore[attr-defined]
        t1 = tiny_model(model_dir, seed=1)
        report = sync_rollout_weights(StateDictSource(t1), engines_of(servers), version=held + 5, config=cfg)  # type: ignore[arg-type]
        v1 = str(held + 5)
        assert report is not None and report.version == held + 5 and report.buckets > 1
        assert all(r["flattened"] == float(flattened) for r in report.receivers.values())
        want1 = greedy(t1)
        for c in servers:
            assert generate(c) == (want1, v1)
            assert c.get_weight_version() == v1  # type: ignore[attr-defined]
        t2 = tiny_model(model_dir, seed=2)
        # New handles on the same servers: the cached session is found by engine, not by handle.
        report = sync_rollout_weights(StateDictSource(t2), engines_of(servers), config=cfg)  # type: ignore[arg-type]
        assert report is not None and report.version == held + 6  # default: one past what the servers hold
        want2 = greedy(t2)
        assert want2 != want1
        for c in servers:
            assert generate(c) == (want2, str(held + 6))
    finally:
        close_sessions()


def test_sglang_reads_only_its_own_wire(servers: list[object]) -> None:
    with pytest.raises(ValueError, match=r"read only the 'sglang' wire, not checkpoint_engine.backend='gloo'; leave backend at 'auto'"):
        WeightSyncSession(engines_of(servers), config(backend="gloo"))  # type: ignore[arg-type]


def test_a_new_session_carries_versions_on_and_refuses_empty_or_older(servers: list[object], model_dir: Path) -> None:
    first = WeightSyncSession(engines_of(servers), config())  # type: ignore[arg-type]
    try:
        v = first.sync(StateDictSource(tiny_model(model_dir, seed=4))).version
    finally:
        first.close()
    second = WeightSyncSession(engines_of(servers), config())  # type: ignore[arg-type]
    try:
        before = [generate(c) for c in servers]
        with pytest.raises(ValueError, match=r"weight source \(StateDictSource\) lists no tensors"):
            second.sync(StateDictSource({}))
        with pytest.raises(ValueError, match=rf"version {v - 1} is older than what engines hold .*versions only grow"):
            second.sync(StateDictSource(tiny_model(model_dir, seed=5)), version=v - 1)
        assert [generate(c) for c in servers] == before and second._group.engine is None  # nothing joined, paused or moved
        assert second.sync(StateDictSource(tiny_model(model_dir, seed=5))).version == v + 1
    finally:
        second.close()


@pytest.mark.parametrize(
    "name,shape",
    [("model.layers.0.self_attn.nonexistent.weight", (4, 4)), ("model.layers.1.mlp.down_proj.weight", (64, 127))],
    ids=["unknown-name", "wrong-shape"],
)
def test_bad_manifest_rejected_before_bytes_move(servers: list[object], model_dir: Path, name: str, shape: tuple[int, ...]) -> None:
    before = [generate(c) for c in servers]
    held = [c.get_weight_version() for c in servers]  # type: ignore[attr-defined]
    weights = {n: t.detach() for n, t in tiny_model(model_dir, seed=3).state_dict().items()}
    weights[name] = torch.zeros(shape)
    session = WeightSyncSession(engines_of(servers), config())  # type: ignore[arg-type]
    try:
        with pytest.raises(ManifestRejectedError, match=name.replace(".", r"\.")):
            session.sync(StateDictSource(weights))
        assert session.stale == set()  # refused before the pause: nothing moved, nothing stale
    finally:
        session.close()
    assert [generate(c) for c in servers] == before
    assert [c.get_weight_version() for c in servers] == held  # type: ignore[attr-defined]
