"""Adapter-only sync benchmark: a rank-r LoRA on every attention and MLP projection of a model's
shapes, over gloo, against a raw gloo broadcast of the same bytes, with the full-weight sync of the
same model (a few layers: --full-layers) beside it.

    python bench/lora_sync_bench.py --config ../shared/presets/qwen2.5-7b/config.json --rank 16

Adapter sync: `WeightSyncSession` -> `LoraRefRollout` (its receiving rank in this process, one thread),
timed end to end (validate, transfer, install); `switch` is the engine's install + activate of the
received version. Raw: one gloo broadcast of the adapter's bytes between two groups of this process
(same topology). Full: `StateDictSource` of the model's bf16 weights with `--full-layers` decoder
layers into a spawned `TorchRefRollout`; the 28-layer figure beside it is a per-layer extrapolation.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import tempfile
import threading
import time
import uuid

import torch

from ckpt_engine import CheckpointEngineConfig, WeightSyncSession
from ckpt_engine.lora_format import PEFT_PREFIX, LoraSpec
from ckpt_engine.rollout_adapters.torch_ref.lora import LoraRefRollout
from ckpt_engine.rollout_adapters.torch_ref import TorchRefRollout, write_spec_file
from ckpt_engine.sources.base import StateDictSource, spec_of

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def module_shapes(cfg: dict, layers: int) -> dict[str, tuple[int, int]]:
    """HF module path -> (out, in) of every attention and MLP projection."""
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    per = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q), "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}
    out = {}
    for layer in range(layers):
        for name, shape in per.items():
            part = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            out[f"model.layers.{layer}.{part}.{name}"] = shape
    return out


def adapter(shapes: dict[str, tuple[int, int]], rank: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    weights: dict[str, torch.Tensor] = {}
    for module, (o, i) in shapes.items():
        weights[f"{PEFT_PREFIX}{module}.lora_A.weight"] = torch.randn(rank, i, generator=g).bfloat16()
        weights[f"{PEFT_PREFIX}{module}.lora_B.weight"] = torch.randn(o, rank, generator=g).bfloat16()
    weights["adapter_config.json"] = LoraSpec(rank, 2.0 * rank, PROJECTIONS).encode()
    return weights


def full_weights(cfg: dict, layers: int) -> dict[str, torch.Tensor]:
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    out = {"model.embed_tokens.weight": torch.empty(v, h, dtype=torch.bfloat16).normal_()}
    for module, (o, i) in module_shapes(cfg, layers).items():
        out[f"{module}.weight"] = torch.empty(o, i, dtype=torch.bfloat16).normal_()
    out["model.norm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    if not cfg.get("tie_word_embeddings", False):
        out["lm_head.weight"] = torch.empty(v, h, dtype=torch.bfloat16).normal_()
    return out


def raw_broadcast_s(nbytes: int, repeats: int) -> float:
    """Median seconds of one gloo broadcast of `nbytes` between two groups of this process."""
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60))
    prefix = uuid.uuid4().hex
    groups: list = [None, None]

    def make(rank: int) -> None:  # each rank its own store client, as in two processes
        client = torch.distributed.TCPStore("127.0.0.1", store.port, is_master=False, wait_for_workers=False, timeout=datetime.timedelta(seconds=60))
        groups[rank] = torch.distributed.ProcessGroupGloo(torch.distributed.PrefixStore(prefix, client), rank, 2, datetime.timedelta(seconds=60))

    threads = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    bufs = [torch.empty(nbytes, dtype=torch.uint8).random_(0, 255), torch.empty(nbytes, dtype=torch.uint8)]
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        works = [groups[r].broadcast(bufs[r], 0) for r in (1, 0)]
        for w in works:
            w.wait()
        times.append(time.perf_counter() - t0)
    assert torch.equal(bufs[0], bufs[1])
    return statistics.median(times[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="an HF config.json (e.g. the qwen2.5-7b preset)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--bucket-mb", type=float, default=64.0)
    ap.add_argument("--full-layers", type=int, default=2, help="decoder layers of the full-weight sync (0: skip it)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cfg = json.load(open(args.config))
    layers = cfg["num_hidden_layers"]
    shapes = module_shapes(cfg, layers)
    config = CheckpointEngineConfig(backend="gloo", bucket_size_mb=args.bucket_mb, timeout_s=300.0, weights="adapters")
    engine = LoraRefRollout("ref", shapes, max_rank=args.rank, targets=set(PROJECTIONS))
    session = WeightSyncSession([engine], config)
    nbytes, sync_s, switch_s, transfer_s = 0, [], [], []
    try:
        for rep in range(args.repeats + 1):
            weights = adapter(shapes, args.rank, rep)
            nbytes = sum(t.numel() * t.element_size() for t in weights.values())
            t0 = time.perf_counter()
            report = session.sync(StateDictSource(weights))
            if rep:  # the first sync joins the group
                sync_s.append(time.perf_counter() - t0)
                switch_s.append(engine.last_finalize["install_s"])
                transfer_s.append(report.seconds["transfer"])
        held, _ = engine.adapter()
        assert all(torch.equal(held[n], t) for n, t in weights.items() if n in held)
    finally:
        session.close()
    raw = raw_broadcast_s(nbytes, args.repeats)
    out = {
        "tensors": len(shapes) * 2 + 1, "adapter_mb": nbytes / 2**20, "rank": args.rank, "layers": layers,
        "adapter_sync_s": statistics.median(sync_s), "adapter_transfer_s": statistics.median(transfer_s), "raw_broadcast_s": raw,
        "switch_ms": 1e3 * statistics.median(switch_s),
    }
    out["sync_over_raw"] = out["adapter_sync_s"] / raw
    if args.full_layers:
        full = full_weights(cfg, args.full_layers)
        full_bytes = sum(t.numel() * t.element_size() for t in full.values())
        with tempfile.TemporaryDirectory() as d:
            spec_file = f"{d}/specs.msgpack"
            write_spec_file(spec_file, [spec_of(n, t) for n, t in full.items()])
            ref = TorchRefRollout.spawn("full", spec_file=spec_file, timeout_s=300.0)
            session = WeightSyncSession([ref], CheckpointEngineConfig(backend="gloo", bucket_size_mb=args.bucket_mb, timeout_s=300.0))
            try:
                times = []
                for rep in range(2):
                    t0 = time.perf_counter()
                    session.sync(StateDictSource(full))
                    times.append(time.perf_counter() - t0)
            finally:
                session.close()
                ref.close()
        per_layer = full_bytes - sum(t.numel() * t.element_size() for n, t in full.items() if ".layers." not in n)
        whole = full_bytes + (layers - args.full_layers) * per_layer / args.full_layers
        out.update(full_layers=args.full_layers, full_gb=full_bytes / 1e9, full_sync_s=times[-1], full_gbps=full_bytes / times[-1] / 1e9)
        out.update(full_28_layers_gb_estimate=whole / 1e9, full_28_layers_s_estimate=whole / (full_bytes / times[-1]))
    for k, v in out.items():
        print(f"{k:28s} {v:.4g}" if isinstance(v, float) else f"{k:28s} {v}")
    if args.json:
        json.dump(out, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
