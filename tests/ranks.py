"""Run one function per rank in real processes joined by a rendezvous store, and collect results.

Results travel back as JSON strings through the store (no pickle); the harness fails a test with
each rank's error text if any rank raised (and what every other rank answered), and kills
stragglers after the timeout.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import traceback
import uuid
from collections.abc import Callable
from typing import Any

import torch

from ckpt_engine.engine import Rendezvous
from ckpt_engine.benchmark.processes import run_processes
from ckpt_engine.store import serve_store


def _entry(fn: Callable[..., Any], rank: int, rdzv: dict[str, Any], kwargs: dict[str, Any]) -> None:
    r = Rendezvous.from_dict(rdzv)
    store = r.connect_store()
    try:
        torch.set_num_threads(1)
        result = {"ok": True, "value": fn(rank, r, **kwargs)}
    except BaseException as exc:  # report every failure to the parent
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
    store.set(f"result/{rank}", json.dumps(result))


PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "ckpt_engine.manifest", "ckpt_engine.rollout_adapters.torch_ref", "ranks", "refengines", "helpers_procs"]
"""What the test session's one fork server imports before its first fork: every CPU rank and every
reference engine the tests start forks from it (a spawned process imports torch again: seconds of
CPU each on a 2-core box; `torch._dynamo` is what the first optimizer a rank builds imports, as
long again). The server is process-wide, so the first caller's list wins: every caller starts
with this one."""


def forkserver_context() -> mp.context.BaseContext:
    """The multiprocessing context whose processes fork from the preloaded server."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _context(backend: str) -> mp.context.BaseContext:
    """CPU ranks fork from the preloaded server (the device backends run on CPU too where no
    accelerator is present); ranks of a device backend on an accelerator are spawned."""
    if backend in ("nccl", "hccl", "nccl_handoff", "colocated") and torch.cuda.is_available():
        return mp.get_context("spawn")
    return forkserver_context()


def run_ranks(
    fn: Callable[..., Any], world_size: int, backend: str = "gloo", timeout_s: float = 60.0, num_senders: int = 1, **kwargs: Any
) -> list[Any]:
    """Start `world_size` processes running fn(rank, rendezvous, **kwargs); return their values.
    Ranks [0, num_senders) are the weight-sync group's senders."""
    master = serve_store("127.0.0.1", timeout_s)
    rdzv = Rendezvous("127.0.0.1", master.port, uuid.uuid4().hex, world_size, backend, timeout_s, num_senders)
    ctx = _context(backend)
    procs = [ctx.Process(target=_entry, args=(fn, r, rdzv.to_dict(), kwargs)) for r in range(world_size)]
    run_processes(procs, timeout_s * 2)
    store = rdzv.connect_store()
    out, errors, answers = [], [], []
    for r in range(world_size):
        if not store.check([f"result/{r}"]):
            errors.append(f"rank {r} reported nothing (exit code {procs[r].exitcode})")
            continue
        res = json.loads(store.get(f"result/{r}"))
        if res["ok"]:
            out.append(res["value"])
            answers.append(f"rank {r} answered: {json.dumps(res['value'])[:2000]}")
        else:
            errors.append(f"rank {r} failed: {res['error']}\n{res['trace']}")
    if errors:  # what the other ranks answered often says why this one failed (a peer that left early)
        raise AssertionError("\n".join(errors + answers))
    return out
