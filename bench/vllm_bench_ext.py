"""The project's vLLM worker extension plus one bench-only method: a raw NCCL broadcast into the
worker over vLLM's own trainer group (its weight-transfer engine's communicator), so that `raw`
in bench/vllm_sync_bench.py is measured on the very link, GPUs and processes the syncs use."""

from __future__ import annotations

import importlib
import time
from typing import Any

import torch

from ckpt_engine.rollout_adapters.vllm import WORKER_EXTENSION

_module, _, _cls = WORKER_EXTENSION.rpartition(".")
_Base = getattr(importlib.import_module(_module), _cls)


class BenchExtension(_Base):  # type: ignore[misc, valid-type]
    def bench_raw_receive(self, total_bytes: int, message_bytes: int) -> float:
        """Receive `total_bytes` as back-to-back broadcasts of `message_bytes` from the trainer (rank 0)."""
        group = self.weight_transfer_engine.model_update_group
        buf = torch.empty(message_bytes, dtype=torch.uint8, device=self.device)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        done = 0
        while done < total_bytes:
            n = min(message_bytes, total_bytes - done)
            group.broadcast(buf[:n], src=0, stream=torch.cuda.current_stream())
            done += n
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def bench_set_env(self, name: str, value: str) -> None:
        """Set a switch the worker reads per sync (`CKPT_ENGINE_VLLM_DIRECT`): a before/after in one run."""
        import os

        os.environ[name] = value

    def bench_memory(self) -> dict[str, float]:
        """GiB allocated now and at the peak since the last call (then reset): where a sync's memory goes."""
        gib = 2**30
        out = {"allocated": round(torch.cuda.memory_allocated() / gib, 2), "peak": round(torch.cuda.max_memory_allocated() / gib, 2),
               "reserved": round(torch.cuda.memory_reserved() / gib, 2)}
        torch.cuda.reset_peak_memory_stats()
        return out

    def bench_param_fold(self) -> dict[str, int]:
        """A position-weighted sum of each installed parameter's 16-bit words, on the GPU: equal for
        two syncs that installed the same bytes (a cheap stand-in for sha256 over 61 GB)."""
        model = self.model_runner.get_model()
        out = {}
        for name, t in model.named_parameters():
            flat = t.detach().contiguous().reshape(-1)
            words = (flat.view(torch.int16) if flat.element_size() == 2 else flat.view(torch.uint8)).long()
            weights = torch.arange(words.numel(), device=words.device) % 65521 + 1
            out[name] = int((words * weights).sum())
        return out

    # --- CPU receive-overhead bench (bench/vllm_receive_overhead.py) ---------------------------------
    def bench_specs(self) -> dict[str, list]:
        """The checkpoint tensors this worker's model needs: name -> [dtype, shape]."""
        return {n: [s.dtype, list(s.shape)] for n, s in self._ckpt_core().specs().needed.items()}

    def bench_floor(self, bucket_tensors: int, repeats: int) -> dict[str, float]:
        """The floor of a sync's receive side: the same tensors (random, one flat buffer per bucket
        as ours lands them) loaded by `model.load_weights`, `bucket_tensors` per call, inside vLLM's
        layerwise reload. Median seconds over `repeats`: load (every load_weights call) and total
        (incl. initialize/finalize)."""
        import statistics

        from ckpt_engine.sources.wire import torch_dtype

        core = self._ckpt_core()
        needed = core.specs().needed
        names = list(needed)
        buckets = []
        for i in range(0, len(names), bucket_tensors):
            group = [needed[n] for n in names[i : i + bucket_tensors]]
            sizes = [torch.Size(s.shape).numel() * torch.tensor([], dtype=torch_dtype(s.dtype)).element_size() for s in group]
            flat = torch.randn(sum(sizes) // 4 + 1).view(torch.uint8)
            out, off = [], 0
            for s, n in zip(group, sizes):
                out.append((s.name, flat[off : off + n].view(torch_dtype(s.dtype)).view(s.shape)))
                off += n
            buckets.append(out)
        model = self.model_runner.get_model()
        loads, totals = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            core.reload.open()
            load = 0.0
            with core.reload.loading():
                for b in buckets:
                    t1 = time.perf_counter()
                    model.load_weights(b)
                    load += time.perf_counter() - t1
            core.reload.close()
            loads.append(load)
            totals.append(time.perf_counter() - t0)
        return {"load": statistics.median(loads), "total": statistics.median(totals), "tensors": len(names), "buckets": len(buckets)}

    def bench_profile(self, action: str, path: str = "", top: int = 40) -> str:
        """cProfile this worker's rpc thread: action "start", or "stop" (writes `path`, returns the top
        `top` functions by cumulative and by own time)."""
        import cProfile
        import io
        import pstats

        if action == "start":
            self._bench_prof = cProfile.Profile()
            self._bench_prof.enable()
            return ""
        prof = self._bench_prof
        prof.disable()
        if path:
            prof.dump_stats(path)
        s = io.StringIO()
        st = pstats.Stats(prof, stream=s)
        st.sort_stats("cumulative").print_stats(top)
        st.sort_stats("tottime").print_stats(top)
        return s.getvalue()

    def bench_load(self, seed: int, scale: float = 1.0) -> None:
        """Load `bench_weights(..., seed) * scale` with `model.load_weights` in one call inside vLLM's
        layerwise reload (the reference a sync's result is compared with)."""
        core = self._ckpt_core()
        specs = {n: [s.dtype, list(s.shape)] for n, s in core.specs().needed.items()}
        weights = bench_weights(specs, seed)
        core.reload.open()
        with core.reload.loading():
            self.model_runner.get_model().load_weights([(n, t * scale) for n, t in weights.items()])
        core.reload.close()


def bench_weights(specs: dict[str, list], seed: int) -> dict[str, torch.Tensor]:
    """Random tensors for `bench_specs()`'s names, the same on the trainer and in the worker."""
    from ckpt_engine.sources.wire import torch_dtype

    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(shape, generator=g).to(torch_dtype(dtype)) for n, (dtype, shape) in specs.items()}


def time_engine_calls(handle: Any) -> list[tuple[str, float]]:
    """Wrap the in-process client of `handle` (a `VllmRollout`) so every engine call it makes is
    appended to the returned list as (name, seconds), in order; the caller clears it per sync. A
    call sent unwaited is timed to its send and named "<method> (unwaited)"."""
    calls: list[tuple[str, float]] = []
    client = handle.client
    depth = [0]  # an engine core in this process: `_utility` runs through `_bounded`, timed once

    def timed(wrapped: Any, name: Any) -> Any:
        def timed_call(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            depth[0] += 1
            try:
                return wrapped(*a, **k)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    calls.append((name(a), time.perf_counter() - t))

        return timed_call

    # every call of the in-process client goes through one of these
    client._bounded = timed(client._bounded, lambda a: a[0])
    client._utility = timed(client._utility, lambda a: a[0])
    client._send_unwaited = timed(client._send_unwaited, lambda a: f"{a[0]} (unwaited)")
    return calls
