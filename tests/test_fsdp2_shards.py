"""FSDP2 as a multi-sender weight source: every trainer rank sends its own shards, nothing is gathered.

One spawn of 4 real processes runs two weight-sync groups in turn: 3 FSDP2 trainer ranks + 1
receiver, then 2 trainer ranks + the same receiver (the third process sits that one out). Each
group syncs a tiny Qwen2-MoE three times over the same buffers: dense, a delta seed, and, after an
AdamW step at lr 1e-5, a delta patch. The receiver's tensors are compared bit for bit with what
`iter_weights()` (the gathering single-sender path) yields on trainer rank 0 in the same run.

Shapes are chosen so FSDP2 splits rows unevenly (vocab 100 and shared-expert 40 rows over 3
ranks), a rank owns zero rows (`shared_expert_gate` has 1 row), ranks own whole experts, and a
persistent buffer (replicated, assigned by the planner) rides along.
"""

from __future__ import annotations

import datetime
import inspect
import threading
import uuid
from collections.abc import Callable
from itertools import chain
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests._trainer_mp import run_ranks
from ckpt_engine.store import serve_store

pytestmark = pytest.mark.timeout(240)

WORLD = 4  # processes: ranks 0-2 train, rank 3 receives
RECEIVER = WORLD - 1
GROUPS = (3, 2)  # trainer ranks of the two weight-sync groups, in run order
BUCKET = 4096  # bytes: embeddings and shards span several buckets
GATE = "model.layers.0.mlp.shared_expert_gate.weight"  # 1 row: one owner, the other ranks hold none


def tiny_moe(tie: bool) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen2MoeConfig

    config = Qwen2MoeConfig(
        vocab_size=100, hidden_size=48, intermediate_size=64, moe_intermediate_size=20, shared_expert_intermediate_size=40,
        num_experts=6, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, tie_word_embeddings=tie, attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for layer in model.model.layers:  # a persistent router buffer (DeepSeek-V3 style): never sharded
        layer.mlp.gate.register_buffer("e_score_correction_bias", torch.linspace(-1, 1, 6))
    return model


class GatherCounter:
    """Counts the all-gathers this process issues while active, two independent ways.

    `on_group`: calls of torch.distributed's all-gather entry points naming `group` (the ones
    FSDP2's unshard goes through). `dispatched`: every all-gather op the dispatcher runs on this
    thread, on any group, functional collectives (DTensor.full_tensor) included (CommDebugMode).
    """

    ENTRY_POINTS = (
        "all_gather", "all_gather_single", "all_gather_into_tensor", "_all_gather_base", "all_gather_coalesced", "all_gather_object",
    )

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.on_group = self.calls = self.dispatched = 0
        self._saved: list[tuple[Any, str, Any]] = []
        self._depth = threading.local()

    def _wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        sig = inspect.signature(fn)

        def counted(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(self._depth, "n", 0)
            if depth == 0:  # an entry point calling another counts once
                self.calls += 1
                self.on_group += sig.bind_partial(*args, **kwargs).arguments.get("group") is self.group
            self._depth.n = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth.n = depth

        return counted

    def __enter__(self) -> GatherCounter:
        from torch.distributed.tensor.debug import CommDebugMode

        for name in self.ENTRY_POINTS:
            original = getattr(dist.distributed_c10d, name, None)
            if original is None:  # not in every torch release (e.g. all_gather_single)
                continue
            wrapped = self._wrap(original)
            for module in (dist, dist.distributed_c10d):
                if getattr(module, name, None) is original:
                    self._saved.append((module, name, original))
                    setattr(module, name, wrapped)
        self._mode = CommDebugMode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._mode.__exit__(*exc)
        for module, name, original in reversed(self._saved):
            setattr(module, name, original)
        counts = self._mode.get_comm_counts()
        self.dispatched = sum(n for op, n in counts.items() if "all_gather" in str(op) or "allgather" in str(op))
        self.collectives = sum(counts.values())

    def summary(self) -> dict[str, int]:
        return {"on_group": self.on_group, "calls": self.calls, "dispatched": self.dispatched, "collectives": self.collectives}


def _lm_loss(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    ids = batch["input_ids"]
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def _requests() -> list[Any]:
    from ckpt_engine.delta.request import DeltaRequest

    return [None, DeltaRequest(False, None, 1), DeltaRequest(True, 1, 2)]  # dense, delta seed, delta patch


def _bad_requests(engine: Any, rank: int, senders: int, group: dist.ProcessGroup) -> None:
    """Asking for what this rank does not hold, or a placement that is not a row range, fails by name."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    from ckpt_engine.sources.fsdp2_shards import dim0_rows

    with pytest.raises(ValueError, match="'nope' is not a tensor this FSDP2 model exports"):
        engine.source.local_piece("nope")
    if rank > 0:
        with pytest.raises(ValueError, match=f"{GATE}: rank {rank} holds none of its rows"):
            engine.source.local_piece(GATE)
    foreign = 5 if rank == 0 else 0  # an expert another rank holds
    with pytest.raises(ValueError, match=rf"experts.{foreign}.down_proj.weight: expert {foreign} is not on rank {rank}"):
        engine.source.local_piece(f"model.layers.0.mlp.experts.{foreign}.down_proj.weight")
    by_columns = DTensor.from_local(torch.zeros(4, 2), DeviceMesh.from_group(group, "cpu"), [Shard(1)], run_check=False)
    with pytest.raises(ValueError, match=r"cols: FSDP2 placement .* is not a plain dim-0 shard"):
        dim0_rows("cols", by_columns, rank, senders)


def _trainer(rank: int, senders: int, group: dist.ProcessGroup, rdzv: Any, tie: bool, bf16: bool) -> dict[str, Any]:
    """`bf16`: the model's parameters are bf16 (the router is still kept fp32 on the wire): few
    bytes need a cast, so the pieces are stable (views, and casts kept for the sync); else fp32
    masters, every piece a cast temporary."""
    from torch.distributed.tensor import DTensor

    from ckpt_engine.manifest import encode_manifest
    from ckpt_engine.registry import CheckpointEngineRegistry
    from ckpt_engine.sources.sharded import ShardedWeightSource, iter_pieces
    from ckpt_engine.trainer.engines.fsdp2 import FSDP2Config, FSDP2TrainEngine

    model = tiny_moe(tie).to(torch.bfloat16) if bf16 else tiny_moe(tie)
    engine = FSDP2TrainEngine(model, config=FSDP2Config(lr=1e-5, wire_dtype="bfloat16"), process_group=group)
    assert isinstance(engine.source, ShardedWeightSource) and (engine.source.sender_index, engine.source.num_senders) == (rank, senders)
    _bad_requests(engine, rank, senders, group)
    sync = CheckpointEngineRegistry.new("gloo", bucket_size_bytes=BUCKET, timeout_s=60)
    with GatherCounter(group) as planning:  # ownership, the plan and every piece: all local
        owners = engine.source.owners()
        manifest = sync.plan(engine.source.metadata(), num_senders=senders, owners=owners)
        num_pieces = sum(1 for _ in iter_pieces(engine.source, manifest))
    if rank == 0:
        rdzv.connect_store().set("manifest", encode_manifest(manifest))
    sync.init_process_group(rdzv, rank)
    out: dict[str, Any] = {"digest": manifest.digest, "counts": {"plan": planning.summary()}, "stats": [], "tensors": {}}
    out["num_pieces"] = num_pieces
    expected: dict[str, torch.Tensor] = {}
    for version, request in enumerate(_requests()):
        if version == 2 and not bf16:  # one AdamW step: a real sparse-ish change for the patch to carry
            ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(10 + rank))
            engine.forward_backward({"input_ids": ids}, _lm_loss)
            engine.optimizer_step()
        elif version == 2:  # bf16 tiny shapes trip grouped_mm's 16-byte strides on CPU: move every 8th word in place (an int32-position patch pays below ~1/3 of bf16 words)
            with torch.no_grad():
                for p in engine.model.parameters():
                    local = p.to_local() if isinstance(p, DTensor) else p
                    local.view(-1)[::8].mul_(1.5)
        with GatherCounter(group) as gathering:
            expected = {n: t.clone() for n, t in engine.source.iter_weights()}  # the single-sender path gathers
        with GatherCounter(group) as sending:
            stats = sync.send_weights(manifest, iter_pieces(engine.source, manifest), stable=engine.source.stable_pieces, delta=request)
        out["counts"][f"iter_weights v{version}"] = gathering.summary()
        out["counts"][f"send v{version}"] = sending.summary()
        out["stats"].append({"bytes": stats.bytes, **stats.extra})
        if rank == 0 and version != 1:  # v1 sends v0's bytes again
            out["tensors"].update({f"v{version}/{n}": t for n, t in expected.items()})
    with GatherCounter(group) as probe:  # the counter sees the functional path an adapter could misuse
        engine.source._sharded(engine.source._entries[0]).full_tensor()
    out["counts"]["full_tensor"] = probe.summary()
    out["base_bytes"] = sync.delta_base_bytes
    out["bytes_per_sender"] = manifest.bytes_per_sender()
    out["bucket_bytes"] = sum(b.nbytes for b in manifest.sender_buckets(rank))
    out["total_bytes"], out["wire_bytes"] = manifest.total_bytes, manifest.wire_bytes
    out["owners"] = {n: [[s.sender, s.start, s.stop] for s in shards] for n, shards in owners.items()}
    out["specs"] = {s.name: [s.dtype, list(s.shape)] for s in engine.source.metadata()}
    out["replicated"] = [s.name for s in engine.source.metadata() if s.name not in owners]
    out["stable_pieces"] = engine.source.stable_pieces
    sync.finalize()
    return out


def _receiver(rank: int, rdzv: Any) -> dict[str, Any]:
    from ckpt_engine.manifest import decode_manifest
    from ckpt_engine.registry import CheckpointEngineRegistry

    store = rdzv.connect_store()
    store.wait(["manifest"], datetime.timedelta(seconds=rdzv.timeout_s))
    manifest = decode_manifest(store.get("manifest"))
    sync = CheckpointEngineRegistry.new("gloo", bucket_size_bytes=BUCKET, timeout_s=60)
    sync.init_process_group(rdzv, rank)
    got: dict[str, torch.Tensor] = {}
    for version, request in enumerate(_requests()):
        got.update({f"v{version}/{n}": t.clone() for n, t in chain.from_iterable(sync.receive_buckets(manifest, delta=request))})
    sync.finalize()
    return {"tensors": got}


def _worker(rank: int, world_size: int, rdzvs: list[dict[str, Any]]) -> dict[str, Any]:
    from ckpt_engine.engine import Rendezvous

    groups = [dist.new_group(list(range(n))) for n in GROUPS]  # collective over every process
    result: dict[str, Any] = {}
    for n, group, d in zip(GROUPS, groups, rdzvs):
        rdzv = Rendezvous.from_dict(d)
        key = f"n{n}"
        if rank == RECEIVER:
            part = _receiver(n, rdzv)
        elif rank < n:
            part = _trainer(rank, n, group, rdzv, tie=n == 3, bf16=n == 3)
        else:
            continue
        result["tensors"] = {**result.get("tensors", {}), **{f"{key}/{k}": v for k, v in part.pop("tensors").items()}}
        result[key] = part
    return result


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    from ckpt_engine.engine import Rendezvous

    store = serve_store("127.0.0.1", 120)
    rdzvs = [Rendezvous("127.0.0.1", store.port, uuid.uuid4().hex, n + 1, "gloo", 60.0, n).to_dict() for n in GROUPS]
    preload = ("torch.distributed.fsdp", "transformers.models.qwen2_moe.modeling_qwen2_moe", "ckpt_engine.trainer.engines.fsdp2")
    results = run_ranks(_worker, WORLD, timeout_s=180, preload=preload, rdzvs=rdzvs)
    del store
    return results


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("senders", GROUPS)
def test_receiver_is_bit_exact_with_the_gathered_model(runs: list[dict[str, Any]], senders: int) -> None:
    """Every rank sends only its shards; the receiver holds exactly what iter_weights() gathers,
    in the wire dtypes (bf16, fp32 router), dense and as a delta after a training step."""
    trainer0, got = runs[0][f"n{senders}"], runs[RECEIVER]["tensors"]
    want = runs[0]["tensors"]
    assert len({runs[r][f"n{senders}"]["digest"] for r in range(senders)}) == 1  # every rank planned alike, locally
    specs = trainer0["specs"]
    for name, (dtype, shape) in specs.items():
        for version, source in ((0, 0), (1, 0), (2, 2)):
            exp, rec = want[f"n{senders}/v{source}/{name}"], got[f"n{senders}/v{version}/{name}"]
            assert str(rec.dtype) == f"torch.{dtype}" and list(rec.shape) == shape, f"v{version} {name}"
            assert torch.equal(_bits(rec), _bits(exp)), f"v{version} {name} differs from the gathered model"
    assert specs["model.layers.1.mlp.gate.weight"][0] == "float32" and specs["model.embed_tokens.weight"][0] == "bfloat16"
    assert ("lm_head.weight" in specs) == (senders == 2)  # the 3-rank model ties its embeddings
    trained = [n for n in specs if not torch.equal(want[f"n{senders}/v0/{n}"], want[f"n{senders}/v2/{n}"])]
    assert len(trained) > len(specs) // 2, "the optimizer step changed too little for the delta to mean anything"


@pytest.mark.parametrize("senders", GROUPS)
def test_no_all_gather_on_the_sync_path(runs: list[dict[str, Any]], senders: int) -> None:
    """Ownership, planning and producing the pieces issue no collective at all, and a whole sync
    (pieces + transport) no all-gather, on any rank; the same counter sees the gathers of
    iter_weights() and of DTensor.full_tensor(), so it works."""
    for r in range(senders):
        counts = runs[r][f"n{senders}"]["counts"]
        assert counts["plan"] == {"on_group": 0, "calls": 0, "dispatched": 0, "collectives": 0}, r  # no collective at all
        assert runs[r][f"n{senders}"]["num_pieces"] > 0
        for v in range(3):
            sending = counts[f"send v{v}"]  # (the weight-sync group's gloo broadcasts bypass the dispatcher)
            assert (sending["on_group"], sending["calls"], sending["dispatched"]) == (0, 0, 0), (r, v, sending)
            gathered = counts[f"iter_weights v{v}"]
            assert gathered["on_group"] > 0 and gathered["dispatched"] > 0, (r, v, gathered)
        assert counts["full_tensor"]["dispatched"] > 0


@pytest.mark.parametrize("senders", GROUPS)
def test_ownership_follows_fsdp2_rows(runs: list[dict[str, Any]], senders: int) -> None:
    """Uneven row splits, a rank with zero rows, whole experts per rank, replicated buffers left
    to the planner; every rank sends a share, and each one's delta bases hold only its share."""
    part = runs[0][f"n{senders}"]
    owners = part["owners"]
    row = 48 * 2  # bytes of one bf16 row of hidden 48
    vocab = [34, 34, 32] if senders == 3 else [50, 50]
    starts = [sum(vocab[:i]) for i in range(senders)]
    assert owners["model.embed_tokens.weight"] == [[s, starts[s] * row, (starts[s] + vocab[s]) * row] for s in range(senders)]
    assert owners[GATE] == [[0, 0, row]]  # one row: ranks 1.. hold none of it
    per_rank = 6 // senders
    for e in range(6):
        assert owners[f"model.layers.1.mlp.experts.{e}.down_proj.weight"] == [[e // per_rank, 0, 48 * 20 * 2]]
    assert part["replicated"] == [f"model.layers.{i}.mlp.gate.e_score_correction_bias" for i in range(2)]
    # 2 ranks: fp32 masters cast to the bf16 wire, pieces are temporaries; 3 ranks: a bf16 model
    # whose only casts (the fp32 router) are few, so they are kept for the sync: stable pieces
    assert part["stable_pieces"] == (senders == 3)
    sent = [runs[r][f"n{senders}"]["stats"][0]["bytes"] for r in range(senders)]
    assert sum(sent) == part["total_bytes"] and sent == part["bytes_per_sender"]
    bases = [runs[r][f"n{senders}"]["base_bytes"] for r in range(senders)]
    print(f"{senders} senders: sent {sent}, delta bases {bases}, model {part['total_bytes']} B ({part['wire_bytes']} B in buckets)")
    assert sum(bases) == part["wire_bytes"]  # together the senders' bases hold the model once
    share = part["wire_bytes"] / senders
    for r, base in enumerate(bases):
        assert base == runs[r][f"n{senders}"]["bucket_bytes"], (r, base)  # its own buckets, nothing gathered
        assert abs(base - share) < 0.1 * share, f"rank {r} keeps {base} base bytes, 1/{senders} of the model is {share:.0f}"
    patched = [runs[r][f"n{senders}"]["stats"][2] for r in range(senders)]
    assert all(s["patch_buckets"] > 0 for s in patched), patched
    assert sum(s["wire_bytes"] for s in patched) < part["total_bytes"]

