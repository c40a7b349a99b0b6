"""The fully-async job on real processes: vLLM `api_server` engines + an FSDP2 trainer on N gloo ranks.

The launcher (`run_vllm_job`, in the `ckpt-engine demo` process):

1. writes a tiny Qwen2 `config.json` into a temp dir (vLLM loads dummy weights, the trainer
   initializes its own; the first sync replaces vLLM's),
2. starts `rollout.num_engines` vLLM servers (free ports from the OS, dev mode + our worker
   extension + `--enable-scale-out` for token-in/token-out generation),
3. hosts the trainer group's TCPStore (free port) and starts `trainer.world_size` rank processes
   (`python -m ckpt_engine.trainer.vllm_job --rank r ...`; the job config travels as a JSON file,
   the result comes back as JSON: nothing is pickled),
4. waits for them within `trainer.job_timeout_s`, then tears everything down.

Rank 0 embeds the `WeightSyncDaemon`, registers every engine by descriptor (engine kind `vllm`),
runs `FullyAsyncTrainer` with `VllmServerGenerator`s and leads the other ranks
(`ckpt_engine.trainer.ranks`); the other ranks follow.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ckpt_engine.trainer.config import JobConfig
from ckpt_engine.trainer.tiny_qwen2 import TINY_QWEN2
from ckpt_engine.trainer.ports import free_port
from ckpt_engine.store import serve_store

__all__ = ["run_vllm_job", "write_model_dir"]

logger = logging.getLogger(__name__)

WORKER_EXTENSION = "ckpt_engine.rollout_adapters.vllm.worker.CkptEngineWorkerExtension"
ENGINE_ARGS = ["--max-model-len", "64", "--max-num-seqs", "32", "--gpu-memory-utilization", "0.05"]


def write_model_dir(path: Path, overrides: dict[str, Any], min_vocab: int) -> Path:
    config = {**TINY_QWEN2, **overrides}
    if int(config["vocab_size"]) < min_vocab:
        raise ValueError(f"rollout.model.vocab_size={config['vocab_size']} cannot hold the task's tokens; it needs >= {min_vocab}")
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


class VllmServerProcess:
    """One `python -m vllm.entrypoints.openai.api_server` in its own process group, log to a file."""

    def __init__(self, model_dir: Path, log: Path, extra_args: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--host", "127.0.0.1",
            "--port", str(self.port), "--load-format", "dummy", "--skip-tokenizer-init", "--enforce-eager", "--dtype", "float32",
            "--enable-scale-out", "--worker-extension-cls", WORKER_EXTENSION, *ENGINE_ARGS, *extra_args,
        ]
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def wait_healthy(url: str, deadline: float, log: str | None = None) -> None:
    """Poll `/health` until it answers 200; raise (with the log's tail) past `deadline`."""
    import requests

    while True:
        try:
            if requests.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        if time.monotonic() > deadline:
            tail = Path(log).read_text(errors="replace")[-2000:] if log and Path(log).exists() else ""
            raise RuntimeError(f"vLLM engine at {url} did not become healthy in time\n{tail}")
        time.sleep(0.5)


# --- launcher --------------------------------------------------------------------------------------
def run_vllm_job(job: JobConfig, *, echo: bool = True) -> dict[str, Any]:
    """Run the job on real processes; returns rank 0's summary (see `_lead`)."""
    from ckpt_engine.trainer.lm_task import TokenTask

    if job.trainer.backend != "fsdp2":
        raise ValueError(f"rollout.engine=vllm trains with trainer.backend=fsdp2, got {job.trainer.backend!r}")
    world = job.trainer.world_size
    t_start = time.monotonic()
    deadline = t_start + job.trainer.job_timeout_s
    servers: list[VllmServerProcess] = []
    ranks: list[subprocess.Popen[bytes]] = []
    store = None
    with tempfile.TemporaryDirectory(prefix="ckpt-demo-") as tmp_name:
        tmp = Path(tmp_name)
        try:
            model_dir = write_model_dir(tmp / "model", job.rollout.model, TokenTask(job.rollout.vocab_size).min_model_vocab())
            for i in range(job.rollout.num_engines):
                servers.append(VllmServerProcess(model_dir, tmp / f"vllm{i}.log", job.rollout.engine_args))
            if echo:
                print(f"starting {len(servers)} vLLM engine(s) ({', '.join(s.url for s in servers)}) and {world} FSDP2 trainer rank(s)", flush=True)
            (tmp / "job.json").write_text(json.dumps(dataclasses.asdict(job)))
            store = serve_store("127.0.0.1", job.trainer.job_timeout_s, world_size=world + 1)
            spec = {"model_dir": str(model_dir), "urls": [s.url for s in servers], "logs": [str(s.log) for s in servers], "t_start": time.time()}
            (tmp / "spec.json").write_text(json.dumps(spec))
            for r in range(world):
                cmd = [
                    sys.executable, "-m", "ckpt_engine.trainer.vllm_job", "--rank", str(r), "--world-size", str(world),
                    "--store-port", str(store.port), "--dir", str(tmp), "--echo" if echo else "--quiet",
                ]
                ranks.append(subprocess.Popen(cmd, env=dict(os.environ, OMP_NUM_THREADS="1")))
            failed = _wait_ranks(ranks, deadline)
            result_file = tmp / "result.json"
            if failed or not result_file.exists():
                logs = "".join(f"\n--- {s.log.name} (tail) ---\n{s.log.read_text(errors='replace')[-1500:]}" for s in servers if s.log.exists())
                raise RuntimeError(f"the trainer ranks failed: {failed or 'rank 0 wrote no result'}{logs}")
            result: dict[str, Any] = json.loads(result_file.read_text())
            result["wall_s"] = time.monotonic() - t_start
            return result
        finally:
            for p in ranks:
                if p.poll() is None:
                    p.kill()
                    p.wait(10)
            for s in servers:
                s.stop()
            del store


def _wait_ranks(ranks: list[subprocess.Popen[bytes]], deadline: float) -> dict[int, str]:
    """Wait for every rank; a failed rank ends the wait at once (its peers would only time out)."""
    failed: dict[int, str] = {}
    while any(p.poll() is None for p in ranks):
        for r, p in enumerate(ranks):
            if p.poll() not in (None, 0):
                failed[r] = f"exit code {p.returncode}"
        if failed:
            return failed
        if time.monotonic() > deadline:
            return {r: "still running at trainer.job_timeout_s" for r, p in enumerate(ranks) if p.poll() is None}
        time.sleep(0.2)
    return {r: f"exit code {p.returncode}" for r, p in enumerate(ranks) if p.returncode != 0}


# --- one trainer rank ------------------------------------------------------------------------------
def _rank_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ckpt_engine.trainer.vllm_job", description="one trainer rank of the vLLM + FSDP2 job")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--store-port", type=int, required=True)
    p.add_argument("--dir", required=True, help="the launcher's job directory (job.json, spec.json; result.json is written here)")
    p.add_argument("--echo", action="store_true")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=os.environ.get("CKPT_ENGINE_LOG", "WARNING"), stream=sys.stderr, format=f"[rank{args.rank}] %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)

    import torch.distributed as dist

    from ckpt_engine.trainer.config import load_job_config
    from ckpt_engine.trainer.lm_task import TokenTask
    from ckpt_engine.trainer.engines.common import hf_model_from_config
    from ckpt_engine.trainer.engines.fsdp2 import FSDP2Config, FSDP2TrainEngine

    job_dir = Path(args.dir)
    job = load_job_config(json.loads((job_dir / "job.json").read_text()))
    spec = json.loads((job_dir / "spec.json").read_text())
    # Every collective waits at most this long: a batch, a whole sync with its re-sync attempts.
    group_timeout_s = job.trainer.batch_timeout_s + 6 * job.checkpoint_engine.timeout_s * (job.daemon.max_resync_attempts + 1)
    timeout = datetime.timedelta(seconds=min(group_timeout_s, job.trainer.job_timeout_s))
    store = dist.TCPStore("127.0.0.1", args.store_port, args.world_size + 1, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=args.rank, world_size=args.world_size, timeout=timeout)
    try:
        group = dist.group.WORLD
        assert group is not None
        task = TokenTask(job.rollout.vocab_size)
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(spec["model_dir"])
        torch.manual_seed(job.trainer.seed)  # identical initial weights on every rank
        model = hf_model_from_config(hf_config, torch.float32, attn_implementation="eager")
        kwargs = {"lr": job.trainer.lr, "wire_dtype": None, **job.trainer.engine_kwargs}
        engine = FSDP2TrainEngine(model, config=FSDP2Config(**kwargs), process_group=group)
        if args.rank == 0:
            result = _lead(job, engine, group, task, spec, echo=args.echo)
            (job_dir / "result.json.tmp").write_text(json.dumps(result))
            os.replace(job_dir / "result.json.tmp", job_dir / "result.json")
        else:
            from ckpt_engine.trainer.ranks import follow_leader

            follow_leader(engine, group, task, job.checkpoint_engine)
    finally:
        dist.destroy_process_group()
    return 0


def _lead(job: JobConfig, engine: Any, group: Any, task: Any, spec: dict[str, Any], *, echo: bool) -> dict[str, Any]:
    """Rank 0: daemon, engines, generators, the loop; returns the summary."""
    from ckpt_engine.daemon import WeightSyncDaemon
    from ckpt_engine.trainer.summary import format_summary, format_sync, greedy_answers, summarize
    from ckpt_engine.trainer.loop import FullyAsyncTrainer, SyncRecord
    from ckpt_engine.trainer.ranks import DataParallelLeader
    from ckpt_engine.trainer.vllm_rollout import VllmServerGenerator

    say = (lambda *a: print(*a, flush=True)) if echo else (lambda *a: None)
    leader = DataParallelLeader(engine, group)
    daemon = WeightSyncDaemon(job.checkpoint_engine, job.daemon)
    generators: list[VllmServerGenerator] = []
    try:
        daemon.serve()
        say(f"daemon at {daemon.address} (ckpt-engine status --address {daemon.address} --token {daemon.token})")
        t0 = time.monotonic()
        for i, (url, log) in enumerate(zip(spec["urls"], spec["logs"])):
            wait_healthy(url, t0 + job.rollout.start_timeout_s, log)
            name = f"vllm{i}"
            daemon.register(name, {"kind": "vllm", "url": url, "world_size": 1})
            generators.append(VllmServerGenerator(name, url, task, timeout_s=job.checkpoint_engine.timeout_s))
        say(f"{len(generators)} vLLM engine(s) up {time.time() - spec['t_start']:.1f}s after launch")

        def on_sync(rec: SyncRecord) -> None:
            say(format_sync(rec, trainer.steps[-1] if trainer.steps else None))

        trainer = FullyAsyncTrainer(job, leader, daemon, generators, on_sync=on_sync, task=task, peers=leader)
        trainer.sync(0, "initial")
        prompts = torch.arange(job.rollout.vocab_size)
        before = greedy_answers(generators, prompts)
        summary = trainer.run(initial_sync=False)
        after = greedy_answers(generators, prompts)
        result = summarize(job, summary, before, after, task.answer(prompts))
        result["engine_reported_versions"] = {g.name: g.weight_version() for g in generators}
        result["discarded_requests"] = {g.name: g.discarded for g in generators}
        for line in format_summary(job, result):
            say(line)
        return result
    finally:
        leader.stop()
        for g in generators:
            g.close()
        daemon.close()


if __name__ == "__main__":
    sys.exit(_rank_main())
