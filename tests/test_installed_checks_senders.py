"""Installed-weight checks with many senders (issue 42 item 5, `senders: all`): two trainer ranks
in their own processes each fold their share of every checked tensor from their own rows
(`sync/installed_shares.py` `sender_shares`), rank 0 adds the shares after the report round and compares
them with what the reference receivers (their own processes) installed, as with one sender. A
loader that transposes a row-sharded tensor, or skips a tensor one sender holds whole, fails the
sync at 'verify' naming the tensor and the engine, 3 times each; clean syncs, whole tensors and
TP=2 slices with receive plans, pass every check."""

from __future__ import annotations

import datetime
import json
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpt_engine import CheckpointEngineConfig, SyncError, WeightSyncSession, sync_rollout_weights
from ckpt_engine.installed import digest, digest_share_runs, region_view, wrap64
from ckpt_engine.planning.regions import Region
from ckpt_engine.benchmark.processes import run_processes
from ckpt_engine.rollout_adapters.torch_ref import serve
from ckpt_engine.rollout_adapters.torch_ref import TorchRefRollout, write_spec_file
from ckpt_engine.benchmark.sharded_source import ShardedStateDictSource
from helpers_procs import fork_program, free_port
from ranks import forkserver_context
from refengines import spawn_engine
from regionranks import KV_HEADS, qwen2_specs, weights

pytestmark = pytest.mark.timeout(600)

REPEAT = 3
TIMEOUT_S = 20.0
SHARDED = "model.layers.0.mlp.gate_proj.weight"
"""96 rows: each of the two senders holds 48 (`ShardedStateDictSource` cuts tensors of 2+ dims)."""
WHOLE = "model.layers.1.input_layernorm.weight"
"""1-D: not sharded, the plan gives it whole to one sender."""


def _cfg() -> CheckpointEngineConfig:
    return CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.0625, timeout_s=TIMEOUT_S, senders="all", verify_installed=1, delta="off")


def trainer_main(rank: int, world: int, port: int, engines: list[dict[str, Any]], steps: list[list[str]], out_dir: str) -> None:
    """One trainer rank: per step, a fresh session on rank 0 over the named engines (the other
    rank follows through `sync_rollout_weights`), one sync of version i; a JSON log of outcomes."""
    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )
    handles = {e["name"]: TorchRefRollout(e["name"], e["host"], e["port"], None, TIMEOUT_S, token=e["token"]) for e in engines} if rank == 0 else {}
    log: list[dict[str, Any]] = []
    for i, names in enumerate(steps):
        source = ShardedStateDictSource(weights(qwen2_specs(), i), rank, world)
        source.is_sender = rank == 0
        try:
            if rank == 0:
                session = WeightSyncSession([handles[n] for n in names], _cfg())
                try:
                    report = session.sync(source)
                    log.append({"ok": True, "senders": report.senders, "checked": "installed_check" in report.seconds})
                finally:
                    session.close()
            else:
                sync_rollout_weights(source, None, config=_cfg())
                log.append({"ok": True})
        except SyncError as exc:
            log.append({"ok": False, "stage": exc.stage, "failed": exc.failed, "stale": exc.stale})
        except Exception as exc:
            log.append({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(log))


def digest_share(piece: torch.Tensor, first: int, shape: tuple[int, ...], region: Region | None, seed: int, samples: int) -> torch.Tensor:
    """The share of one contiguous run: `piece` holds flat elements [first, first + piece.numel())."""
    return digest_share_runs(piece.reshape(-1), first, [(first, first + piece.numel())], shape, region, seed, samples)


@pytest.mark.parametrize("region", [None, Region(0, 16, 32), Region(1, 40, 40)], ids=["whole", "rows", "columns"])
def test_shares_of_pieces_that_cover_a_tensor_once_add_up_to_its_digest(region: Region | None) -> None:
    g = torch.Generator().manual_seed(2)
    for t in (torch.randn(96, 80, generator=g), torch.randn(96, 80, generator=g).bfloat16(), torch.rand(96, 80, generator=g) > 0.5):
        flat = t.reshape(-1)
        for samples in (16, 4096, 1 << 20):  # a few positions, many, every one
            want = int(digest(region_view(t, region), 11, samples))
            for cuts in ([0, 7680], [0, 80 * 48, 7680], [0, 1999, 80 * 50, 7680]):  # whole, two row blocks, uneven runs
                shares = [int(digest_share(flat[a:b], a, tuple(t.shape), region, 11, samples)) for a, b in zip(cuts, cuts[1:])]
                assert wrap64(sum(shares)) == want, (t.dtype, samples, cuts)


def test_a_senders_runs_fold_at_once_as_their_pieces_do_and_cast_as_the_wire() -> None:
    """`digest_share_runs` (what `sender_shares` folds): every run a sender holds in one call, from
    its piece in its own dtype, equals the shares of each run's piece cast to the wire dtype."""
    g = torch.Generator().manual_seed(4)
    t = torch.randn(96, 80, generator=g)  # fp32 master; the wire carries bf16
    wire = t.bfloat16()
    for region in (None, Region(0, 16, 32), Region(1, 40, 40)):
        base, piece = 80 * 40, t.reshape(-1)[80 * 40 : 80 * 90]  # a sender's rows 40..90
        runs = [(80 * 40, 80 * 55), (80 * 55 + 3, 80 * 70), (80 * 70, 80 * 90)]
        want = sum(int(digest_share(wire.reshape(-1)[a:b], a, (96, 80), region, 9, 4096)) for a, b in runs)
        assert int(digest_share_runs(piece, base, runs, (96, 80), region, 9, 4096, torch.bfloat16)) == wrap64(want), region


@pytest.mark.parametrize("shape", [(6, 40, 24), (1000,), (8, 5, 3, 7)], ids=["experts", "flat", "4d"])
def test_senders_holding_scattered_runs_of_any_region_add_up_to_its_digest(shape: tuple[int, ...]) -> None:
    """The share fold's index math (a region's flat elements in the whole tensor: a shift for rows,
    one division for an inner dimension; a sender's runs as slices of the ascending positions or, for
    an inner region, a lookup): random regions on every dimension, tensors cut into uneven runs dealt
    to three senders (a sender holds several, some overlapping), with every position kept or a few."""
    import random

    rng, g = random.Random(5), torch.Generator().manual_seed(5)
    t = torch.randn(shape, generator=g).bfloat16()
    n = t.numel()
    for _ in range(40):
        dim = rng.randrange(len(shape))
        start = rng.randrange(shape[dim])
        region = rng.choice([None, Region(dim, start, rng.randint(1, shape[dim] - start)), Region(dim, 0, shape[dim])])
        samples = rng.choice([5, 64, 4096])
        cuts = sorted({0, n, *rng.sample(range(1, n), 6)})
        held: list[list[tuple[int, int]]] = [[], [], []]
        for a, b in zip(cuts, cuts[1:]):
            held[rng.randrange(3)].append((a, b))
        held[0] += held[0][:1]  # the same run twice: the union counts it once
        want = int(digest(region_view(t, region), 13, samples))
        shares = 0
        for runs in held:
            base = min((a for a, _ in runs), default=0)
            top = max((b for _, b in runs), default=0)
            shares += int(digest_share_runs(t.reshape(-1)[base:top], base, runs, shape, region, 13, samples))
        assert wrap64(shares) == want, (region, samples, held)


def _run(engines: list[TorchRefRollout], steps: list[list[str]], out: Path) -> list[list[dict[str, Any]]]:
    info = [{"name": e.name, "host": e.rpc.host, "port": e.rpc.port, "token": e.token} for e in engines]
    port = free_port()
    ctx = forkserver_context()
    procs = [ctx.Process(target=trainer_main, args=(r, 2, port, info, steps, str(out))) for r in range(2)]
    run_processes(procs, 300)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def spec_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("senders") / "qwen2.msgpack"
    write_spec_file(path, qwen2_specs())
    return str(path)


@pytest.fixture(scope="module")
def good(spec_path: str) -> Iterator[TorchRefRollout]:
    e = spawn_engine("good", spec_file=spec_path, timeout_s=TIMEOUT_S)
    yield e
    e.close()


def _spawn_faulty(spec_file: str, name: str, fault: str) -> TorchRefRollout:
    token = secrets.token_hex(16)
    program = fork_program("_faulty_ref:main", [fault, "--spec-file", spec_file, "--port", "0"], f"engine-{name}", env={serve.TOKEN_ENV: token})
    line = program.read_line(serve.READY_PREFIX, 60)
    assert line is not None, f"faulty engine {name} did not start"
    return TorchRefRollout(name, "127.0.0.1", int(line[len(serve.READY_PREFIX):].strip()), program.process, TIMEOUT_S, token=token)


@pytest.mark.parametrize("fault", [f"transpose:{SHARDED}", f"skip:{WHOLE}"])
def test_a_faulty_loader_fails_a_two_sender_sync_by_tensor_and_engine(spec_path: str, good: TorchRefRollout, tmp_path: Path, fault: str) -> None:
    bad = _spawn_faulty(spec_path, "bad", fault)
    tensor = fault.split(":", 1)[1]
    try:
        lead, follower = _run([good, bad], [["good", "bad"]] * REPEAT, tmp_path)
    finally:
        bad.close()
    assert [e["ok"] for e in follower] == [True] * REPEAT, follower  # its send was fine: the loader was not
    assert len(lead) == REPEAT, lead
    for e in lead:
        assert not e["ok"] and e.get("stage") == "verify" and set(e["failed"]) == {"bad"}, e
        assert tensor in e["failed"]["bad"] and "differ from the source" in e["failed"]["bad"], e
        assert "bad" in e["stale"], e


def test_clean_two_sender_syncs_pass_the_check_whole_and_as_tp_slices(spec_path: str, good: TorchRefRollout, tmp_path: Path) -> None:
    layout = {"tp_size": 2, "num_kv_heads": KV_HEADS}
    tp = [spawn_engine(f"tp{r}", spec_file=spec_path, timeout_s=TIMEOUT_S, layout={**layout, "tp_rank": r}) for r in range(2)]
    try:
        lead, follower = _run([good, *tp], [["good"], ["tp0", "tp1"], ["good", "tp0", "tp1"]], tmp_path)
    finally:
        for e in tp:
            e.close()
    assert [e["ok"] for e in follower] == [True] * 3, follower
    assert lead == [{"ok": True, "senders": 2, "checked": True}] * 3, lead
