"""Run a function on N real gloo ranks (real processes) and collect what each rank returns.

The parent hosts the TCPStore on a port the OS picks and keeps it until the ranks exit, so no
port is guessed. Ranks return `{"tensors": {name: tensor}, **json_values}`; results come back as
safetensors + JSON files (no pickle between processes). Every wait has a deadline.
"""

from __future__ import annotations

import datetime
import json
import os
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ckpt_engine.benchmark.processes import run_processes
from ranks import PRELOAD
from ckpt_engine.store import serve_store


def _entry(
    fn: Callable[..., dict[str, Any]], rank: int, world_size: int, port: int, out_dir: str, timeout_s: float, backend: str, kwargs: dict[str, Any]
) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)  # same kernels/blocking in every process: bit-exact parity needs it
    try:
        store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
        result = fn(rank, world_size, **kwargs) or {}
        tensors = {k: v.detach().cpu().clone() for k, v in (result.pop("tensors", None) or {}).items()}
        if tensors:
            from safetensors.torch import save_file

            save_file(tensors, os.path.join(out_dir, f"rank{rank}.safetensors"))
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
        dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise


def cases_in_one_run(rank: int, world_size: int, *, worker: Callable[..., dict[str, Any]], cases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """`worker(rank, world_size, **kwargs)` for every case in turn, in one pair of ranks (each rank
    imports megatron-core and transformers once, not once per case): each case's result under its
    name, its tensors under "tensors" as "case:name"."""
    out: dict[str, Any] = {"tensors": {}}
    for case, kwargs in cases.items():
        res = worker(rank, world_size, **kwargs)
        out["tensors"].update({f"{case}:{k}": v for k, v in res.pop("tensors", {}).items()})
        out[case] = res
    return out


def run_ranks(
    fn: Callable[..., dict[str, Any]],
    world_size: int = 2,
    timeout_s: float = 240.0,
    backend: str = "gloo",
    preload: tuple[str, ...] = (),
    **kwargs: Any,
) -> list[dict[str, Any]]:
    """Spawn `world_size` ranks running `fn(rank, world_size, **kwargs)`; returns their results.

    backend "nccl" puts rank r on cuda:r (GPU tests; spawned). CPU ranks fork from the test
    session's one fork server (tests/ranks.py), instead of each spawned rank importing torch
    again (seconds of CPU per rank on a small shared box). `preload`: more modules for that
    server to import once; they take effect only if this call starts it (the first in the
    process), else each rank imports them itself."""
    store = serve_store("127.0.0.1", timeout_s, world_size=world_size + 1)
    if backend != "nccl":
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload([*PRELOAD, *preload])
    else:
        ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as out_dir:
        procs = [
            ctx.Process(target=_entry, args=(fn, r, world_size, store.port, out_dir, timeout_s, backend, kwargs), daemon=True)
            for r in range(world_size)
        ]
        hung = run_processes(procs, timeout_s)
        errors = []
        for r in range(world_size):
            err = os.path.join(out_dir, f"rank{r}.err")
            if os.path.exists(err):
                errors.append(f"rank {r}:\n{open(err).read()}")
        if errors:
            raise AssertionError("\n".join(errors))
        if hung:
            raise AssertionError(f"ranks {hung} did not finish within {timeout_s}s")
        bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
        if bad:
            raise AssertionError(f"ranks exited with codes {bad}")
        results = []
        for r in range(world_size):
            with open(os.path.join(out_dir, f"rank{r}.json")) as f:
                res = json.load(f)
            st = os.path.join(out_dir, f"rank{r}.safetensors")
            if os.path.exists(st):
                from safetensors.torch import load_file

                res["tensors"] = load_file(st)
            results.append(res)
        return results


def world_group() -> dist.ProcessGroup:
    """The group the spawned ranks share (passed explicitly to the engines under test)."""
    group = dist.group.WORLD
    assert group is not None
    return group


def lm_loss(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Next-token cross-entropy, the loss the Megatron and Megatron-FSDP GPU tests train with."""
    ids = batch["input_ids"]
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))
