"""The reference receiver's process: `python -m ckpt_engine.rollout_adapters.torch_ref` serves one
`TorchRefWorker` on a control port (`ckpt_engine.control.server`), with the job token it was started
with, until its parent goes away. `TorchRefRollout.spawn` starts it and reads its ready line.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading

from ckpt_engine.control.server import RpcServer
from ckpt_engine.rollout_adapters.torch_ref.models import RefModel
from ckpt_engine.rollout_adapters.torch_ref.worker import TorchRefWorker

__all__ = ["LAYOUT_KEYS", "READY_PREFIX", "TOKEN_ENV", "arguments", "main"]

READY_PREFIX = "CKPT_ENGINE_READY port="
TOKEN_ENV = "CKPT_ENGINE_TOKEN"
"""The job token reaches a spawned receiver through its environment, never its command line."""

LAYOUT_KEYS = ("tp_size", "tp_rank", "ep_size", "ep_rank", "num_kv_heads", "fused_experts")


def arguments(
    *, spec_file: str | None, model_dir: str | None, dtype: str, load_delay_s: float, port: int, staging_budget_bytes: int | None,
    step_interval_s: float | None, layout: dict[str, int] | None,
) -> list[str]:
    """`main`'s arguments for one receiver (see `TorchRefRollout.spawn`); bad input refused by name."""
    if (spec_file is None) == (model_dir is None):
        raise ValueError("give exactly one of spec_file or model_dir")
    argv = ["--load-delay-s", str(load_delay_s), "--port", str(port)]
    argv += ["--spec-file", spec_file] if spec_file else ["--model-dir", str(model_dir), "--dtype", dtype]
    if staging_budget_bytes is not None:
        argv += ["--staging-budget-bytes", str(int(staging_budget_bytes))]
    if step_interval_s is not None:
        argv += ["--step-interval-s", str(float(step_interval_s))]
    for key, value in (layout or {}).items():
        if key not in LAYOUT_KEYS or not isinstance(value, int):
            raise ValueError(f"layout keys are {', '.join(LAYOUT_KEYS)} with int values, got {key}={value!r}")
        argv += [f"--{key.replace('_', '-')}", str(value)]
    return argv


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="ckpt-engine reference receiver process")
    p.add_argument("--spec-file")
    p.add_argument("--model-dir")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--load-delay-s", type=float, default=0.0, help="sleep per bucket (emulates a slow loader)")
    p.add_argument("--port", type=int, default=0, help="control port (0: a free one)")
    p.add_argument("--staging-budget-bytes", type=int, default=None, help="cap on a dense staging copy (default: free memory)")
    p.add_argument("--step-interval-s", type=float, default=None, help="run engine steps this far apart (default: none)")
    for key in LAYOUT_KEYS:
        p.add_argument(f"--{key.replace('_', '-')}", type=int, default=None, help="hold only this TP / EP rank's slices (see tp_ep_plan)")
    args = p.parse_args(argv)
    logging.basicConfig(level=os.environ.get("CKPT_ENGINE_LOG", "WARNING"))
    token = os.environ.pop(TOKEN_ENV, "")
    if len(token) < 8:
        print(f"ckpt-engine reference receiver: set {TOKEN_ENV} to the job token (at least 8 characters)", file=sys.stderr)
        sys.exit(2)
    layout = {k: getattr(args, k) for k in LAYOUT_KEYS if getattr(args, k) is not None}
    kw = {"load_delay_s": args.load_delay_s, "staging_budget_bytes": args.staging_budget_bytes, "step_interval_s": args.step_interval_s}
    model = RefModel.from_spec_file(args.spec_file, layout) if args.spec_file else RefModel.from_hf_config(args.model_dir, args.dtype, layout)
    worker = TorchRefWorker.of(model, **kw)
    server = RpcServer(worker.handlers(), token=token, port=args.port).start()
    print(f"{READY_PREFIX}{server.port}", flush=True)
    parent = os.getppid()
    while os.getppid() == parent:  # exit when the parent goes away (stdin is not used)
        threading.Event().wait(1.0)
