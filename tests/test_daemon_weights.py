"""The daemon's `checkpoint_engine.weights` check, over its real RPC wire.

`ckpt-engine serve` configured `weights: adapters` refuses a full-weight engine by name when it
registers (before it is probed or claimed); a daemon syncing full weights refuses a LoRA engine
the same way; a trainer following it must use the same mode, and a source that does not match is
refused by name before any engine is asked anything. An adapter sync through a daemon works.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ckpt_engine.config import CheckpointEngineConfig
from ckpt_engine.control.wire import RpcError
from ckpt_engine.daemon import WeightSyncDaemon
from ckpt_engine.daemon.client import DaemonClient
from ckpt_engine.daemon.config import DaemonConfig
from ckpt_engine.sources.base import StateDictSource
from helpers_daemon import SERVE_YAML, start_serve

TOKEN = "weights-check-token"


def config(weights: str) -> CheckpointEngineConfig:
    return CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.25, timeout_s=20.0, weights=weights)


def test_adapter_daemon_refuses_full_engines_sources_and_trainers_by_name(tmp_path: Path) -> None:
    serve = start_serve(tmp_path, TOKEN, yaml=SERVE_YAML.replace("timeout_s: 20\n", "timeout_s: 20\n  weights: adapters\n"))
    try:
        client = DaemonClient(serve.address, TOKEN, timeout_s=10)
        assert client.hello()["weights"] == "adapters"
        with pytest.raises(RpcError, match=r"engine 'r0' \(.*\) takes full weights but this daemon syncs checkpoint_engine.weights='adapters'"):
            client.register("r0", {"kind": "torch_ref", "host": "127.0.0.1", "port": 1})
        assert client.members()["engines"] == []

        source = StateDictSource({"model.norm.weight": torch.ones(8)})
        trainer = WeightSyncDaemon(config("full"), DaemonConfig(heartbeat_timeout_s=0), token=TOKEN, upstream=client)
        with pytest.raises(ValueError, match=rf"the daemon at {serve.address} syncs checkpoint_engine.weights='adapters' but this trainer's config says 'full'"):
            trainer.sync(source)
        trainer.close()
        trainer = WeightSyncDaemon(config("adapters"), DaemonConfig(heartbeat_timeout_s=0), token=TOKEN, upstream=client)
        with pytest.raises(ValueError, match=r"checkpoint_engine.weights='adapters' but the source does not send one LoRA adapter in PEFT's layout \(model.norm.weight\)"):
            trainer.sync(source)
        trainer.close()
    finally:
        serve.stop()


def test_full_daemon_refuses_a_lora_engine_by_name_and_an_adapter_daemon_syncs_adapters() -> None:
    pytest.importorskip("peft")
    import peft
    import transformers

    from ckpt_engine.rollout_adapters.torch_ref.lora import LoraRefRollout, linear_shapes
    from ckpt_engine.sources.adapters import AdapterSource

    full = WeightSyncDaemon(config("full"), DaemonConfig(heartbeat_timeout_s=0), token=TOKEN)
    full.serve()
    try:
        client = DaemonClient(full.address, TOKEN, timeout_s=10)
        with pytest.raises(RpcError, match=r"engine 'v0' \(.*\) takes adapter syncs \(LoRA versions\) but this daemon syncs checkpoint_engine.weights='full'"):
            client.register("v0", {"kind": "vllm_lora", "url": "http://127.0.0.1:1", "world_size": 1})
    finally:
        full.close()

    cfg = transformers.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(cfg)
    engine = LoraRefRollout("lora0", linear_shapes(base), max_rank=8)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    daemon = WeightSyncDaemon(config("adapters"), DaemonConfig(heartbeat_timeout_s=0), token=TOKEN)
    try:
        daemon.register("lora0", engine)
        outcome = daemon.sync(AdapterSource(model))
        assert outcome.ok, outcome
        tensors, spec = engine.adapter()
        assert spec.rank == 4 and all(torch.equal(tensors[n], t) for n, t in AdapterSource(model).iter_weights() if n in tensors)
        with pytest.raises(ValueError, match=r"checkpoint_engine.weights='adapters' but the source does not send one LoRA adapter"):
            daemon.sync(StateDictSource({"model.norm.weight": torch.ones(32)}))
    finally:
        daemon.close()
