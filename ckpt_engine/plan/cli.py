"""``ckpt-engine plan``: predict one sync's time on a cluster we do not have.

    ckpt-engine plan --model kimi-k2 --trainer 256xH800 --rollout 16x8xH800 --nic-gbps 400 \\
        --strategy all-senders --delta 0.02 [--json] [--sweep bucket_mb=64,256,1024]
    ckpt-engine plan --calibrate bench/results/h200x2 bench/results/fsdp2_export_7b.json --out cal.json
    ckpt-engine plan --validate bench/results --out bench/plan/validation.md
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from ckpt_engine.plan.advise import advise
from ckpt_engine.plan.calibrate import calibrate, link_efficiency
from ckpt_engine.plan.cost import BACKENDS, EXPORTS, LOADERS, PARALLEL_SETS, PIPELINED, RECEIVES, STRATEGIES, Prediction, predict
from ckpt_engine.plan.model_shapes import MODEL_PRESETS
from ckpt_engine.plan.params import Calibration, load_calibration
from ckpt_engine.plan.peer_join import predict_join
from ckpt_engine.plan.published import fit_vllm_loader
from ckpt_engine.plan.scenario import Scenario
from ckpt_engine.plan.sweep import parse_sweep, run_sweep, write_sweep
from ckpt_engine.plan.validate import measured_rows, published_rows, pull_rows, to_markdown

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    """Bad input: one line naming the flag and what it accepts, exit 2, no usage dump."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"ckpt-engine plan: error: {message}\n")
        raise SystemExit(2)


def _positive(kind: type[float] | type[int]) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
        return value

    parse.__name__ = kind.__name__
    return parse


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="ckpt-engine plan", description="Predict the time of one weight sync (stages, bottleneck, total).")
    p.add_argument("--model", default="qwen2.5-7b", help=f"preset ({', '.join(MODEL_PRESETS)}) or path to an HF config.json")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "fp8"), help="wire dtype (fp8 = block-FP8 weights + float32 scales)")
    p.add_argument("--trainer", default="8xH100", help="GPUSxTYPE[:tp=N,pp=N,ep=N], e.g. 256xH800 (FSDP) or 64xH20:tp=4,pp=4")
    p.add_argument("--rollout", default="1x8xH100", help="ENGINESxGPUS_PER_ENGINExTYPE, e.g. 16x8xH800")
    p.add_argument("--nic-gbps", type=_positive(float), default=None, help="NIC line rate per GPU in Gb/s (bits; 400 = 50 GB/s); default from the GPU type")
    p.add_argument("--nvlink-gbs", type=_positive(float), default=None, help="NVLink GB/s per GPU per direction; default from the GPU type")
    p.add_argument("--pcie-gbs", type=_positive(float), default=None, help="host-to-device GB/s per GPU (--export host)")
    p.add_argument("--gpus-per-node", type=_positive(int), default=8)
    p.add_argument("--same-node", action="store_true", help="trainer and rollout GPUs share one NVLink node")
    p.add_argument("--strategy", default="single", choices=STRATEGIES, help="single sender (rank 0) or every trainer rank sends its shard")
    p.add_argument("--senders", type=_positive(int), default=None, help="all-senders: how many ranks send (default: every distinct shard)")
    p.add_argument("--delta", type=float, default=None, help="send a delta: fraction of elements changed per sync, in [0, 1]")
    p.add_argument("--bucket-mb", type=_positive(float), default=1024.0)
    p.add_argument("--buffers", type=_positive(int), default=2)
    p.add_argument("--loader", default="vllm", choices=LOADERS, help="receiver: vllm (load_weights + pause + finalize), ref, copy, inplace")
    p.add_argument("--export", default="gather", choices=EXPORTS, help="how the sender gets whole tensors")
    p.add_argument("--receive", default="full", choices=RECEIVES, help="every engine GPU receives every byte (full) or only its shard")
    p.add_argument("--fused-experts", action="store_true", help="send routed experts stacked, one tensor per layer and projection (receivers that hold them so)")
    p.add_argument("--parallel-sets", type=_positive(int), default=PARALLEL_SETS, help=f"--receive shard: receiver sets streamed side by side (ckpt-engine: {PARALLEL_SETS})")
    p.add_argument("--backend", default="nccl", choices=BACKENDS, help="nccl: a broadcast (ring); nixl: one-sided pulls, and a late joiner's time to serve from a peer")
    p.add_argument("--calibration", default=None, help="calibration JSON (default: the checked-in fit of bench/results/)")
    p.add_argument("--json", action="store_true", help="print the prediction as JSON")
    p.add_argument("--sweep", default=None, help="SETTING=V1,V2,...: predict each value, write JSON + PNG to --out-dir")
    p.add_argument("--out-dir", default="bench/plan", help="where --sweep writes (default bench/plan)")
    p.add_argument("--calibrate", nargs="+", default=None, metavar="PATH", help="fit the constants to these bench files/directories")
    p.add_argument("--validate", nargs="*", default=None, metavar="PATH", help="predicted vs measured for bench files (default bench/results) and vs published figures")
    p.add_argument("--out", default=None, help="--calibrate: JSON to write; --validate: markdown to write")
    return p


def _scenario(args: argparse.Namespace) -> Scenario:
    return Scenario(
        model=args.model, dtype=args.dtype, trainer=args.trainer, rollout=args.rollout, nic_gbps=args.nic_gbps,
        nvlink_gbs=args.nvlink_gbs, pcie_gbs=args.pcie_gbs, gpus_per_node=args.gpus_per_node, same_node=args.same_node,
        strategy=args.strategy, senders=args.senders, delta=args.delta, bucket_mb=args.bucket_mb, buffers=args.buffers,
        loader=args.loader, export=args.export, receive=args.receive, fused_experts=args.fused_experts,
        parallel_sets=args.parallel_sets, backend=args.backend,
    )


def format_table(scenario: Scenario, p: Prediction, cal: Calibration) -> str:
    """The human-readable answer: set-up, stages, bottleneck, total."""
    s = scenario.setup()
    m, links = s.model, s.links
    head = [
        f"model     {m.name} ({m.dtype}): {m.total_bytes / 1e9:,.1f} GB, {m.num_tensors:,} tensors, {m.num_params / 1e9:,.1f} B params",
        f"trainer   {scenario.trainer} ({s.trainer.num_shards} distinct shards)   rollout   {s.rollout.num_engines} engines x {s.rollout.gpus_per_engine} {s.rollout.gpu.name}",
        f"links     NIC {links.nic_gbs * 8:g} Gb/s ({links.nic_gbs:g} GB/s) per GPU, NVLink {links.nvlink_gbs:g} GB/s, {links.gpus_per_node} GPUs/node"
        + (", one node" if links.same_node else ""),
        f"strategy  {s.strategy} ({p.num_senders} sender{'s' if p.num_senders > 1 else ''}), receive {s.receive}, "
        + (f"delta {s.delta:g} -> {p.wire_bytes / 1e9:,.1f} GB on the wire, " if s.delta is not None else "")
        + f"{p.num_buckets} bucket(s) of {scenario.bucket_mb:g} MiB per sender, {s.num_buffers} buffers, loader {s.loader}",
        "",
        f"{'stage':<10}{'seconds':>10}  {'':<10}",
    ]
    rows = [f"{name:<10}{sec:>10.4f}  {'pipelined' if name in PIPELINED else 'serial':<10}{'  <- bottleneck' if name == p.bottleneck else ''}" for name, sec in p.stages.items()]
    tail = [
        f"{'total':<10}{p.total_s:>10.4f}  bottleneck: {p.bottleneck}",
        f"receiver ingress bound {p.receiver_ingress_s:.4f} s (no strategy moves these bytes faster)",
    ]
    tail += [f"note: {n}" for n in p.notes]
    if s.backend == "nixl":
        j = predict_join(s.model, s.rollout, s.links, cal)
        tail += [
            f"pull      each read should reach {p.detail['pull_link_gbs']:.1f} GB/s per link (a floor for nixl's min_gbps: a fraction of it)",
            f"join      a late joiner serves in {j.total_s:.2f} s: {j.bytes_per_rank / 1e9:,.1f} GB per rank over {j.link} in {j.read_s:.2f} s "
            f"+ checksums {j.check_s:.2f} s (peer's {j.peer_check_s:.2f} s, once per version) + fixed {j.fixed_s + j.window_s:.2f} s; "
            f"without the checksums {j.without_checksums_s:.2f} s (issue 43's bar: {j.bar_s:.2f} s)",
            "          (modelled; measured runs of nixl on 2xH200: bench/RESULTS.md, docs/planner.md)",
        ]
    return "\n".join(head + rows + [""] + tail)


def _calibrate(args: argparse.Namespace) -> int:
    cal = fit_vllm_loader(calibrate(args.calibrate, base=Calibration()))
    text = json.dumps(cal.to_json(), indent=1) + "\n"
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    summary = {k: getattr(cal, k) for k in ("nvlink_eff", "msg_latency_s", "bucket_overhead_s", "packed_tensor_s", "copy_interference",
                                             "export_eff", "export_unit_s", "export_tensor_s", "load_tensor_s", "vllm_load_tensor_s")}
    print(json.dumps(summary, indent=1) if args.json else "\n".join(f"{k:<20} {v:.6g}" for k, v in summary.items()))
    if not args.json:
        print("link efficiency per message size (H200 NVLink): " + ", ".join(
            f"{mb} MiB {link_efficiency(cal, 'H200', mb * 2**20):.3f}" for mb in (1, 16, 64, 256, 1024)))
        print(f"fitted on {len(cal.sources)} sources" + (f"; written to {args.out}" if args.out else ""))
    return 0


def _validate(args: argparse.Namespace, cal: Calibration) -> int:
    paths = args.validate if args.validate else ["bench/results"]
    command = "ckpt-engine plan --validate " + " ".join(paths) + (f" --out {args.out}" if args.out else "")
    text = to_markdown(measured_rows(paths, cal), published_rows(cal), command, pull_rows(cal))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    print(text, end="")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.calibrate is not None:
            return _calibrate(args)
        cal = load_calibration(args.calibration)
        if args.validate is not None:
            return _validate(args, cal)
        scenario = _scenario(args)
        if args.sweep is not None:
            key, values = parse_sweep(args.sweep)
            result = run_sweep(scenario, key, values, cal)
            stem = f"sweep_{Path(args.model).stem}_{key}"
            json_path, png_path = write_sweep(result, Path(args.out_dir), stem)
            if args.json:
                print(json.dumps(result, indent=1))
            else:
                for pt in result["points"]:
                    print(f"{key}={pt[key]:<10g} total {pt['total_s']:.4f} s  bottleneck {pt['bottleneck']}")
                print(f"best {key}={result['best'][key]:g} ({result['best']['total_s']:.4f} s); wrote {json_path} and {png_path}")
            return 0
        prediction = predict(scenario.setup(), cal)
        hints = advise(scenario, cal)
        if args.json:
            advice = [{"flag": a.flag, "total_s": a.total_s, "speedup": a.speedup, "status": a.status} for a in hints]
            setup = scenario.setup()
            join = predict_join(setup.model, setup.rollout, setup.links, cal).to_json() if setup.backend == "nixl" else None
            print(json.dumps({"scenario": vars(replace(scenario)), **prediction.to_json(), "advice": advice, "join": join}, indent=1))
        else:
            print(format_table(scenario, prediction, cal))
            for a in hints:
                print(f"faster: {a.flag:<24} {a.total_s:.4f} s ({a.speedup:.1f}x; {a.status})")
        return 0
    except (ValueError, RuntimeError) as exc:
        sys.stderr.write(f"ckpt-engine plan: error: {exc}\n")
        return 2
    except OSError as exc:  # --out, --out-dir: a path that cannot be written
        sys.stderr.write(f"ckpt-engine plan: error: cannot write the results: {exc}\n")
        return 2
