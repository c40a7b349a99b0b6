"""Megatron as a multi-sender weight source: each pipeline stage / expert-parallel rank sends its own.

One spawn of 2 real megatron-core trainer processes (gloo, CPU) runs a tiny Qwen3-MoE as PP=2 (two
stage senders), EP=2 (two expert senders), TP=2 with expert TP 2 (refused), then PP=2 through
`sync_rollout_weights(senders="per_stage")` into a reference engine process. (TP=2 x PP=2, with TP
helpers: tests/test_megatron_tp_senders.py.) Every receiver (a thread of this process in a group of
2 senders + 1 receiver, or the reference engine) must hold, bit for bit, what the single-sender
`iter_weights()` export yields on trainer rank 0 (bf16 wire, fp32 router). A counter
(tests/test_fsdp2_shards.py's) shows producing the pieces and sending issue no collective, and
that it does see `iter_weights()`'s PP broadcasts / EP all-gathers.
"""


from __future__ import annotations

import datetime
import threading
import uuid
from itertools import chain
from typing import Any

import pytest
import torch

from tests._trainer_mp import run_ranks
from ckpt_engine.store import serve_store

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install megatron-core==0.16.1)")
pytestmark = pytest.mark.timeout(240)

LAYOUTS = {"pp2": (2, 1), "ep2": (1, 2)}  # (pipeline, expert) parallel sizes; both 2 senders
BUCKET = 16 * 1024  # bytes: every sender fills several buckets


def _trained_state() -> tuple[Any, dict[str, torch.Tensor]]:
    from ckpt_engine.trainer.engines.common import hf_model_from_config
    from tests.test_trainer_megatron_ep import hf_checkpoint_state, moe_config

    cfg = moe_config()
    torch.manual_seed(0)
    hf = hf_model_from_config(cfg, torch.float32)
    with torch.no_grad():  # distinct experts and norms, so a swapped tensor would show
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
            elif "experts" in n:
                p.normal_(0, 0.02)
    return cfg, hf_checkpoint_state(hf, cfg.model_type)


def _bad_requests(engine: Any) -> list[str]:
    """Asking for a tensor another sender owns, or one the model lacks, fails by name."""
    errors = []
    foreign = next(n for n, shards in engine.source.owners().items() if shards[0].sender != engine.source.sender_index)
    for name in (foreign, "nope"):
        try:
            engine.source.local_piece(name)
            errors.append(f"local_piece({name!r}) did not raise")
        except ValueError as exc:
            errors.append(str(exc))
    return errors


def _sharded_run(rank: int, layout: str, rdzv: Any, cfg: Any, sd: dict[str, torch.Tensor]) -> dict[str, Any]:
    from megatron.core import parallel_state as ps

    from ckpt_engine.manifest import encode_manifest
    from ckpt_engine.registry import CheckpointEngineRegistry
    from ckpt_engine.sources.sharded import ShardedWeightSource, iter_pieces
    from ckpt_engine.trainer.engines.megatron import MegatronConfig, MegatronTrainEngine
    from tests.test_fsdp2_shards import GatherCounter

    pp, ep = LAYOUTS[layout]
    ps.initialize_model_parallel(pipeline_model_parallel_size=pp, expert_model_parallel_size=ep)
    engine = MegatronTrainEngine(cfg, config=MegatronConfig(wire_dtype="bfloat16", moe_token_dispatcher_type="allgather"))
    engine.load_hf_weights(sd)
    group = engine.groups.pp if pp > 1 else engine.groups.ep  # the group a cross-stage / cross-EP export uses
    out: dict[str, Any] = {"is_source": isinstance(engine.source, ShardedWeightSource)}
    out["sender"] = [engine.source.sender_index, engine.source.num_senders, engine.groups.pp_rank, engine.groups.ep_rank]
    sync = CheckpointEngineRegistry.new("gloo", bucket_size_bytes=BUCKET, timeout_s=60)
    with GatherCounter(group) as planning:  # ownership, the plan and every piece: all local
        owners = engine.source.owners()
        manifest = sync.plan(engine.source.metadata(), num_senders=engine.source.num_senders, owners=owners)
        produced = {n: t.clone() for n, t in iter_pieces(engine.source, manifest)}
    with GatherCounter(group) as gathering:  # the single-sender export of the same model
        expected = {n: t.clone() for n, t in engine.source.iter_weights()}
    out["bad_requests"] = _bad_requests(engine)
    if rank == 0:
        rdzv.connect_store().set(f"manifest/{layout}", encode_manifest(manifest))
    sync.init_process_group(rdzv, engine.source.sender_index)
    with GatherCounter(group) as sending:
        stats = sync.send_weights(manifest, iter_pieces(engine.source, manifest), stable=engine.source.stable_pieces)
    sync.finalize()
    out["counts"] = {"pieces": planning.summary(), "iter_weights": gathering.summary(), "send": sending.summary()}
    out["sent_bytes"], out["bytes_per_sender"] = stats.bytes, manifest.bytes_per_sender()
    out["owners"] = {n: [[s.sender, s.start, s.stop] for s in shards] for n, shards in owners.items()}
    out["specs"] = {s.name: [s.dtype, list(s.shape)] for s in engine.source.metadata()}
    out["produced"] = sorted(produced)
    out["pieces_match_export"] = [n for n, t in produced.items() if rank == 0 and not torch.equal(t, expected[n])]
    if rank == 0:
        out["tensors"] = {f"{layout}/{n}": t for n, t in expected.items()}
    ps.destroy_model_parallel()
    return out


def _refused_expert_tp(cfg: Any, sd: dict[str, torch.Tensor]) -> dict[str, Any]:
    """TP=2 with Megatron's default expert TP (= TP): no multi-sender (one sender, the
    single-sender path), and a clear error if asked."""
    from megatron.core import parallel_state as ps

    from ckpt_engine.trainer.engines.megatron import MegatronConfig, MegatronTrainEngine

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    engine = MegatronTrainEngine(cfg, config=MegatronConfig(moe_token_dispatcher_type="allgather"))
    out: dict[str, Any] = {"num_senders": engine.source.num_senders, "errors": []}
    for call in (engine.source.owners, lambda: engine.source.local_piece("model.norm.weight")):
        try:
            call()
        except ValueError as exc:
            out["errors"].append(str(exc))
    ps.destroy_model_parallel()
    return out


def _synced_through_the_session(rank: int, cfg: Any, sd: dict[str, torch.Tensor], info: dict[str, Any]) -> dict[str, Any]:
    """PP=2 through `sync_rollout_weights(senders="per_stage")` into a reference engine process:
    rank 0 controls, rank 1 follows its announcements and sends its own stage."""
    from megatron.core import parallel_state as ps

    from ckpt_engine import CheckpointEngineConfig, sync_rollout_weights
    from ckpt_engine.rollout_adapters.torch_ref import TorchRefRollout
    from ckpt_engine.sync.api import close_sessions
    from ckpt_engine.trainer.engines.megatron import MegatronConfig, MegatronTrainEngine

    ps.initialize_model_parallel(pipeline_model_parallel_size=2)
    engine = MegatronTrainEngine(cfg, config=MegatronConfig(wire_dtype="bfloat16", moe_token_dispatcher_type="allgather"))
    engine.load_hf_weights(sd)
    handles = [TorchRefRollout(info["name"], info["host"], info["port"], None, 60, token=info["token"])] if rank == 0 else None
    config = CheckpointEngineConfig(backend="gloo", bucket_size_mb=BUCKET / 2**20, timeout_s=60, senders="per_stage")
    reports = [sync_rollout_weights(engine.source, handles, config=config)]
    with torch.no_grad():  # a stand-in for an optimizer step (megatron's forward needs CUDA): every parameter moves
        for i, p in enumerate(engine.model.parameters()):
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * rank + i)) * 0.01)
    reports.append(sync_rollout_weights(engine.source, handles, config=config))  # the cached plan, the followers' group reused
    exported = {f"sync/{n}": t.clone() for n, t in engine.source.iter_weights()}
    summary = [None if r is None else {"senders": r.senders, "tensors": r.tensors, "version": r.version} for r in reports]
    out: dict[str, Any] = {"reports": summary}
    if rank == 0:
        out["tensors"] = exported
    close_sessions()
    ps.destroy_model_parallel()
    return out


def _worker(rank: int, world_size: int, rdzvs: dict[str, dict[str, Any]], engine_info: dict[str, Any]) -> dict[str, Any]:
    from ckpt_engine.engine import Rendezvous

    cfg, sd = _trained_state()
    result: dict[str, Any] = {"tensors": {}}
    for layout in LAYOUTS:
        part = _sharded_run(rank, layout, Rendezvous.from_dict(rdzvs[layout]), cfg, sd)
        result["tensors"].update(part.pop("tensors", {}))
        result[layout] = part
    result["etp2"] = _refused_expert_tp(cfg, sd)
    result["sync"] = _synced_through_the_session(rank, cfg, sd, engine_info)
    result["tensors"].update(result["sync"].pop("tensors", {}))
    return result


def _receive(rdzvs: dict[str, Any], got: dict[str, torch.Tensor], errors: list[str], wait_s: float) -> None:
    """The receiver (weight-sync rank 2): one sync per layout, from both senders. It waits for each
    manifest as long as the trainer ranks may run (`wait_s`): on a loaded 2-core box, starting
    Megatron in four processes took longer than the group's own 60 s timeout."""
    from ckpt_engine.manifest import decode_manifest
    from ckpt_engine.registry import CheckpointEngineRegistry

    try:
        for layout, rdzv in rdzvs.items():
            store = rdzv.connect_store()
            store.wait([f"manifest/{layout}"], datetime.timedelta(seconds=wait_s))
            manifest = decode_manifest(store.get(f"manifest/{layout}"))
            sync = CheckpointEngineRegistry.new("gloo", bucket_size_bytes=BUCKET, timeout_s=60)
            sync.init_process_group(rdzv, rdzv.num_senders)
            try:
                got.update({f"{layout}/{n}": t.clone() for n, t in chain.from_iterable(sync.receive_buckets(manifest))})
            finally:
                sync.finalize()
    except Exception as exc:  # reported by the fixture
        errors.append(f"receiver: {type(exc).__name__}: {exc}")


def _run_into_reference(
    tmp_path_factory: pytest.TempPathFactory, worker: Any, world: int, receive: dict[str, Any], name: str, timeout_s: float, **kwargs: Any
) -> tuple[list[dict[str, Any]], dict[str, torch.Tensor]]:
    """Spawn `world` trainer processes running `worker` (with `kwargs`) while a receiver thread of
    this process takes the groups of `receive` (rendezvous by name) and a reference engine process (named `name`) waits for
    `sync_rollout_weights`; returns the ranks' results and every tensor received (the reference
    engine's under "ref/")."""
    from ckpt_engine.manifest import TensorSpec
    from ckpt_engine.rollout_adapters.torch_ref import TorchRefRollout, write_spec_file
    from ckpt_engine.sources.wire import WirePolicy
    from ckpt_engine.trainer.engines.megatron import MegatronConfig

    got: dict[str, torch.Tensor] = {}
    errors: list[str] = []
    receiver = threading.Thread(target=_receive, args=(receive, got, errors, timeout_s), daemon=True)
    receiver.start()
    _cfg, sd = _trained_state()
    policy = WirePolicy("bfloat16", MegatronConfig().keep_fp32_patterns)  # the specs the trainer will announce
    spec = tmp_path_factory.mktemp("spec") / "spec.msgpack"
    write_spec_file(spec, [TensorSpec(n, str(policy.dtype_for(n, t.dtype)).removeprefix("torch."), tuple(t.shape)) for n, t in sd.items()])
    ref = TorchRefRollout.spawn(name, spec_file=str(spec), timeout_s=60)
    info = {"name": ref.name, "host": ref.rpc.host, "port": ref.rpc.port, "token": ref.token}
    preload = ("megatron.core", "transformers.models.qwen3_moe.modeling_qwen3_moe", "ckpt_engine.trainer.engines.megatron")
    try:
        results = run_ranks(worker, world, timeout_s=timeout_s, preload=preload, engine_info=info, **kwargs)
        receiver.join(timeout=60)
        assert not receiver.is_alive(), "the receiver did not finish within 60 s of the senders"
        assert not errors, errors
        got.update({f"ref/{n}": ref.get_tensor(n) for n in sd})
    finally:
        ref.close()
    return results, got


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], dict[str, torch.Tensor]]:
    from ckpt_engine.engine import Rendezvous

    store = serve_store("127.0.0.1", 120)
    rdzvs = {layout: Rendezvous("127.0.0.1", store.port, uuid.uuid4().hex, 3, "gloo", 60.0, 2) for layout in LAYOUTS}
    results, got = _run_into_reference(
        tmp_path_factory, _worker, 2, rdzvs, "megatron-ref", 180, rdzvs={k: v.to_dict() for k, v in rdzvs.items()}
    )
    del store
    return results, got


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_receiver_is_bit_exact_with_the_single_sender_export(runs: Any, layout: str) -> None:
    """Both senders send only their own tensors; the receiver holds exactly what iter_weights()
    exports, every tensor, in the wire dtypes (bf16, fp32 router)."""
    ranks, got = runs
    r0, r1 = ranks[0][layout], ranks[1][layout]
    assert r0["is_source"] and r1["is_source"]
    assert r0["specs"] == r1["specs"] and r0["owners"] == r1["owners"]  # every rank planned alike, locally
    assert not r0["pieces_match_export"]  # rank 0's pieces equal its own single-sender export
    specs = r0["specs"]
    assert sorted(n.removeprefix(f"{layout}/") for n in got if n.startswith(f"{layout}/")) == sorted(specs)
    for name, (dtype, shape) in specs.items():
        rec, exp = got[f"{layout}/{name}"], ranks[0]["tensors"][f"{layout}/{name}"]
        assert str(rec.dtype) == f"torch.{dtype}" and list(rec.shape) == shape, name
        assert torch.equal(_bits(rec), _bits(exp)), f"{layout}: {name} differs from the single-sender export"
    assert specs["model.layers.1.mlp.gate.weight"][0] == "float32" and specs["model.embed_tokens.weight"][0] == "bfloat16"
    assert sorted(r0["produced"] + r1["produced"]) == sorted(specs)  # each tensor sent once, by its owner


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_no_cross_stage_or_expert_collective_for_the_pieces(runs: Any, layout: str) -> None:
    """Ownership, planning and every piece issue no collective at all; a whole send no all-gather.
    The same counter sees the PP broadcasts / EP all-gathers of iter_weights(), so it works."""
    ranks, _ = runs
    for r in range(2):
        counts = ranks[r][layout]["counts"]
        assert counts["pieces"] == {"on_group": 0, "calls": 0, "dispatched": 0, "collectives": 0}, (r, counts)
        sending = counts["send"]  # (the weight-sync group's own gloo broadcasts bypass the dispatcher)
        assert (sending["on_group"], sending["calls"], sending["dispatched"]) == (0, 0, 0), (r, sending)
        export = counts["iter_weights"]
        assert export["collectives"] > 0, (r, export)
        if layout == "ep2":
            assert export["on_group"] > 0 and export["dispatched"] > 0, (r, export)


def test_senders_own_their_stage_and_their_experts(runs: Any) -> None:
    """PP=2: stage s's sender owns its layers (and embeddings / final norm / head) whole; EP=2:
    expert e goes to the EP rank holding it, the dense tensors are split so the bytes balance."""
    ranks, _ = runs
    pp = ranks[0]["pp2"]
    assert [ranks[r]["pp2"]["sender"] for r in range(2)] == [[0, 2, 0, 0], [1, 2, 1, 0]]
    for name, shards in pp["owners"].items():
        stage = 0 if name.startswith(("model.embed_tokens", "model.layers.0.")) else 1
        assert [s[0] for s in shards] == [stage] and shards[0][1] == 0, name
    ep = ranks[0]["ep2"]
    assert [ranks[r]["ep2"]["sender"] for r in range(2)] == [[0, 2, 0, 0], [1, 2, 0, 1]]
    for name, shards in ep["owners"].items():
        if ".mlp.experts." in name:
            assert shards[0][0] == int(name.split(".mlp.experts.")[1].split(".")[0]) // 2, name
    for layout in LAYOUTS:
        sent = [ranks[r][layout]["sent_bytes"] for r in range(2)]
        assert sent == ranks[0][layout]["bytes_per_sender"] and min(sent) > 0, (layout, sent)
    sent = ranks[0]["ep2"]["bytes_per_sender"]
    assert abs(sent[0] - sent[1]) < 0.1 * max(sent), sent


def test_bad_requests_and_expert_tensor_parallel_are_refused_by_name(runs: Any) -> None:
    ranks, _ = runs
    for r in range(2):
        foreign, unknown = ranks[r]["ep2"]["bad_requests"]
        assert f"not by this rank (sender {r}: stage 0, EP rank {r})" in foreign, foreign
        assert unknown == "'nope' is not a tensor this Megatron model exports"
        etp = ranks[r]["etp2"]
        assert etp["num_senders"] == 1  # senders=auto keeps the single-sender path
        assert len(etp["errors"]) == 2 and all("supports expert tensor parallelism 1 only (got expert TP=2" in e for e in etp["errors"]), etp


def test_pp2_syncs_per_stage_through_sync_rollout_weights(runs: Any) -> None:
    """The session path, twice (the second after every parameter moved): rank 0 controls and sends
    stage 0, rank 1 follows and sends stage 1; the reference engine ends up holding the
    single-sender export of the moved weights, bit for bit."""
    ranks, got = runs
    reports = ranks[0]["sync"]["reports"]
    assert ranks[1]["sync"]["reports"] == [None, None]  # a follower returns nothing
    specs = ranks[0]["pp2"]["specs"]
    assert [(r["senders"], r["tensors"]) for r in reports] == [(2, len(specs))] * 2, reports
    assert reports[1]["version"] > reports[0]["version"]
    want = ranks[0]["tensors"]
    for name in specs:
        assert torch.equal(_bits(got[f"ref/{name}"]), _bits(want[f"sync/{name}"])), name
        assert not torch.equal(want[f"sync/{name}"], want[f"pp2/{name}"]), f"{name} did not move"
