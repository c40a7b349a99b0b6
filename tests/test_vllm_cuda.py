"""A real CUDA vLLM engine fed by a trainer on the GPUs (vLLM 0.26 carried by bench/vllm_carry.sh;
run by `bench/gpu_runs.sh vllm`, never in CI).

One engine (in process, GPU 0, dummy weights) takes most syncs; a second engine that loaded the
reference weights from disk gives what the first must hold after each sync: every parameter and
buffer equal by digest (`ckpt_param_digests`, vLLM's own fused / sliced layout), and greedy tokens
equal. The trainer is an HF model in this process, on GPU 1 (nccl) or GPU 0 (colocated).

`vllm serve` engines (GPUs chosen per test) start from the reference weights on disk, so their own
digests before any sync are the reference: a sync away to other weights and back must restore
every one of them on every rank. One shares the trainer's GPU (`colocated` over HTTP). A TP=2
server (each rank receives only its slice; a tiny Qwen3-MoE too, experts fused by vLLM): over nixl
on 2 GPUs (rank 0 beside the trainer), over NCCL with 3. Two FSDP2 ranks sending their own shards:
over nccl with 3 GPUs; with 2, beside the server, one handing its shard over in memory
(`nccl_handoff`), or into a TP=2 server on their own GPUs over nixl (the hybrid engine).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
vllm = pytest.importorskip("vllm")
transformers = pytest.importorskip("transformers")

from ckpt_engine import CheckpointEngineConfig  # noqa: E402
from ckpt_engine.rollout_adapters.vllm import WORKER_EXTENSION, VllmRollout  # noqa: E402
from ckpt_engine.sources.base import StateDictSource  # noqa: E402
from ckpt_engine.sync.api import close_sessions, sync_rollout_weights  # noqa: E402
from _vllm_installed_faults import EXTENSION as FAULTS_EXTENSION  # noqa: E402
from helpers_vllm_cuda import digests, greedy  # noqa: E402
from ckpt_engine.sync.report import SyncError  # noqa: E402

os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
os.environ.setdefault("VLLM_USE_DEEP_GEMM", "0")
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # the trainer uses CUDA in this process

QWEN2 = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 512, "hidden_size": 256,
    "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "initializer_range": 0.2, "bos_token_id": 1, "eos_token_id": 2,
}
ENGINE = {"max_model_len": 128, "max_num_seqs": 4, "gpu_memory_utilization": 0.12, "enforce_eager": True, "dtype": "bfloat16"}
REFERENCE_SEED = 0


def hf_model(model_dir: Path, seed: int, device: str) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.AutoConfig.from_pretrained(model_dir)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).to(device).eval()


def source(model: torch.nn.Module, only: set[str] | None = None) -> StateDictSource:
    return StateDictSource({n: t.detach() for n, t in model.state_dict().items() if only is None or n in only})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """config.json plus the reference weights (seed REFERENCE_SEED) as safetensors."""
    d = tmp_path_factory.mktemp("qwen2-cuda")
    (d / "config.json").write_text(json.dumps(QWEN2))
    hf_model(d, REFERENCE_SEED, "cpu").save_pretrained(d, safe_serialization=True)
    return d


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> tuple[dict[str, str], list[list[int]]]:
    """What an engine that loaded the reference weights from disk holds and generates."""
    from vllm import LLM

    llm = LLM(model=str(model_dir), skip_tokenizer_init=True, worker_extension_cls=WORKER_EXTENSION, **ENGINE)
    try:
        return digests(llm), greedy(llm)
    finally:
        llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def engine(model_dir: Path, reference: Any) -> Iterator[Any]:
    from vllm import LLM

    # the worker extension plus test-only fault plants (`_vllm_installed_faults.py`), untouched unless planted
    llm = LLM(model=str(model_dir), load_format="dummy", skip_tokenizer_init=True, worker_extension_cls=FAULTS_EXTENSION, **ENGINE)
    yield llm
    close_sessions()
    llm.llm_engine.engine_core.shutdown()


def assert_holds_reference(llm: Any, reference: tuple[dict[str, str], list[list[int]]]) -> None:
    want, tokens = reference
    got = digests(llm)
    assert got.keys() == want.keys()
    assert [n for n in want if got[n] != want[n]] == []
    assert greedy(llm) == tokens


def test_nccl_from_the_trainers_gpu_not_the_current_one(engine: Any, model_dir: Path, reference: Any) -> None:
    """The trainer's tensors on cuda:1 while cuda:0 (the engine's GPU) is current: the sender
    joins from its tensors' device (NCCL refused two ranks on one GPU before)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    torch.cuda.set_device(0)
    trainer = hf_model(model_dir, REFERENCE_SEED, "cuda:1")
    handle = VllmRollout("vllm-cuda", engine, timeout_s=60.0)
    config = CheckpointEngineConfig(backend="nccl", timeout_s=60.0, stage="off")
    report = sync_rollout_weights(source(trainer), [handle], config=config)
    assert report is not None and report.delta == "off"
    assert_holds_reference(engine, reference)


def test_staged_delta_syncs_land_exactly(engine: Any, model_dir: Path, reference: Any) -> None:
    """Staged (the default) and delta: away to other weights, back by a patch; exact after each."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    handle = VllmRollout("vllm-cuda", engine, timeout_s=60.0)
    config = CheckpointEngineConfig(backend="nccl", timeout_s=60.0, delta="on")
    other = hf_model(model_dir, 7, "cuda:1")
    first = sync_rollout_weights(source(other), [handle], config=config)
    assert first is not None and first.staged != "off"
    assert digests(engine) != reference[0]
    trainer = hf_model(model_dir, REFERENCE_SEED, "cuda:1")
    back = sync_rollout_weights(source(trainer), [handle], config=config)
    assert back is not None and back.version == first.version + 1
    assert_holds_reference(engine, reference)


def test_a_staged_subset_leaves_the_other_tensors_as_they_are(engine: Any, model_dir: Path, reference: Any) -> None:
    """Two tensors of another version, staged: only their parameters change; the rest keep the
    reference bytes (issue 45: a staged subset once overwrote the rest at the swap)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    handle = VllmRollout("vllm-cuda", engine, timeout_s=60.0)
    config = CheckpointEngineConfig(backend="nccl", timeout_s=60.0)
    trainer = hf_model(model_dir, REFERENCE_SEED, "cuda:1")
    sync_rollout_weights(source(trainer), [handle], config=config)
    assert_holds_reference(engine, reference)
    other = hf_model(model_dir, 9, "cuda:1")
    subset = {"model.layers.0.mlp.down_proj.weight", "model.layers.1.self_attn.o_proj.weight"}  # norms init to ones: equal across seeds
    report = sync_rollout_weights(source(other, only=subset), [handle], config=config)
    assert report is not None and report.tensors == 2
    got, want = digests(engine), reference[0]
    assert sorted(n for n in want if got[n] != want[n]) == sorted(subset)
    sync_rollout_weights(source(trainer), [handle], config=config)
    assert_holds_reference(engine, reference)


def test_colocated_on_the_engines_gpu(engine: Any, model_dir: Path, reference: Any) -> None:
    """Trainer and engine on one GPU (hybrid engine): the sender hands its buffers over by CUDA IPC."""
    handle = VllmRollout("vllm-cuda", engine, timeout_s=60.0)
    other = hf_model(model_dir, 5, "cuda:0")
    config = CheckpointEngineConfig(backend="colocated", timeout_s=60.0, stage="off")
    sync_rollout_weights(source(other), [handle], config=config)
    assert digests(engine) != reference[0]
    trainer = hf_model(model_dir, REFERENCE_SEED, "cuda:0")
    report = sync_rollout_weights(source(trainer), [handle], config=config)
    assert_holds_reference(engine, reference)
    # A bf16 model on CUDA loads in place: the loaders' copies were made directly (vllm/direct_load.py)
    assert report is not None and report.receivers[handle.name]["direct_tensors"] > 0, report.receivers


def test_installed_check_on_cuda_names_a_wrong_byte(engine: Any, model_dir: Path, reference: Any) -> None:
    """Every colocated sync checked (`verify_installed: 1`): the engine's digests of its live
    parameters (one launch over views kept across checks) equal the trainer's; a direct copy that
    leaves one wrong bit in one parameter fails the sync at verify naming that tensor, and the next
    sync (a seed) restores the reference. 3 times. The trainer's digests are folded before the stream
    and ride with the receive's last call: the worker finalizes there only where its own agree, so
    the wrong bit leaves its version unstamped."""
    handle = VllmRollout("vllm-cuda-checked", engine, timeout_s=60.0)
    trainer = hf_model(model_dir, REFERENCE_SEED, "cuda:0")
    config = CheckpointEngineConfig(backend="colocated", timeout_s=60.0, stage="off", verify_installed=1)
    target = "model.layers.1.mlp.down_proj.weight"
    for _ in range(3):
        sync_rollout_weights(source(trainer), [handle], config=config)
        sync_rollout_weights(source(trainer), [handle], config=config)  # its check rides on the receive
        engine.collective_rpc("test_plant_direct", args=(target,))
        before = handle.held_version()
        try:
            with pytest.raises(SyncError, match="verify") as err:
                sync_rollout_weights(source(trainer), [handle], config=config)
            assert f"{target}" in str(err.value) and "installed weights differ from the source" in str(err.value)
            assert handle.held_version() == before  # the worker, told the source's digests, did not finalize in its receive
        finally:
            engine.collective_rpc("test_unplant_direct")
    sync_rollout_weights(source(trainer), [handle], config=config)
    assert_holds_reference(engine, reference)


def test_a_sender_device_other_than_the_tensors_is_refused_by_name(engine: Any, model_dir: Path) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    handle = VllmRollout("vllm-cuda", engine, timeout_s=60.0)
    before = handle.held_version()
    trainer = hf_model(model_dir, 3, "cuda:1")
    config = CheckpointEngineConfig(backend="nccl", timeout_s=60.0, engine_kwargs={"nccl": {"device": "cuda:0"}})
    with pytest.raises(ValueError, match=r"on cuda:1 but the nccl sender is set to cuda:0"):
        sync_rollout_weights(source(trainer), [handle], config=config)
    assert handle.held_version() == before


def test_vllm_serve_over_nccl(model_dir: Path, tmp_path: Path) -> None:
    """`vllm serve` with the worker extension (dev-mode HTTP routes), fed over NCCL from cuda:1:
    every parameter vLLM keeps under the checkpoint's own name (unfused) holds the trainer's bytes."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    import hashlib

    import requests

    from ckpt_engine.rollout_adapters.vllm import VllmServerRollout
    from helpers_vllm import api_server

    extra = ["--worker-extension-cls", WORKER_EXTENSION]
    with api_server(model_dir, tmp_path / "server.log", extra, env={"CUDA_VISIBLE_DEVICES": "0"}) as server:
        trainer = hf_model(model_dir, 11, "cuda:1").float()
        handle = VllmServerRollout("vllm-serve", server.url, timeout_s=60.0)
        config = CheckpointEngineConfig(backend="nccl", timeout_s=60.0)
        report = sync_rollout_weights(source(trainer), [handle], config=config)
        assert report is not None and handle.held_version() == report.version
        (got,) = requests.post(f"{server.url}/collective_rpc", json={"method": "ckpt_param_digests"}, timeout=60).json()["results"]
        plain = [n for n in trainer.state_dict() if n in got]
        assert len(plain) >= 4
        for n in plain:
            want = hashlib.sha256(trainer.state_dict()[n].detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()).hexdigest()
            assert got[n] == want, n
        close_sessions()


QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 512, "hidden_size": 256,
    "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "initializer_range": 0.2, "bos_token_id": 1, "eos_token_id": 2,
    "moe_intermediate_size": 128, "num_experts": 8, "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "norm_topk_prob": True,
}


def checkpoint_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors under checkpoint names (transformers fuses experts in memory; the
    checkpoint and vLLM's loader have one tensor per expert)."""
    from ckpt_engine.sources.hf_names import unfuse_experts

    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        parts = unfuse_experts(model.config.model_type, name, t)
        for n, p in parts if parts is not None else [(name, t)]:
            out[n] = p.detach().contiguous()
    return out


def write_model(d: Path, config: dict[str, Any], seed: int) -> Path:
    from safetensors.torch import save_file

    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config))
    save_file({n: t.clone() for n, t in checkpoint_weights(hf_model(d, seed, "cpu")).items()}, str(d / "model.safetensors"))
    return d


def server_digests(url: str) -> list[dict[str, str]]:
    import requests

    return requests.post(f"{url}/collective_rpc", json={"method": "ckpt_param_digests"}, timeout=120).json()["results"]


def serve(model_dir: Path, log: Path, gpus: str, *extra: str) -> Any:
    """`vllm serve` (dev mode, the worker extension) of the reference weights on disk, bf16, on `gpus`.
    `--load-format safetensors` overrides the helper's dummy weights (the last flag wins): the
    server's own digests before any sync must be the disk load's (a TP=2 run compared syncs with
    dummy weights and found every parameter 'wrong')."""
    from helpers_vllm import api_server

    args = ["--worker-extension-cls", WORKER_EXTENSION, "--load-format", "safetensors", "--dtype", "bfloat16", "--gpu-memory-utilization", "0.15", *extra]
    return api_server(model_dir, log, args, env={"CUDA_VISIBLE_DEVICES": gpus}, start_timeout_s=300.0)


@pytest.mark.parametrize("stage", ["off", "auto"])
def test_vllm_serve_colocated_on_the_trainers_gpu(tmp_path: Path, stage: str) -> None:
    """`vllm serve` on the trainer's own GPU (verl's hybrid engine with a server: control over HTTP,
    the bytes through CUDA IPC, the server's worker copying straight out of the trainer's tensors):
    a sync away and one back, live and staged, each checked by the installed-weight check; the
    server ends holding its own disk load's bytes on every parameter."""
    from ckpt_engine.rollout_adapters.vllm import VllmServerRollout

    model_dir = write_model(tmp_path / "qwen2", QWEN2, REFERENCE_SEED)
    with serve(model_dir, tmp_path / "server.log", "0") as server:
        (reference,) = server_digests(server.url)
        handle = VllmServerRollout(f"vllm-serve-colocated-{stage}", server.url, timeout_s=60.0)
        config = CheckpointEngineConfig(backend="colocated", timeout_s=60.0, stage=stage, verify_installed=1)
        try:
            away = sync_rollout_weights(StateDictSource(checkpoint_weights(hf_model(model_dir, 7, "cuda:0"))), [handle], config=config)
            (got,) = server_digests(server.url)
            assert away is not None and [n for n in reference if got[n] != reference[n]] != []
            back = sync_rollout_weights(StateDictSource(checkpoint_weights(hf_model(model_dir, REFERENCE_SEED, "cuda:0"))), [handle], config=config)
            assert back is not None and back.version == away.version + 1 and "installed_check" in back.seconds
            (got,) = server_digests(server.url)
            assert [n for n in reference if got[n] != reference[n]] == []
        finally:
            close_sessions()


TP2_ROUTES = {
    "nccl": ("1,2", 3),  # the trainer on cuda:0, the engine's ranks on GPUs 1-2: three GPUs
    "nixl": ("0,1", 2),  # the engine's rank 0 beside the trainer on cuda:0: each rank reads its slice (a pull)
}
"""backend: (the TP=2 server's GPUs, GPUs needed). NCCL cannot put two ranks of one GPU in a group;
nixl reads out of the trainer's registered slots (CUDA IPC on one GPU, NVLink across), so two GPUs do."""


@pytest.mark.parametrize("backend", sorted(TP2_ROUTES))
@pytest.mark.parametrize("kind", ["qwen2", "qwen3_moe"])
def test_tp2_server_each_rank_receives_its_slice(tmp_path: Path, kind: str, backend: str) -> None:
    """A TP=2 engine fed from cuda:0 (over NCCL into GPUs 1-2, or pulled over nixl by GPUs 0-1): each
    worker states its receive plan at join and takes only its slice (about half the model), and after
    a sync away and one back every parameter on both ranks holds the reference bytes again (Qwen3-MoE:
    experts fused by vLLM), checked by the installed-weight check at each sync and by sha256 here."""
    gpus, needed = TP2_ROUTES[backend]
    if torch.cuda.device_count() < needed:
        pytest.skip(f"needs {needed} GPUs (a TP=2 engine on GPUs {gpus}, the trainer on cuda:0)")
    if backend == "nixl":
        _need_nixl()
    from ckpt_engine.rollout_adapters.vllm import VllmServerRollout

    model_dir = write_model(tmp_path / kind, QWEN3_MOE if kind == "qwen3_moe" else QWEN2, REFERENCE_SEED)
    with serve(model_dir, tmp_path / "server.log", gpus, "--tensor-parallel-size", "2") as server:
        reference = server_digests(server.url)
        assert len(reference) == 2
        handle = VllmServerRollout(f"vllm-tp2-{kind}", server.url, timeout_s=60.0)
        config = CheckpointEngineConfig(backend=backend, timeout_s=60.0, verify_installed=1)
        try:
            away = sync_rollout_weights(StateDictSource(checkpoint_weights(hf_model(model_dir, 7, "cuda:0"))), [handle], config=config)
            assert away is not None and [d != r for d, r in zip(server_digests(server.url), reference)] == [True, True]
            back = sync_rollout_weights(StateDictSource(checkpoint_weights(hf_model(model_dir, REFERENCE_SEED, "cuda:0"))), [handle], config=config)
            assert back is not None and back.version == away.version + 1
            got = server_digests(server.url)
            for rank in range(2):
                assert [n for n in reference[rank] if got[rank][n] != reference[rank][n]] == [], rank
            per_rank = back.received_bytes[handle.name]
            print(f"{kind} TP=2 on CUDA over {backend}: ranks receive {per_rank} of {back.bytes} bytes ({[round(b / back.bytes, 3) for b in per_rank]})")
            assert len(per_rank) == 2 and all(0.4 < b / back.bytes < 0.6 for b in per_rank), per_rank
        finally:
            close_sessions()


FSDP2_ROUTES = {
    "nccl": ([1, 2], "0", 1, 3),  # the engine on a GPU of its own
    "nccl_handoff": ([0, 1], "1", 1, 2),  # the engine beside rank 1, which hands its shard over in memory
    "nixl": ([0, 1], "0,1", 2, 2),  # a hybrid engine: a TP=2 engine on the trainer's two GPUs, each rank pulling its slices
}
"""backend: (the trainer ranks' GPUs, the server's GPUs, its tensor_parallel_size, GPUs needed)."""


def _need_nixl() -> None:
    from ckpt_engine.transports.nixl_agent import load_nixl

    try:
        load_nixl()
    except ImportError as exc:
        pytest.skip(f"{exc} (bench/gpu_runs.sh installs the carried nixl-cu13 wheel from .nixl/)")


@pytest.mark.parametrize("backend", sorted(FSDP2_ROUTES))
def test_fsdp2_ranks_send_their_own_shards_into_vllm(tmp_path: Path, backend: str) -> None:
    """Two FSDP2 trainer ranks, each sending its own shards (`senders: all`), into a `vllm serve`
    engine: over nccl from GPUs 1-2 into GPU 0; with nccl_handoff from GPUs 0-1 into GPU 1 (the rank
    beside the engine hands its shard over in memory); over nixl into a TP=2 engine on the trainer's
    own GPUs 0-1 (verl's hybrid-engine placement: each engine rank pulls only its slices, from both
    trainer ranks). Away and back: the reference bytes on every engine rank."""
    from ckpt_engine.benchmark.processes import run_processes
    from helpers_procs import free_port
    from _vllm_cuda_trainer import trainer_rank

    trainer_gpus, engine_gpus, tp, needed = FSDP2_ROUTES[backend]
    if torch.cuda.device_count() < needed:
        pytest.skip(f"needs {needed} GPUs (trainer ranks on {trainer_gpus}, the engine on {engine_gpus})")
    if backend == "nixl":
        _need_nixl()
    model_dir = write_model(tmp_path / "qwen2", QWEN2, REFERENCE_SEED)
    with serve(model_dir, tmp_path / "server.log", engine_gpus, "--tensor-parallel-size", str(tp)) as server:
        reference = server_digests(server.url)
        assert len(reference) == tp
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        port = free_port()
        args = (2, port, trainer_gpus, backend, server.url, str(model_dir), [7, REFERENCE_SEED], str(tmp_path))
        procs = [ctx.Process(target=trainer_rank, args=(r, *args), kwargs={"verify_installed": 1}) for r in range(2)]
        assert run_processes(procs, 150) == []  # inside the per-test bound of bench/gpu_runs.sh (200 s), so the ranks' JSON is read
        logs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
        assert logs[1] == [] and [e.get("error") for e in logs[0]] == [None, None], logs
        assert [e["senders"] for e in logs[0]] == [2, 2], logs[0]
        got = server_digests(server.url)
        for rank in range(tp):
            assert [n for n in reference[rank] if got[rank][n] != reference[rank][n]] == [], rank
        received, whole = logs[0][1]["received"], logs[0][1]["bytes"]
        print(f"FSDP2 x2 -> TP={tp} over {backend}: engine ranks receive {received} of {whole} bytes")
        if tp == 2:
            assert len(received) == 2 and all(0.4 < b / whole < 0.6 for b in received), (received, whole)
