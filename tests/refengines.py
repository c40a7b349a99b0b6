"""Reference engines for the reliability tests: spawn, second handles, state checks."""

from __future__ import annotations

import inspect
import time
from collections.abc import Iterator

import torch

from ckpt_engine.rollout_adapters.torch_ref import TorchRefRollout
from ckpt_engine.sources.base import StateDictSource
from roundtrip import mixed_state, same_bits

NUM_SMALL = 20


def state(seed: int) -> dict[str, torch.Tensor]:
    return mixed_state(seed, num_small=NUM_SMALL)


def source(seed: int) -> StateDictSource:
    return StateDictSource(state(seed))


class SlowSource(StateDictSource):
    """Exports one tensor every `delay_s`: a sync surely streams for a while (faults land mid-stream)."""

    def __init__(self, seed: int, delay_s: float) -> None:
        super().__init__(state(seed))
        self.delay_s = delay_s

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for item in super().iter_weights():
            time.sleep(self.delay_s)
            yield item


def second_handle(engine: TorchRefRollout, timeout_s: float | None = None, *, own_process: bool = False) -> TorchRefRollout:
    """Another controller's handle on the same engine process (its own connections).

    With `own_process` the new handle also owns (and closes) the process."""
    kwargs = {"token": engine.token} if "token" in inspect.signature(TorchRefRollout.__init__).parameters else {}
    process = engine.process if own_process else None
    timeout = timeout_s if timeout_s is not None else engine.timeout_s
    return TorchRefRollout(engine.name, engine.rpc.host, engine.rpc.port, process, timeout, **kwargs)


def spawn_with_timeout(spec_file: str, name: str, timeout_s: float, load_delay_s: float = 0.0) -> TorchRefRollout:
    """A reference engine whose control calls time out after `timeout_s` (its start may take longer)."""
    started = TorchRefRollout.spawn(name, spec_file=spec_file, load_delay_s=load_delay_s, timeout_s=60)
    handle = second_handle(started, timeout_s, own_process=True)
    started.rpc.close()
    started._probe.close()
    return handle


def holds(engine: TorchRefRollout, sd: dict[str, torch.Tensor]) -> list[str]:
    """Names whose bytes in `engine` differ from `sd` ([] = bit-exact)."""
    return [n for n, t in sd.items() if not same_bits(engine.get_tensor(n), t)]


def serving(health: dict) -> bool:
    return not health["paused"] and not health["stale"]
