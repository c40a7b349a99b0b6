"""The project's vLLM worker extension plus one bench-only method: a raw NCCL broadcast into the
worker over vLLM's own trainer group (its weight-transfer engine's communicator), so that `raw`
in bench/vllm_sync_bench.py is measured on the very link, GPUs and processes the syncs use."""

from __future__ import annotations

import importlib
import time

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
