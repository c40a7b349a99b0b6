"""What an installed-weight check costs with many senders (issue 42 item 5, `senders: all`): two
trainer ranks in their own processes each send their rows of a preset's checkpoint (dense, gloo) into
one reference receiver in its own process; one session with `verify_installed: 2`, so after the first
two syncs checked and unchecked syncs alternate (paired: the box's other load hits both alike).

    python bench/installed_check_senders_bench.py --preset qwen2.5-7b --layers 1 --pairs 3

The check's own time with many senders is spread over the ranks: each sender folds its share of
every key from its own rows after its send (`sync/installed.py` `sender_shares`, timed here on each
rank around the library's own call), rank 0 adds the shares, waits for the engine's answer and
compares (`seconds["installed_check"]`: `rank0_check_s`), and the engine digests what it installed
(`InstalledReport.seconds`, asked once more after the syncs). Prints one JSON line: the median
dense sync unchecked and checked (and the difference's share: noisy), each part of the check, and
the check's share of an unchecked sync (the slowest rank's fold, since the ranks fold at once, plus
rank 0's add-and-compare).
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

TIMEOUT_S = 900.0


def _weights(preset: str, layers: int) -> tuple[list[Any], dict[str, Any]]:
    import torch

    from ckpt_engine.benchmark.presets import checkpoint_specs, load_preset_config

    specs = checkpoint_specs(load_preset_config(preset), num_layers=layers)
    g = torch.Generator().manual_seed(0)
    return specs, {s.name: torch.randn(s.shape, generator=g, dtype=torch.float32).to(getattr(torch, s.dtype)) for s in specs}


def trainer_main(rank: int, port: int, engine: dict[str, Any], args: dict[str, Any], out_dir: str) -> None:
    """One trainer rank: 2 + 2 * pairs syncs (rank 0 holds the session; rank 1 follows), each
    rank's share folds timed around the library's `sender_shares`."""
    import torch

    from ckpt_engine import CheckpointEngineConfig, WeightSyncSession, sync_rollout_weights
    from ckpt_engine.rollout_adapters.torch_ref import TorchRefRollout
    from ckpt_engine.benchmark.sharded_source import ShardedStateDictSource
    from ckpt_engine.sync import installed, sender_follower, session

    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=TIMEOUT_S)
    )
    folds: list[float] = []

    def timed(*a: Any, **kw: Any) -> list[int]:
        t = time.perf_counter()
        try:
            return installed.sender_shares(*a, **kw)
        finally:
            folds.append(time.perf_counter() - t)

    session.sender_shares = timed  # type: ignore[assignment]  # rank 0 folds through the session,
    sender_follower.sender_shares = timed  # type: ignore[assignment]  # the others through their follower
    _, sd = _weights(args["preset"], args["layers"])
    cfg = CheckpointEngineConfig(backend="gloo", bucket_size_mb=args["bucket_mb"], stage="off", timeout_s=TIMEOUT_S, senders="all",
                                 verify_installed=2, verify_installed_samples=args["samples"], delta="off")
    first = next(iter(sd))
    log: dict[str, Any] = {"folds": folds, "syncs": []}
    s = WeightSyncSession([TorchRefRollout("ref", engine["host"], engine["port"], None, TIMEOUT_S, token=engine["token"])], cfg) if rank == 0 else None
    try:
        for _ in range(2 + 2 * args["pairs"]):
            sd[first][0, 0] += 1  # a new version each sync
            source = ShardedStateDictSource(sd, rank, 2)
            source.is_sender = rank == 0  # rank 0 drives the session; the other sends its rows as a follower
            if s is not None:
                report = s.sync(source)
                log["syncs"].append({"total": report.seconds["total"], "check": report.seconds.get("installed_check"), "senders": report.senders})
            else:
                sync_rollout_weights(source, None, config=cfg)
    finally:
        if s is not None:
            s.close()
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(log))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--preset", default="qwen2.5-7b")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--samples", type=int, default=4096)
    p.add_argument("--bucket-mb", type=float, default=256)
    args = p.parse_args()

    from ckpt_engine.installed import InstalledRequest
    from ckpt_engine.benchmark.processes import run_processes
    from ckpt_engine.rollout_adapters.torch_ref import TorchRefRollout, write_spec_file

    specs, sd = _weights(args.preset, args.layers)
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    del sd
    out: dict[str, Any] = {"preset": args.preset, "layers": args.layers, "tensors": len(specs), "gb": round(nbytes / 1e9, 3), "samples": args.samples, "senders": 2}
    with tempfile.TemporaryDirectory() as tmp:
        spec_file = Path(tmp) / "spec.msgpack"
        write_spec_file(spec_file, specs)
        engine = TorchRefRollout.spawn("ref", spec_file=str(spec_file), dtype="bfloat16", timeout_s=TIMEOUT_S)
        try:
            import socket

            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            info = {"host": engine.rpc.host, "port": engine.rpc.port, "token": engine.token}
            ctx = mp.get_context("spawn")
            opts = {"preset": args.preset, "layers": args.layers, "pairs": args.pairs, "samples": args.samples, "bucket_mb": args.bucket_mb}
            run_processes([ctx.Process(target=trainer_main, args=(r, port, info, opts, tmp)) for r in range(2)], TIMEOUT_S * 2)
            logs = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(2)]
            t = time.perf_counter()
            report = engine.installed_digests(InstalledRequest([s.name for s in specs], 12345, args.samples))
            out["engine_digests_asked_s"] = round(time.perf_counter() - t, 4)
            out["engine_digests_s"] = round(max(r.seconds for r in report), 4)
        finally:
            engine.close()
    syncs = logs[0]["syncs"][2:]  # the first joins the group; the second starts the pairs
    assert all(x["senders"] == 2 for x in logs[0]["syncs"]), logs[0]["syncs"]
    checked = [x for x in syncs if x["check"] is not None]
    plain = [x for x in syncs if x["check"] is None]
    off, on = statistics.median(x["total"] for x in plain), statistics.median(x["total"] for x in checked)
    # each rank folds once per checked sync (the first sync of the session is checked too)
    folds = [logs[r]["folds"][1:] for r in range(2)]
    fold = statistics.median(max(a, b) for a, b in zip(*folds))
    compare = statistics.median(x["check"] for x in checked)
    out.update(
        sync_s_off=round(off, 4), sync_s_checked=round(on, 4), syncs_off=[round(x["total"], 4) for x in plain],
        syncs_checked=[round(x["total"], 4) for x in checked], difference_share=round((on - off) / off, 4),
        rank_fold_s=[round(statistics.median(f), 4) for f in folds], rank0_check_s=round(compare, 4),
        check_s=round(fold + compare, 4), check_share=round((fold + compare) / off, 4),
    )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
