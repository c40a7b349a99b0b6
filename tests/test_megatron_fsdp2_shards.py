"""Megatron-FSDP2 as a multi-sender weight source: every rank sends the rows its flat buffers hold.

CPU: the row ranges a flat, row-aligned buffer gives each rank (`flat_rows`, hand-checked on the
layout of megatron-fsdp's own docstring, and a property over random layouts); with megatron-fsdp
importable, the same ranges read from real `DBuffer`s on 3 gloo ranks reassemble every tensor.

GPU (-m gpu, 2 GPUs, megatron-fsdp installed): trainer ranks 0 and 1 shard a tiny Qwen2 whose
shapes split unevenly (hidden 48, intermediate 88, vocab 100: some tensors straddle the ranks'
ranges at an uneven row, others lie wholly in one rank's range); a third process receives on
CPU over a gloo weight-sync group with both trainer ranks sending. The receiver must end bit for
bit equal to what `iter_weights()` (the gathering single-sender path) exports on rank 0, before
and after a training step, in fp32 and with a bf16 wire whose fp32-kept tensors come from the
main weights; and no all-gather may be issued on any trainer rank while pieces are produced and
sent (counted on the trainer's process group, and by the dispatcher, with the same counter that
sees `iter_weights()` gather). Through `sync_rollout_weights(senders="all")` as well: rank 1
follows rank 0's announcements over the trainer's NCCL group (`engine.source.process_group`) and a
reference engine in its own process ends bit-exact (that path adds the sync layer's own 512-byte
status all-gather per sync on the trainer group, not counted there; no weight is gathered).
"""

from __future__ import annotations

import datetime
import math
import uuid
from itertools import chain
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt_engine.sources.megatron_fsdp2 import flat_rows
from tests._trainer_mp import lm_loss, run_ranks
from ckpt_engine.store import serve_store

pytestmark = pytest.mark.timeout(300)

# --- CPU: row ranges of a flat buffer ---------------------------------------------------------


def test_rows_of_megatron_fsdps_documented_layout() -> None:
    """megatron-fsdp's GlobalLayout docstring: shapes P0..P4 at offsets 0, 12, 32, 28, 48 of a
    60-element buffer over 5 ranks (12 elements each); uneven splits and ranks holding nothing."""
    shapes = [(2, 6), (4, 4), (4, 4), (1, 2), (1, 6)]
    offsets = [0, 12, 32, 28, 48]
    got = [flat_rows(f"P{i}", o, s, 60, 5) for i, (o, s) in enumerate(zip(offsets, shapes))]
    assert got == [[2, 0, 0, 0, 0], [0, 3, 1, 0, 0], [0, 0, 1, 3, 0], [0, 0, 1, 0, 0], [0, 0, 0, 0, 1]]
    assert flat_rows("bias", 4224, (88,), 4400, 2) == [0, 88]  # a 1-D tensor: rows are elements
    assert flat_rows("w", 0, (48, 88), 4400, 2) == [25, 23]  # 2200 elements per rank: 25 rows of 88 fit


@st.composite
def _layouts(draw: Any) -> tuple[list[tuple[int, ...]], list[int], int, int]:
    """Row-aligned layouts as megatron-fsdp builds them: each tensor at a multiple of its row
    size (gaps allowed), the buffer padded to world * lcm(row sizes), so rank bounds fall between rows."""
    world = draw(st.integers(1, 4))
    rows_sizes = draw(st.lists(st.sampled_from([1, 2, 3, 4, 6, 12]), min_size=1, max_size=6))
    shapes, offsets, end = [], [], 0
    for row in rows_sizes:
        n = draw(st.integers(1, 9))
        shapes.append((n,) if row == 1 else (n, row))
        end = -(-end // row) * row + row * draw(st.integers(0, 2))
        offsets.append(end)
        end += n * row
    chunk = math.lcm(*rows_sizes) * world
    return shapes, offsets, -(-end // chunk) * chunk, world


@settings(max_examples=200, deadline=None)
@given(_layouts())
def test_each_rank_holds_the_rows_inside_its_range(layout: tuple[list[tuple[int, ...]], list[int], int, int]) -> None:
    shapes, offsets, size, world = layout
    per = size // world
    for i, (shape, offset) in enumerate(zip(shapes, offsets)):
        rows = flat_rows(f"t{i}", offset, shape, size, world)
        assert sum(rows) == shape[0] and min(rows) >= 0
        row = math.prod(shape[1:])
        first = 0
        for rank, n in enumerate(rows):
            if n:  # rows [first, first + n) lie wholly in rank's element range, in rank order
                assert rank * per <= offset + first * row and offset + (first + n) * row <= (rank + 1) * per
            first += n


def test_layouts_that_are_no_row_split_are_refused() -> None:
    with pytest.raises(ValueError, match=r"w: rank 0 holds elements \[0, 6\) of it, not whole rows of 4"):
        flat_rows("w", 2, (3, 4), 16, 2)
    with pytest.raises(ValueError, match=r"w: elements \[8, 20\) lie outside the flat buffer of 16"):
        flat_rows("w", 8, (3, 4), 16, 2)
    with pytest.raises(ValueError, match="w: a flat buffer of 15 elements does not split evenly over 2 ranks"):
        flat_rows("w", 0, (3,), 15, 2)
    with pytest.raises(ValueError, match="s: a 0-dim tensor has no rows to shard"):
        flat_rows("s", 0, (), 16, 2)


# --- CPU with megatron-fsdp: real DBuffers on gloo ----------------------------------------------

DBUF_SHAPES = [(7, 6), (5,), (3, 4), (11, 6), (1, 2), (2, 12)]


def _dbuffer_rank(rank: int, world_size: int) -> dict[str, Any]:
    from megatron_fsdp.experimental import DBuffer, Flat, Partial, Replicate
    from torch.distributed.device_mesh import DeviceMesh

    from ckpt_engine.sources.megatron_fsdp2 import dbuffer_rows

    g = torch.Generator().manual_seed(3)
    full = [torch.randn(s, generator=g) for s in DBUF_SHAPES]
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    flat = DBuffer.distribute_tensors(full, mesh, [Flat()])
    out: dict[str, Any] = {"rows": [], "tensors": {}}
    for i in range(len(full)):
        rows = dbuffer_rows(f"t{i}", flat, i, world_size)
        local = flat.get_local_tensor(i)
        assert rows is not None and local.shape[0] == rows[rank], (i, rows, tuple(local.shape))
        out["rows"].append(rows)
        out["tensors"][f"t{i}"] = local.clone()
    replicated = DBuffer.distribute_tensors(full, mesh, [Replicate()])
    out["replicated"] = [dbuffer_rows(f"t{i}", replicated, i, world_size) for i in range(len(full))]
    partial = DBuffer.from_local(replicated.local_buffer, mesh, [Partial()], replicated.layout.tensor_shapes)
    with pytest.raises(ValueError, match=r"t0: Megatron-FSDP2 placement .* is not one Flat axis"):
        dbuffer_rows("t0", partial, 0, world_size)
    out["tensors"].update({f"full/t{i}": t for i, t in enumerate(full)})
    return out


def test_dbuffer_rows_reassemble_every_tensor_on_3_gloo_ranks() -> None:
    """Each rank's `get_local_tensor` has exactly the rows `dbuffer_rows` gives it, and the ranks'
    rows in rank order rebuild every tensor (uneven splits, ranks holding nothing)."""
    pytest.importorskip("megatron_fsdp.experimental", reason="megatron-fsdp is not installed here")
    results = run_ranks(_dbuffer_rank, 3, timeout_s=90, preload=("megatron_fsdp.experimental",))
    rows = results[0]["rows"]
    assert all(r["rows"] == rows for r in results)  # the same map on every rank
    assert all(r["replicated"] == [None] * len(DBUF_SHAPES) for r in results)
    for i, shape in enumerate(DBUF_SHAPES):
        parts = [results[r]["tensors"][f"t{i}"] for r in range(3)]
        assert [p.shape[0] for p in parts] == rows[i]
        assert torch.equal(torch.cat(parts), results[0]["tensors"][f"full/t{i}"]), f"t{i} rows {rows[i]}"
    assert any(0 in r for r in rows) and any(len(set(r) - {0}) > 1 for r in rows), rows


# --- GPU: a many-sender sync out of Megatron-FSDP2 ----------------------------------------------

TRAINERS = 2
RECEIVER = TRAINERS  # global rank of the receiving process (CPU)
BUCKET = 8192  # bytes: several buckets per sender
PHASES = {  # name -> (engine config, versions synced; a training step before every version but the first)
    "fp32": (dict(wire_dtype=None), 2),
    "bf16": (dict(param_dtype="bfloat16", main_params_dtype="float32", main_grads_dtype="float32", wire_dtype="bfloat16",
                  keep_fp32_patterns=(r"post_attention_layernorm", r"lm_head")), 2),
}


def uneven_qwen2() -> torch.nn.Module:
    from transformers import Qwen2Config

    from ckpt_engine.trainer.engines.common import hf_model_from_config

    config = Qwen2Config(
        vocab_size=100, hidden_size=48, intermediate_size=88, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, attn_implementation="eager",
    )
    torch.manual_seed(0)
    return hf_model_from_config(config, torch.float32)


def _train_step(engine: Any, rank: int, step: int) -> None:
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(100 * step + rank)).to(engine.device)
    engine.forward_backward({"input_ids": ids}, lm_loss)
    engine.optimizer_step()


def _engine(rank: int, group: dist.ProcessGroup, phase: str) -> Any:
    from ckpt_engine.trainer.engines.megatron_fsdp2 import MegatronFSDP2Config, MegatronFSDP2TrainEngine

    cfg = MegatronFSDP2Config(lr=1e-3, eps=1e-4, weight_decay=0.01, max_grad_norm=1.0, **PHASES[phase][0])
    return MegatronFSDP2TrainEngine(uneven_qwen2().to(torch.device("cuda", rank)), config=cfg, process_group=group)


def _refusals(engine: Any, owners: Any) -> None:
    """Asking for a tensor the model does not export, or one this rank holds no row of, fails by name."""
    with pytest.raises(ValueError, match="'nope' is not a tensor this Megatron-FSDP2 model exports"):
        engine.source.local_piece("nope")
    foreign = next(n for n, shards in owners.items() if [s.sender for s in shards] == [1 - engine.rank])
    with pytest.raises(ValueError, match=f"{foreign}: rank {engine.rank} holds none of its rows"):
        engine.source.local_piece(foreign)


def _trainer_phase(rank: int, group: dist.ProcessGroup, rdzv: Any, phase: str) -> dict[str, Any]:
    from test_fsdp2_shards import GatherCounter

    from ckpt_engine.manifest import encode_manifest
    from ckpt_engine.registry import CheckpointEngineRegistry
    from ckpt_engine.sources.sharded import ShardedWeightSource, iter_pieces
    from ckpt_engine.sync.many_senders import wants_many_senders

    engine = _engine(rank, group, phase)
    versions = PHASES[phase][1]
    assert isinstance(engine.source, ShardedWeightSource) and (engine.source.sender_index, engine.source.num_senders) == (rank, TRAINERS)
    assert engine.source.process_group is group and wants_many_senders(engine.source, "all") and wants_many_senders(engine.source, "auto")
    sync = CheckpointEngineRegistry.new("gloo", bucket_size_bytes=BUCKET, timeout_s=120)
    with GatherCounter(group) as planning:  # ownership, the plan and every piece: all local
        owners = engine.source.owners()
        manifest = sync.plan(engine.source.metadata(), num_senders=TRAINERS, owners=owners)
        num_pieces = sum(1 for _ in iter_pieces(engine.source, manifest))
    _refusals(engine, owners)
    if rank == 0:
        rdzv.connect_store().set("manifest", encode_manifest(manifest))
    sync.init_process_group(rdzv, rank)
    out: dict[str, Any] = {"digest": manifest.digest, "num_pieces": num_pieces, "counts": {"plan": planning.summary()}, "sent": []}
    out["tensors"] = {}
    for version in range(versions):
        if version:
            _train_step(engine, rank, version)
        with GatherCounter(group) as gathering:
            expected = {n: t.detach().clone() for n, t in engine.source.iter_weights()}  # the gathering single-sender path
        torch.cuda.synchronize()
        with GatherCounter(group) as sending:
            stats = sync.send_weights(manifest, iter_pieces(engine.source, manifest), stable=engine.source.stable_pieces)
            torch.cuda.synchronize()
        out["counts"][f"iter_weights v{version}"] = gathering.summary()
        out["counts"][f"send v{version}"] = sending.summary()
        out["sent"].append(stats.bytes)
        if rank == 0:
            out["tensors"].update({f"{phase}/v{version}/{n}": t for n, t in expected.items()})
    sync.finalize()
    out["owners"] = {n: [[s.sender, s.start, s.stop] for s in shards] for n, shards in owners.items()}
    out["specs"] = {s.name: [s.dtype, list(s.shape)] for s in engine.source.metadata()}
    out["bytes_per_sender"] = manifest.bytes_per_sender()
    out["total_bytes"] = manifest.total_bytes
    out["stable_pieces"] = engine.source.stable_pieces
    return out


def _receiver_phase(rdzv: Any, phase: str) -> dict[str, Any]:
    from ckpt_engine.manifest import decode_manifest
    from ckpt_engine.registry import CheckpointEngineRegistry

    store = rdzv.connect_store()
    store.wait(["manifest"], datetime.timedelta(seconds=rdzv.timeout_s))
    manifest = decode_manifest(store.get("manifest"))
    sync = CheckpointEngineRegistry.new("gloo", bucket_size_bytes=BUCKET, timeout_s=120)
    sync.init_process_group(rdzv, RECEIVER)
    got: dict[str, torch.Tensor] = {}
    for version in range(PHASES[phase][1]):
        got.update({f"{phase}/v{version}/{n}": t.clone() for n, t in chain.from_iterable(sync.receive_buckets(manifest))})
    sync.finalize()
    return {"tensors": got}


def _gpu_worker(rank: int, world_size: int, rdzvs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    from ckpt_engine.engine import Rendezvous

    if rank < TRAINERS:
        torch.cuda.set_device(rank)
    group = dist.new_group(list(range(TRAINERS)), backend="nccl")  # collective over every process
    result: dict[str, Any] = {"tensors": {}}
    for phase, d in rdzvs.items():
        rdzv = Rendezvous.from_dict(d)
        part = _receiver_phase(rdzv, phase) if rank == RECEIVER else _trainer_phase(rank, group, rdzv, phase)
        result["tensors"].update(part.pop("tensors"))
        result[phase] = part
        dist.barrier()  # the default (gloo) group: phases do not overlap
    return result


@pytest.fixture(scope="module")
def gpu_runs() -> list[dict[str, Any]]:
    if not torch.cuda.is_available() or torch.cuda.device_count() < TRAINERS:
        pytest.skip(f"needs {TRAINERS} GPUs")
    from ckpt_engine.engine import Rendezvous
    from ckpt_engine.trainer.engines.megatron_fsdp2 import megatron_fsdp2_available

    ok, why = megatron_fsdp2_available()
    if not ok:
        pytest.skip(why)
    store = serve_store("127.0.0.1", 300)
    rdzvs = {p: Rendezvous("127.0.0.1", store.port, uuid.uuid4().hex, TRAINERS + 1, "gloo", 120.0, TRAINERS).to_dict() for p in PHASES}
    results = run_ranks(_gpu_worker, TRAINERS + 1, timeout_s=240, rdzvs=rdzvs)
    del store
    return results


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.gpu
@pytest.mark.parametrize("phase", list(PHASES))
def test_receiver_is_bit_exact_with_the_gathered_export_on_2_gpus(gpu_runs: list[dict[str, Any]], phase: str) -> None:
    """Both ranks send only their rows; the receiver holds exactly what iter_weights() gathers,
    in the wire dtypes, before and after a training step."""
    trainer0, want, got = gpu_runs[0][phase], gpu_runs[0]["tensors"], gpu_runs[RECEIVER]["tensors"]
    assert gpu_runs[1][phase]["digest"] == trainer0["digest"]  # both ranks planned alike, locally
    specs = trainer0["specs"]
    versions = PHASES[phase][1]
    for name, (dtype, shape) in specs.items():
        for v in range(versions):
            exp, rec = want[f"{phase}/v{v}/{name}"], got[f"{phase}/v{v}/{name}"]
            assert str(exp.dtype) == f"torch.{dtype}" and list(exp.shape) == shape, f"{phase} v{v} {name}: export"
            assert str(rec.dtype) == f"torch.{dtype}" and list(rec.shape) == shape, f"{phase} v{v} {name}"
            assert torch.equal(_bits(rec), _bits(exp)), f"{phase} v{v} {name} differs from the gathered export"
    trained = [n for n in specs if not torch.equal(want[f"{phase}/v0/{n}"], want[f"{phase}/v{versions - 1}/{n}"])]
    assert len(trained) > len(specs) // 2, "the training step changed too little for the second sync to mean anything"
    if phase == "bf16":  # kept-fp32 tensors come from the fp32 main weights, the rest is bf16
        assert specs["lm_head.weight"][0] == "float32" and specs["model.embed_tokens.weight"][0] == "bfloat16"
        assert specs["model.layers.0.post_attention_layernorm.weight"][0] == "float32"
    assert trainer0["stable_pieces"] == (phase == "fp32")  # fp32: views of the buffers; bf16: casts


@pytest.mark.gpu
@pytest.mark.parametrize("phase", list(PHASES))
def test_no_all_gather_on_the_sync_path_on_2_gpus(gpu_runs: list[dict[str, Any]], phase: str) -> None:
    """Ownership, planning and the pieces issue no collective at all, and a whole send no
    all-gather, on either rank; the same counter sees iter_weights() gather on the trainer group."""
    for r in range(TRAINERS):
        counts = gpu_runs[r][phase]["counts"]
        assert counts["plan"] == {"on_group": 0, "calls": 0, "dispatched": 0, "collectives": 0}, (r, counts["plan"])
        assert gpu_runs[r][phase]["num_pieces"] > 0
        for v in range(PHASES[phase][1]):
            sending = counts[f"send v{v}"]
            assert (sending["on_group"], sending["calls"], sending["dispatched"]) == (0, 0, 0), (r, v, sending)
            gathered = counts[f"iter_weights v{v}"]
            assert gathered["on_group"] > 0 and gathered["calls"] > 0, (r, v, gathered)


@pytest.mark.gpu
def test_ownership_follows_the_flat_buffers_on_2_gpus(gpu_runs: list[dict[str, Any]]) -> None:
    """Rows split unevenly between the ranks, tensors wholly inside one rank's range, nothing
    replicated (every parameter is in a Flat buffer); each rank sends what it owns, both send."""
    part = gpu_runs[0]["fp32"]
    owners, specs = part["owners"], part["specs"]
    assert sorted(owners) == sorted(specs)
    split = {n: s for n, s in owners.items() if len(s) == 2}
    whole = {n: s for n, s in owners.items() if len(s) == 1}
    print(f"split between the ranks: {sorted(split)}; bytes per sender {part['bytes_per_sender']}")
    assert split and whole, owners
    assert any(s[0][2] - s[0][1] != s[1][2] - s[1][1] for s in split.values()), split  # an uneven row split
    assert {s[0][0] for s in whole.values()} == {0, 1}  # each rank holds some tensor whole, the other none of it
    sent = [gpu_runs[r]["fp32"]["sent"][0] for r in range(TRAINERS)]
    assert sent == part["bytes_per_sender"] and sum(sent) == part["total_bytes"] and min(sent) > 0


def _full_path_worker(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    """Both ranks call sync_rollout_weights(senders=all); rank 0 drives a reference engine in its
    own process, rank 1 follows over the trainer's (NCCL) group and sends its own rows."""
    import os

    from ckpt_engine import CheckpointEngineConfig, sync_rollout_weights
    from ckpt_engine.rollout_adapters.torch_ref import TorchRefRollout, write_spec_file
    from ckpt_engine.sync.api import close_sessions
    from tests._trainer_mp import world_group

    engine = _engine(rank, world_group(), "bf16")
    handles = None
    if rank == 0:
        spec = os.path.join(tmp, "spec.msgpack")
        write_spec_file(spec, engine.source.metadata())
        handles = [TorchRefRollout.spawn("mfsdp2-ref", spec_file=spec, timeout_s=120)]
    cfg = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.0625, timeout_s=120, senders="all")
    out: dict[str, Any] = {"senders": [], "differs": [], "checked": 0}
    try:
        for v in range(PHASES["bf16"][1]):
            if v:
                _train_step(engine, rank, v)
            expected = {n: t.detach().cpu().clone() for n, t in engine.source.iter_weights()}
            report = sync_rollout_weights(engine.source, handles, config=cfg)
            if handles is not None and report is not None:
                out["senders"].append(report.senders)
                out["checked"] += len(expected)
                out["differs"] += [f"v{v} {n}" for n, t in expected.items() if not torch.equal(_bits(handles[0].get_tensor(n)), _bits(t))]
    finally:
        close_sessions()
        if handles is not None:
            handles[0].close()
    return out


@pytest.mark.gpu
def test_sync_rollout_weights_sends_from_both_ranks_on_2_gpus() -> None:
    """The library call picks the engine up as a sharded source (senders=all): both trainer ranks
    send, and a reference engine ends bit-exact with the gathered export, before and after a step."""
    import tempfile

    if torch.cuda.device_count() < TRAINERS:
        pytest.skip(f"needs {TRAINERS} GPUs")
    from ckpt_engine.trainer.engines.megatron_fsdp2 import megatron_fsdp2_available

    ok, why = megatron_fsdp2_available()
    if not ok:
        pytest.skip(why)
    with tempfile.TemporaryDirectory() as tmp:
        r0, _ = run_ranks(_full_path_worker, TRAINERS, timeout_s=200, backend="nccl", tmp=tmp)
    assert r0["senders"] == [TRAINERS] * PHASES["bf16"][1]
    assert r0["checked"] > 0 and r0["differs"] == [], r0["differs"][:5]
