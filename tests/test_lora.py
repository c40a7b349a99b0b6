"""Adapter-only syncs without vLLM: the wire layout, the version store, and real gloo syncs from a
PEFT model's `AdapterSource` into the reference receiver (`LoraRefRollout`), bit-exact."""

from __future__ import annotations

import pytest
import torch

from ckpt_engine import CheckpointEngineConfig, WeightSyncSession
from ckpt_engine.config import ConfigError
from ckpt_engine.lora_format import ADAPTER_CONFIG, MAX_CONFIG_BYTES, LoraSpec, check_adapter, peft_wire_name
from ckpt_engine.manifest import TensorSpec
from ckpt_engine.rollout_adapters.adapter_versions import AdapterVersions
from ckpt_engine.rollout_adapters.base import ManifestRejectedError
from ckpt_engine.rollout_adapters.torch_ref.lora import LoraRefRollout, linear_shapes
from ckpt_engine.sources.adapters import AdapterSource
from ckpt_engine.sources.base import StateDictSource

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

TARGETS = ["q_proj", "v_proj", "down_proj"]
ENGINE_TARGETS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def tiny_peft(seed: int, r: int = 8, targets: list[str] = TARGETS) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    model = transformers.AutoModelForCausalLM.from_config(config)
    model = peft.get_peft_model(model, peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets))
    torch.manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_" in n:
                p.normal_()
    return model


def engine(max_versions: int = 2, max_rank: int = 8) -> LoraRefRollout:
    base = tiny_peft(0).get_base_model()
    shapes = {n.removesuffix(".base_layer"): s for n, s in linear_shapes(base).items() if ".lora_" not in n}
    return LoraRefRollout("ref", shapes, max_rank=max_rank, targets=ENGINE_TARGETS, max_adapter_versions=max_versions)


CONFIG = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.0625, timeout_s=30.0, weights="adapters")


def test_an_adapter_engine_is_never_told_that_syncs_pause_for_the_transfer(caplog: pytest.LogCaptureFixture) -> None:
    """Adapter syncs pause nothing (a version installs beside the one requests use): `stage: auto`
    said "syncs pause for the whole transfer" to a LoRA engine."""
    ref = engine()
    session = WeightSyncSession([ref], CONFIG)
    try:
        with caplog.at_level("INFO"):
            session.sync(AdapterSource(tiny_peft(1)))
        assert not [r.message for r in caplog.records if "pause for the whole transfer" in r.message]
    finally:
        session.close()


# --- the wire layout ------------------------------------------------------------------------------
def test_spec_travels_as_peft_config_json_and_malformed_configs_are_refused() -> None:
    spec = LoraSpec(16, 32.0, ("q_proj", "v_proj"), use_rslora=True)
    assert LoraSpec.decode(spec.encode()) == spec
    assert spec.config_spec() == TensorSpec(ADAPTER_CONFIG, "uint8", (spec.encode().numel(),))
    with pytest.raises(ValueError, match="not JSON"):
        LoraSpec.decode(torch.tensor([1, 2, 255], dtype=torch.uint8))
    with pytest.raises(ValueError, match="LoRA rank must be a positive int, got 0"):
        LoraSpec(0, 1.0, ("q_proj",))


def test_peft_names_lose_the_adapter_name_and_other_parameters_are_left_out() -> None:
    assert peft_wire_name("base_model.model.model.layers.0.mlp.down_proj.lora_B.default.weight") == (
        "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"
    )
    assert peft_wire_name("base_model.model.model.layers.0.mlp.down_proj.base_layer.weight") is None
    assert peft_wire_name("base_model.model.x.lora_A.other.weight") is None


def test_check_adapter_names_every_problem() -> None:
    a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    b = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    base = {"model.layers.0.self_attn.q_proj": (64, 32)}
    ok = [TensorSpec(a, "float32", (8, 32)), TensorSpec(b, "float32", (64, 8)), LoraSpec(8, 16, ("q_proj",)).config_spec()]
    assert check_adapter(ok, max_rank=8, base_shapes=base) == []
    assert check_adapter(ok, max_rank=4, base_shapes=base) == ["LoRA rank 8 exceeds the engine's max_lora_rank 4"]
    assert check_adapter(ok, max_rank=8, base_shapes=base, targets={"v_proj"}) == [
        "model.layers.0.self_attn.q_proj: target module 'q_proj' is not among the engine's LoRA target modules ['v_proj']"
    ]
    bad = [TensorSpec(a, "float32", (8, 31)), ok[2], TensorSpec("model.norm.weight", "float32", (64,))]
    problems = check_adapter(bad, max_rank=8, base_shapes=base)
    assert "model.norm.weight: not a LoRA tensor" in problems[0]
    assert "model.layers.0.self_attn.q_proj: lora_B.weight is missing (send both or neither)" in problems


# --- the version store -----------------------------------------------------------------------------
def test_versions_stay_while_requests_use_them_and_at_most_max_live() -> None:
    versions: AdapterVersions[str] = AdapterVersions(2)
    assert versions.install(1, "v1") == []
    versions.in_use = {1}
    assert versions.room_problem() is None
    assert versions.install(2, "v2") == []  # version 1 still serves a request
    assert list(versions.live) == [1, 2]
    versions.in_use = {1, 2}
    problem = versions.room_problem()
    assert problem is not None and "requests still use version(s) [1, 2]" in problem
    assert versions.observe({2}) == [1]  # its last request ended
    assert versions.install(3, "v3") == []  # version 2 still in use
    assert versions.observe(set()) == [2]
    with pytest.raises(ValueError, match="not newer"):
        versions.install(3, "again")


# --- real syncs into the reference receiver ----------------------------------------------------------
def test_adapter_syncs_are_bit_exact_and_versions_retire_after_their_last_request() -> None:
    ref = engine()
    session = WeightSyncSession([ref], CONFIG)
    try:
        first = tiny_peft(1)
        report = session.sync(AdapterSource(first))
        held, spec = ref.adapter()
        sent = dict(AdapterSource(first).iter_weights())
        assert set(held) == set(sent) - {ADAPTER_CONFIG} and all(torch.equal(held[n], sent[n]) for n in held)
        assert spec == LoraSpec(8, 16.0, tuple(sorted(TARGETS)))
        assert report.tensors == len(sent)
        running = ref.begin_request()  # started under the first version
        session.sync(AdapterSource(tiny_peft(2)))
        assert ref.live_versions() == [running, running + 1]
        assert torch.equal(ref.adapter(running)[0][next(iter(held))], held[next(iter(held))])
        second = ref.begin_request()  # under the second version
        with pytest.raises(ManifestRejectedError, match=rf"requests still use version\(s\) \[{running}, {second}\]"):
            session.sync(AdapterSource(tiny_peft(3)))
        ref.end_request(running)
        assert ref.live_versions() == [second]
        session.sync(AdapterSource(tiny_peft(3)))
        assert ref.live_versions() == [second, second + 1]  # the second version until its request ends
        ref.end_request(second)
        assert ref.live_versions() == [second + 1]
    finally:
        session.close()


def test_a_rank_or_target_mismatch_is_refused_by_name_before_a_byte_moves() -> None:
    ref = engine()
    session = WeightSyncSession([ref], CONFIG)
    try:
        session.sync(AdapterSource(tiny_peft(1)))
        held = ref.adapter()
        received = ref.health()["buckets_received"]
        with pytest.raises(ManifestRejectedError, match="LoRA rank 16 exceeds the engine's max_lora_rank 8"):
            session.sync(AdapterSource(tiny_peft(2, r=16)))
        with pytest.raises(ManifestRejectedError, match="target module 'lm_head' is not among"):
            session.sync(AdapterSource(tiny_peft(2, targets=["lm_head"])))
        assert ref.health()["buckets_received"] == received and ref.adapter() is held
    finally:
        session.close()


def test_weights_mode_must_match_the_source_and_the_engines() -> None:
    with pytest.raises(ConfigError, match="checkpoint_engine.weights must be one of full, adapters, got 'lora'"):
        CheckpointEngineConfig(weights="lora")
    session = WeightSyncSession([engine()], CONFIG)
    try:
        with pytest.raises(ValueError, match=r"the source does not send one LoRA adapter in PEFT's layout \(w"):
            session.sync(StateDictSource({"w": torch.ones(3)}))
    finally:
        session.close()
    session = WeightSyncSession([engine()], CheckpointEngineConfig(backend="gloo", timeout_s=30.0))
    try:
        with pytest.raises(ValueError, match=r"weights='full' but engine\(s\) 'ref' take adapter syncs"):
            session.sync(AdapterSource(tiny_peft(1)))
    finally:
        session.close()


def test_delta_adapter_syncs_are_bit_exact() -> None:
    ref = engine(max_versions=1)
    session = WeightSyncSession([ref], CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.0625, timeout_s=30.0, weights="adapters", delta="on"))
    try:
        model = tiny_peft(1)
        for step in range(3):
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if ".lora_B." in n:
                        p[step] += 1.0  # a few rows change: patches pay
            report = session.sync(AdapterSource(model))
            held, _ = ref.adapter()
            sent = dict(AdapterSource(model).iter_weights())
            assert all(torch.equal(held[n], sent[n]) for n in held) and len(held) == len(sent) - 1
        assert report.delta != "dense" and report.wire_bytes < report.dense_bytes
    finally:
        session.close()


def test_a_nan_or_inf_adapter_is_refused_by_name_and_the_old_one_keeps_serving() -> None:
    """Issue 45, item 5: a non-finite adapter was installed and served; now the sync fails naming
    the tensor and the engine keeps serving its newest adapter, bit for bit."""
    from ckpt_engine import SyncError

    ref = engine()
    session = WeightSyncSession([ref], CONFIG)
    try:
        session.sync(AdapterSource(tiny_peft(1)))
        version, (held, _spec) = ref.version, ref.adapter()
        kept = {n: t.clone() for n, t in held.items()}
        for bad in (float("nan"), float("inf")):
            model = tiny_peft(2)
            name, param = next((n, p) for n, p in model.named_parameters() if ".lora_B." in n)
            with torch.no_grad():
                param[0, 0] = bad
            with pytest.raises(SyncError, match=rf"{peft_wire_name(name)}.* hold NaN or infinite values"):
                session.sync(AdapterSource(model))
            assert ref.version == version
            now, _ = ref.adapter()
            assert set(now) == set(kept) and all(torch.equal(now[n], kept[n]) for n in kept)
        session.sync(AdapterSource(tiny_peft(3)))  # the next sync heals
        assert ref.version is not None and version is not None and ref.version > version
    finally:
        session.close()


def test_a_lora_receiver_decodes_a_manifest_within_the_largest_adapter_its_config_admits() -> None:
    """Issue 45, item 4: LoRA receivers decoded manifests with no budget at all."""
    import msgpack

    ref = engine()
    entry = ["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", "float32", [8, 64], 0, 4, 0]
    flood = msgpack.packb({"format": 2, "bucket_size": 4096, "alignment": 256, "num_senders": 1,
                           "buckets": [[0, [entry] * 200_000]], "digest": "0" * 64}, use_bin_type=True)
    reply = ref.core.validate(flood, "0" * 64)
    assert not reply["accepted"] and "could need" in reply["problems"][0], reply


@pytest.mark.parametrize("size", [0, MAX_CONFIG_BYTES + 1])
def test_an_adapter_config_beyond_its_size_bound_is_refused_at_validate_before_anything_moves(size: int) -> None:
    """Issue 45, item 5: the config tensor's size was checked only at finalize, after the transfer;
    now validate refuses it by name (nothing moves, the engine keeps its adapter). Padded with
    spaces the oversized config is still valid JSON: its size is the only problem."""
    ref = engine()
    session = WeightSyncSession([ref], CONFIG)
    try:
        session.sync(AdapterSource(tiny_peft(1)))
        version, (held, _spec) = ref.version, ref.adapter()
        received = ref.health()["buckets_received"]
        tensors = dict(AdapterSource(tiny_peft(2)).iter_weights())
        text = tensors[ADAPTER_CONFIG].numpy().tobytes()
        padded = (text + b" " * size)[:size]
        tensors[ADAPTER_CONFIG] = torch.frombuffer(bytearray(padded), dtype=torch.uint8) if size else torch.zeros(0, dtype=torch.uint8)
        with pytest.raises(ManifestRejectedError, match=rf"{ADAPTER_CONFIG}: .*{size} bytes.* 1 to {MAX_CONFIG_BYTES}"):
            session.sync(StateDictSource(tensors))
        assert ref.health()["buckets_received"] == received and ref.version == version and ref.adapter()[0] is held
    finally:
        session.close()
