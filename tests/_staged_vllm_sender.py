"""A trainer in its own process that streams one staged dense sync (`stage: full`) slowly into a vLLM
server, so a test can SIGKILL it mid-stream. Arguments: URL MODEL_DIR DELAY_S (seconds per tensor)
[native] (the server runs ckpt-engine as vLLM's weight-transfer backend: `VllmRollout` over a
`WeightTransferChannel`). It
prints `streaming` once its third tensor went out (the workers are then receiving).

It prints `ready` once torch is imported and its model built, then waits for `go` on stdin: the test
starts it before it loads the engine. torch's import pins the process to each CPU in turn (MKL
counts cores with cpuid), and on the 2-core box a busy vLLM worker pinned to CPU 0 held that import
for minutes."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from typing import Any

import torch
import transformers

from ckpt_engine import CheckpointEngineConfig, WeightSyncSession
from ckpt_engine.sources.base import StateDictSource
from ckpt_engine.rollout_adapters.vllm import VllmServerRollout


class _Slow(StateDictSource):
    """Not `stable_tensors`: a checked sync walks a stable source ahead of the stream (`fold_ahead`)
    and sends that walk, so its delays would all pass before anything streams."""

    stable_tensors = False

    def __init__(self, weights: dict[str, torch.Tensor], delay_s: float) -> None:
        super().__init__(weights)
        self.delay_s = delay_s

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for i, item in enumerate(super().iter_weights()):
            time.sleep(self.delay_s)
            yield item
            if i == 2:
                print("streaming", flush=True)


def main() -> None:
    url, model_dir, delay_s = sys.argv[1], sys.argv[2], float(sys.argv[3])
    torch.set_num_threads(1)  # the engine beside it owns the box's cores
    torch.manual_seed(99)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(model_dir), dtype=torch.float32)
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":  # EOF: the test ended without starting it
        return
    cfg = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.0625, timeout_s=20.0, stage="full")
    if sys.argv[4:] == ["native"]:
        from ckpt_engine.rollout_adapters.vllm import VllmRollout, WeightTransferChannel
        from ckpt_engine.rollout_adapters.vllm.clients import HTTPWeightSyncClient

        rollout: Any = VllmRollout("vllm-native", WeightTransferChannel(HTTPWeightSyncClient(url, timeout=60.0)), timeout_s=60.0)
    else:
        rollout = VllmServerRollout("vllm-staged", url, timeout_s=60.0)
    session = WeightSyncSession([rollout], cfg)
    session.sync(_Slow({n: t.detach() for n, t in model.state_dict().items()}, delay_s))
    print("synced", flush=True)


if __name__ == "__main__":
    main()
