"""Helpers for staged syncs into a real vLLM server: a handle that records its swaps, a stream of
greedy requests, HF references, and the steps that kill a sender mid-stage."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ckpt_engine.rollout_adapters.vllm import VllmServerRollout
from ckpt_engine.readable import readable
from ckpt_engine.sources.base import StateDictSource
from helpers_wait import wait_for

# head_dim 32: vLLM's CPU attention has no kernel for head_dim 16.
QWEN2_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 512, "hidden_size": 128,
    "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": True,
    "torch_dtype": "float32", "initializer_range": 0.2, "bos_token_id": 1, "eos_token_id": 2,
}
GENERATE_ROUTE = "/inference/v1/generate"


class PacedSource(StateDictSource):
    """A trainer's weights, handed over one tensor every `pace_s` (a slow gather): a staged stream
    then lasts long enough (about a second for the 26 tensors of QWEN2_CONFIG at 0.04 s) that a
    serving engine finishes requests while it streams, whatever the box's speed."""

    def __init__(self, weights: dict[str, torch.Tensor], pace_s: float = 0.04) -> None:
        super().__init__(weights)
        self.pace_s = pace_s

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for pair in super().iter_weights():
            time.sleep(self.pace_s)
            yield pair


def wait_for_outputs_beyond(stream: "RequestStream", served: int, timeout_s: float = 60.0) -> None:
    """Until the stream has finished more than `served` requests: the engine still serves. Bounded,
    not an instant check: a failure noticed quickly can leave no request time to finish."""
    deadline = time.monotonic() + timeout_s
    while len(stream.outputs) <= served:
        assert time.monotonic() < deadline, f"the engine finished no request in {timeout_s:.0f} s after {served}: it stopped serving"
        time.sleep(0.1)


def wait_for_outputs_since(stream: "RequestStream", since: float, count: int = 1, timeout_s: float = 60.0) -> None:
    """Until the stream finished `count` requests submitted after `since` (monotonic, e.g. once the
    last swap returned): the engine served the version it holds since then (a stream error ends
    the wait early; the test checks `stream.errors`)."""
    wait_for(
        f"the stream finished {count} request(s) submitted after the last swap",
        lambda: sum(o.submitted > since for o in list(stream.outputs)) >= count or bool(stream.errors), timeout_s,
    )


def start_waiting_sender(url: str, model_dir: Path, *extra: str, delay_s: float = 0.2) -> subprocess.Popen[str]:
    """The killed-sender trainer (`_staged_vllm_sender.py`, `delay_s` per tensor, `extra` arguments),
    started before anything loads the engine and left waiting for `go`: torch's import must not meet
    a busy engine on this box."""
    here = Path(__file__).parent
    sender = subprocess.Popen(
        [sys.executable, "-m", "_staged_vllm_sender", url, str(model_dir), str(delay_s), *extra],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=str(here),
        # One OpenMP thread: with two, torch's threads spin against the engine's for the same cores.
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")])),
    )
    assert sender.stdout is not None
    assert readable(sender.stdout, 240) and sender.stdout.readline().strip() == "ready", f"the sender did not start (exit code {sender.poll()})"
    return sender


def kill_sender_mid_stage(
    sender: subprocess.Popen[str], worker_health: Callable[[], list[dict[str, Any]]], stream: "RequestStream", noticed: str,
) -> int:
    """Start a waiting sender's staged sync (`go`, see _staged_vllm_sender.py), SIGKILL it once a
    worker's staged receive runs, and wait (bounded) until no worker's staged receive runs any more
    (`noticed`: the failure message otherwise) and the engine finished another request: it never
    stopped serving. Returns how many requests the stream had finished at the kill."""
    assert sender.stdin is not None
    sender.stdin.write("go\n")
    sender.stdin.flush()
    deadline = time.monotonic() + 240
    while not any((h["staged"] or {}).get("running") for h in worker_health()):
        assert sender.poll() is None and time.monotonic() < deadline, "the sender never started streaming"
        time.sleep(0.2)
    served = len(stream.outputs)
    sender.send_signal(signal.SIGKILL)
    sender.wait(60)
    deadline = time.monotonic() + 90
    while any((h["staged"] or {}).get("running") for h in worker_health()):
        assert time.monotonic() < deadline, noticed
        time.sleep(0.5)
    wait_for_outputs_beyond(stream, served)  # it never stopped serving
    return served


def write_model_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(QWEN2_CONFIG))
    return path


@contextmanager
def served_model(path: Path, port: int) -> Iterator[tuple[str, Path]]:
    """A vLLM `api_server` (dev mode) over the tiny Qwen2 written at `path`, on `port`: (its URL, the
    model dir). The demo's launch (`trainer/vllm_job.py`: dummy weights, the worker extension,
    `--enable-scale-out`, its engine limits) on a port the caller keeps, so a server started again
    answers at the same URL. This process keeps one torch thread: the HF reference must not fight the
    engine for the box's cores."""
    from ckpt_engine.rollout_adapters.vllm import WORKER_EXTENSION
    from ckpt_engine.trainer.vllm_job import ENGINE_ARGS
    from helpers_vllm import api_server

    torch.set_num_threads(1)
    d = write_model_dir(path)
    # 256 positions (the tiny model's), not the job's 64. The scheduler is vLLM's own plus one hook for tests
    # (`HoldingScheduler`) that only acts on requests that ask for it (`held_request_id`).
    extra = [
        "--enable-scale-out", "--worker-extension-cls", WORKER_EXTENSION, *ENGINE_ARGS, "--max-model-len", "256",
        "--scheduler-cls", f"{__name__}.HoldingScheduler",
    ]
    here = str(Path(__file__).parent)
    env = {"PYTHONPATH": os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p)}  # the engine core imports this module
    with api_server(d, d / "server.log", extra, port=port, start_timeout_s=240.0, env=env) as server:
        yield server.url, d


HOLD_MARK = "ckpt-test-hold-after-"
"""A request id holding this (`held_request_id`) asks `HoldingScheduler` to hold the request."""


def held_request_id(after_tokens: int) -> str:
    """The request id of a request that `HoldingScheduler` (the engine `served_model` starts) keeps in
    the engine, unscheduled, once it has `after_tokens` output tokens, until the scheduler is next
    paused: a swap's pause then finds it in flight however fast the engine decodes and however late
    the pause comes."""
    import uuid

    assert after_tokens >= 1, after_tokens
    return f"{HOLD_MARK}{after_tokens}-{uuid.uuid4().hex}"


def _holding_scheduler() -> type:
    """vLLM's `Scheduler` (the CPU platform's choice: no async scheduling) with one hook: a running
    request whose id holds `HOLD_MARK` (`held_request_id`) and that has its N output tokens is left
    out of each step (vLLM keeps a running request it does not schedule in a step, blocks and all, as
    when the token budget runs out) while no pause (`set_pause_state`) came since it arrived; after
    one it runs on as any other (a recompute swap preempts it first: it re-prefills under the new
    weights). A pause that lands before it has N tokens frees it too: the caller pauses only once the
    request's N tokens reached it (`InFlight.wait_tokens`). Every other request is scheduled exactly
    as by vLLM's `Scheduler`."""
    from vllm.v1.core.sched.interface import PauseState
    from vllm.v1.core.sched.scheduler import Scheduler

    pattern = re.compile(re.escape(HOLD_MARK) + r"(\d+)-")

    class HoldingScheduler(Scheduler):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._pauses = 0  # pauses so far
            self._arrived: dict[str, tuple[int, int]] = {}  # a marked request's id -> (its N, the pause count at its arrival)

        def add_request(self, request: Any) -> None:
            found = pattern.search(request.request_id)
            if found is not None:
                self._arrived[request.request_id] = (int(found.group(1)), self._pauses)
            super().add_request(request)

        def set_pause_state(self, pause_state: PauseState) -> None:
            if pause_state != PauseState.UNPAUSED:
                self._pauses += 1
            super().set_pause_state(pause_state)

        def _holds(self, request: Any) -> bool:
            after, pauses = self._arrived.get(request.request_id, (0, -1))
            return pauses == self._pauses and request.num_output_tokens >= after

        def schedule(self, *args: Any, **kwargs: Any) -> Any:
            for gone in [r for r in self._arrived if r not in self.requests]:
                del self._arrived[gone]
            held = [(i, r) for i, r in enumerate(self.running) if self._holds(r)]
            for i, _ in reversed(held):
                del self.running[i]  # in place: the same list, without them, for this step
            try:
                return super().schedule(*args, **kwargs)
            finally:
                for i, request in held:
                    self.running.insert(min(i, len(self.running)), request)

    HoldingScheduler.__qualname__ = HoldingScheduler.__name__ = "HoldingScheduler"
    HoldingScheduler.__module__ = __name__
    return HoldingScheduler


def __getattr__(name: str) -> Any:
    """`HoldingScheduler`, built on first use (in the engine core): importing vLLM is left to the
    processes that need it."""
    if name == "HoldingScheduler":
        cls = _holding_scheduler()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class SwapRecorder(VllmServerRollout):
    """A `VllmServerRollout` that records each swap's stall and when it returned; `swap_mode`, when
    set, replaces the session's pause_mode (one session then swaps under several modes)."""

    swap_mode: str | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stalls: list[float] = []
        self.swapped_at: list[tuple[int, float]] = []  # (version, monotonic time the swap returned)

    def swap(self, version: int, pause_mode: str) -> float:
        stall = super().swap(version, self.swap_mode if self.swap_mode is not None else pause_mode)
        self.stalls.append(stall)
        self.swapped_at.append((version, time.monotonic()))
        return stall


@dataclass
class Output:
    prompt: list[int]
    tokens: list[int]
    spans: list[tuple[str, int, int]]
    finish: str | None
    submitted: float
    done: float


def generate(http: Any, url: str, prompt: list[int], max_tokens: int, timeout_s: float = 60.0) -> Output:
    t0 = time.monotonic()
    body = {"token_ids": prompt, "sampling_params": {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}}
    resp = http.post(f"{url}{GENERATE_ROUTE}", json=body, timeout=timeout_s)
    resp.raise_for_status()
    choice = resp.json()["choices"][0]
    spans = [(str(s["version"]), int(s["start"]), int(s["end"])) for s in choice.get("weight_versions") or []]
    return Output(prompt, list(choice.get("token_ids") or []), spans, choice.get("finish_reason"), t0, time.monotonic())


MAX_TOKENS_METRIC = "vllm:request_params_max_tokens"
"""vLLM's histogram of finished requests' max_tokens (its `/metrics`): the API server's output
handler observes a request there in the same event-loop step that hands it its last tokens."""


def max_tokens_bucket(url: str, max_tokens: int, timeout_s: float = 30.0) -> tuple[float, float, int]:
    """(lo, hi, count): the bucket (lo, hi] of the vLLM server's `MAX_TOKENS_METRIC` histogram that
    holds `max_tokens`, and how many finished requests it counts (summed over engines)."""
    import requests

    resp = requests.get(f"{url}/metrics", timeout=timeout_s)
    resp.raise_for_status()
    cumulative: dict[float, float] = {}
    for line in resp.text.splitlines():
        if line.startswith(MAX_TOKENS_METRIC + "_bucket{"):
            labels, value = line.rsplit(" ", 1)
            le = re.search(r'le="([^"]+)"', labels)
            assert le is not None, line
            cumulative[float(le.group(1))] = cumulative.get(float(le.group(1)), 0.0) + float(value)
    assert cumulative, f"{url}/metrics has no {MAX_TOKENS_METRIC} histogram (a server started with --disable-log-stats?)"
    lo = max((b for b in cumulative if b < max_tokens), default=0.0)
    hi = min(b for b in cumulative if b >= max_tokens)  # +Inf is always one
    return lo, hi, int(cumulative[hi] - cumulative.get(lo, 0.0))


class InFlight:
    """One greedy request streamed in a thread (`"stream": true`): `started` is set once its first
    token arrived, so the engine is decoding it, `finished` once its last chunk came; `join()` gives
    its Output (spans from the last chunk). A test that must see a request straddle a swap sends one
    the engine holds (`request_id=held_request_id(n)`), pauses once its n tokens came (`wait_tokens`)
    and asks the paused engine whether the request is still in it (`unfinished_while_paused`),
    instead of hoping a request stream has one in flight then.

    That answer is the engine's own count of finished requests of this one's max_tokens bucket
    (`max_tokens_bucket`), read before it is sent: exact only while no other request of that bucket
    runs on the server (the caller's to ensure: e.g. every other request's max_tokens at most `bucket[0]`)."""

    def __init__(self, url: str, prompt: list[int], max_tokens: int, timeout_s: float = 120.0, request_id: str | None = None) -> None:
        """`request_id`: sent as the request's id (e.g. `held_request_id`: the engine holds it)."""
        self.url, self.prompt, self.max_tokens, self.timeout_s, self.request_id = url, prompt, max_tokens, timeout_s, request_id
        self.started = threading.Event()
        self.finished = threading.Event()
        self._progress = threading.Condition()  # notified as tokens arrive and at the end
        self.tokens: list[int] = []
        self.output: Output | None = None
        self.error: str | None = None
        lo, hi, self._finished_before = max_tokens_bucket(url, max_tokens)
        self.bucket = (lo, hi)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import requests

        t0 = time.monotonic()
        body: dict[str, Any] = {"token_ids": self.prompt, "stream": True, "sampling_params": {"max_tokens": self.max_tokens, "temperature": 0.0, "ignore_eos": True}}
        if self.request_id is not None:
            body["request_id"] = self.request_id
        tokens = self.tokens
        spans: list[tuple[str, int, int]] = []
        finish: str | None = None
        try:
            with requests.post(f"{self.url}{GENERATE_ROUTE}", json=body, stream=True, timeout=self.timeout_s) as resp:
                resp.raise_for_status()
                for line in resp.iter_lines():
                    if not line.startswith(b"data: ") or line == b"data: [DONE]":
                        continue
                    choice = json.loads(line[len(b"data: "):])["choices"][0]
                    with self._progress:
                        tokens += choice.get("token_ids") or []
                        self._progress.notify_all()
                    if tokens:
                        self.started.set()
                    finish = choice.get("finish_reason") or finish
                    if choice.get("weight_versions"):
                        spans = [(str(s["version"]), int(s["start"]), int(s["end"])) for s in choice["weight_versions"]]
            self.output = Output(self.prompt, tokens, spans, finish, t0, time.monotonic())
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.started.set()  # a failed request must not leave a waiter blocked
            self.finished.set()
            with self._progress:
                self._progress.notify_all()

    def wait_started(self) -> None:
        """Until the engine decodes it (bounded by the request's timeout)."""
        assert self.started.wait(self.timeout_s), f"no token of the held request in {self.timeout_s:.0f} s"
        assert self.error is None, f"the held request failed: {self.error}"

    def wait_tokens(self, n: int) -> None:
        """Until `n` of its tokens reached this client (bounded by the request's timeout)."""
        with self._progress:
            arrived = self._progress.wait_for(lambda: len(self.tokens) >= n or self.finished.is_set(), self.timeout_s)
        assert arrived, f"{len(self.tokens)} of the held request's first {n} tokens in {self.timeout_s:.0f} s"
        assert self.error is None, f"the held request failed: {self.error}"
        assert len(self.tokens) >= n, f"the held request ended with {len(self.tokens)} tokens, before its first {n}"

    def in_engine(self, timeout_s: float = 30.0) -> bool:
        """Whether the engine has not finished this request: its count of finished requests of this
        one's max_tokens bucket has not grown since it was sent. Its last tokens may still be on
        their way to this client: the count does not wait for them."""
        return max_tokens_bucket(self.url, self.max_tokens, timeout_s)[2] == self._finished_before

    def unfinished_while_paused(self, timeout_s: float = 30.0) -> bool:
        """With the engine paused: whether this request is still in it, as the engine says
        (`in_engine`; no waiting for tokens to settle). The pause's reply leaves the engine core
        after every output of its last step, and the API server's output handler, woken by those
        first, counts a request that step finished before the pause call returns."""
        import requests

        paused = requests.get(f"{self.url}/is_paused", timeout=timeout_s).json()["is_paused"]
        assert paused, "unfinished_while_paused asked while the engine is not paused: the answer would be stale at once"
        unfinished = self.in_engine(timeout_s)
        assert not (unfinished and self.output is not None), (
            f"the engine counts the held request unfinished though its last chunk came (max_tokens bucket {self.bucket}): "
            "another request of that bucket ran, or vLLM no longer counts a request before sending its last tokens"
        )
        return unfinished

    def wait_ended(self) -> None:
        """Until the request ended, well or not (bounded by `timeout_s`); `join` checks how."""
        self._thread.join(self.timeout_s)

    def join(self) -> Output:
        self.wait_ended()
        assert self.output is not None, f"the held request did not finish: {self.error or 'still running'}"
        return self.output


@dataclass
class RequestStream:
    """`num_threads` threads sending greedy requests until stopped, each `gap_s` after the last
    returned (0: back to back; a gap paces the stream on the 2-core box)."""

    url: str
    prompts: list[list[int]]
    max_tokens: int
    num_threads: int = 2
    gap_s: float = 0.0
    outputs: list[Output] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(self.num_threads)]

    def start(self) -> RequestStream:
        for t in self._threads:
            t.start()
        return self

    def _loop(self, index: int) -> None:
        import requests

        http = requests.Session()
        k = index
        while not self._stop.is_set():
            try:
                out = generate(http, self.url, self.prompts[k % len(self.prompts)], self.max_tokens)
            except Exception as exc:
                with self._lock:
                    self.errors.append(f"{type(exc).__name__}: {exc}")
                self._stop.wait(0.1)
                continue
            with self._lock:
                self.outputs.append(out)
            k += self.num_threads
            self._stop.wait(self.gap_s)
        http.close()

    def stop(self) -> list[Output]:
        self._stop.set()
        for t in self._threads:
            t.join(90)
        return list(self.outputs)


class HfReference:
    """Greedy tokens of an HF model holding a given version's weights (memoized)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.weights: dict[str, dict[str, torch.Tensor]] = {}
        self._memo: dict[tuple[str, tuple[int, ...], int], list[int]] = {}

    def record(self, version: str, state: dict[str, torch.Tensor]) -> None:
        self.weights[version] = {n: t.detach().clone() for n, t in state.items()}

    @torch.no_grad()
    def greedy(self, version: str, prompt: list[int], n: int) -> list[int]:
        key = (version, tuple(prompt), n)
        if key not in self._memo:
            self.model.load_state_dict(self.weights[version])
            ids = torch.tensor([prompt])
            out: list[int] = []
            for _ in range(n):
                nxt = int(self.model(ids).logits[0, -1].argmax())
                out.append(nxt)
                ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
            self._memo[key] = out
        return self._memo[key]
