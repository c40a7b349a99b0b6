"""Reference engines for the tests: started from the preloaded fork server, second handles,
state checks."""

from __future__ import annotations

import inspect
import secrets
import time
from collections.abc import Iterator

import torch

from ckpt_engine.rollout_adapters.torch_ref import serve
from ckpt_engine.rollout_adapters.torch_ref.load_gate import HOLD_ENV
from ckpt_engine.rollout_adapters.torch_ref import TorchRefRollout
from ckpt_engine.sources.base import StateDictSource
from _gate_fault_ref import FAULT_ENV
from helpers_procs import fork_program
from roundtrip import mixed_state, same_bits

NUM_SMALL = 20


def state(seed: int) -> dict[str, torch.Tensor]:
    return mixed_state(seed, num_small=NUM_SMALL)


def source(seed: int) -> StateDictSource:
    return StateDictSource(state(seed))


class BrokenSource(StateDictSource):
    """Yields `fail_after` tensors, then raises `error` (default: as a trainer that died mid-walk would)."""

    def __init__(self, sd: dict[str, torch.Tensor], fail_after: int, error: Exception | None = None) -> None:
        super().__init__(sd)
        self.fail_after = fail_after
        self.error = error if error is not None else RuntimeError("trainer died")

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for i, item in enumerate(super().iter_weights()):
            if i == self.fail_after:
                raise self.error
            yield item


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


def spawn_with_timeout(
    spec_file: str, name: str, timeout_s: float, load_delay_s: float = 0.0, stderr_path: str | None = None, hold_file: str | None = None,
    fault_file: str | None = None,
) -> TorchRefRollout:
    """A reference engine whose control calls time out after `timeout_s` (its start may take longer);
    `hold_file`: its loads wait while that file exists (load_gate.py); `fault_file`: a load that
    finds that file signals the engine as it says (tests/_gate_fault_ref.py)."""
    started = spawn_engine(
        name, spec_file=spec_file, load_delay_s=load_delay_s, timeout_s=60, stderr_path=stderr_path, hold_file=hold_file, fault_file=fault_file,
    )
    handle = second_handle(started, timeout_s, own_process=True)
    started.rpc.close()
    started._probe.close()
    return handle


def holds(engine: TorchRefRollout, sd: dict[str, torch.Tensor]) -> list[str]:
    """Names whose bytes in `engine` differ from `sd` ([] = bit-exact)."""
    return [n for n, t in sd.items() if not same_bits(engine.get_tensor(n), t)]


def serving(health: dict) -> bool:
    return not health["paused"] and not health["stale"]


def spawn_engine(
    name: str, *, spec_file: str | None = None, model_dir: str | None = None, dtype: str = "float32", load_delay_s: float = 0.0,
    timeout_s: float = 120.0, token: str | None = None, port: int = 0, stderr_path: str | None = None,
    layout: dict[str, int] | None = None, staging_budget_bytes: int | None = None, step_interval_s: float | None = None,
    handle: type[TorchRefRollout] = TorchRefRollout, hold_file: str | None = None, fault_file: str | None = None,
) -> TorchRefRollout:
    """`TorchRefRollout.spawn` for tests: the reference receiver's own `main` with the same
    arguments, in a process forked from the preloaded server (milliseconds) instead of a new
    interpreter that imports torch again (seconds of CPU on a 2-core box). `stderr_path` takes
    the engine's log; `handle`: the handle class to return (a test's subclass of TorchRefRollout);
    `fault_file`: the engine signals itself mid-stream when a load finds that file (_gate_fault_ref.py).
    (tests/test_control_server.py keeps one engine started by `spawn` itself.)"""
    argv = serve.arguments(
        spec_file=spec_file, model_dir=model_dir, dtype=dtype, load_delay_s=load_delay_s, port=port,
        staging_budget_bytes=staging_budget_bytes, step_interval_s=step_interval_s, layout=layout,
    )
    token = token if token is not None else secrets.token_hex(16)
    env = {serve.TOKEN_ENV: token, **({HOLD_ENV: hold_file} if hold_file else {}), **({FAULT_ENV: fault_file} if fault_file else {})}
    target = "_gate_fault_ref:main" if fault_file else "ckpt_engine.rollout_adapters.torch_ref.serve:main"
    program = fork_program(target, argv, f"engine-{name}", env=env, stderr_path=stderr_path)
    line = program.read_line(serve.READY_PREFIX, timeout_s)
    if line is None:
        program.process.kill()
        raise RuntimeError(f"reference receiver {name!r} did not start within {timeout_s}s (exit code {program.process.poll()})")
    return handle(name, "127.0.0.1", int(line[len(serve.READY_PREFIX):].strip()), program.process, timeout_s, token=token)
