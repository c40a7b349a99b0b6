"""`ckpt-engine demo checkpoint_engine.weights=adapters`: a LoRA job whose syncs carry only the adapter.

A tiny Qwen2 (`TINY_QWEN2` with `rollout.model` on top) takes a PEFT LoRA adapter
(`trainer.lora`: PEFT `LoraConfig` keywords; default rank 8 on q/v). Each step trains the adapter
on a counting task (next token = token + 1); every `trainer.sync_every` steps (and after the
last) it syncs it through a daemon into
`rollout.num_engines` reference receivers that keep adapter versions (`LoraRefRollout`, at most
`checkpoint_engine.max_adapter_versions` live). Prints per sync: version, the adapter's bytes next
to the full model's, seconds, GB/s, the engines' install time and the loss; ends with a summary
whose `exact` says every engine's newest adapter equals the trainer's, bit for bit.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["DEFAULT_LORA", "run_lora_job"]

DEFAULT_LORA: dict[str, Any] = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}
"""`trainer.lora` when the job gives none."""


def _model(job: Any) -> torch.nn.Module:
    import peft
    import transformers

    from ckpt_engine.trainer.tiny_qwen2 import TINY_QWEN2

    fields = {**TINY_QWEN2, **job.rollout.model}
    config = transformers.Qwen2Config(**{k: v for k, v in fields.items() if k not in ("architectures", "torch_dtype")})
    torch.manual_seed(job.trainer.seed)
    base = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    lora = job.trainer.lora if job.trainer.lora else DEFAULT_LORA
    try:
        lora_config = peft.LoraConfig(**lora)
    except TypeError as exc:
        raise ValueError(f"trainer.lora must hold peft.LoraConfig keywords: {exc}") from None
    return peft.get_peft_model(base, lora_config)


def _batch(job: Any, vocab: int, step: int) -> torch.Tensor:
    """Counting sequences (each token is the previous one + 1, mod the vocabulary)."""
    g = torch.Generator().manual_seed(job.trainer.seed * 1000 + step)
    start = torch.randint(3, vocab, (job.trainer.batch_size, 1), generator=g)
    return (start + torch.arange(16)) % vocab


def run_lora_job(job: Any, *, echo: bool = True) -> dict[str, Any]:
    """Train the adapter `trainer.steps` steps, syncing it after each; returns the summary."""
    from ckpt_engine.daemon import WeightSyncDaemon
    from ckpt_engine.rollout_adapters.torch_ref.lora import LoraRefRollout, linear_shapes
    from ckpt_engine.sources.adapters import AdapterSource

    if job.rollout.engine != "torch_ref":
        raise ValueError("checkpoint_engine.weights=adapters runs the demo on reference engines: set rollout.engine=torch_ref")
    say: Callable[..., None] = print if echo else (lambda *a, **k: None)
    model: Any = _model(job)  # peft's PeftModel (not read by the type checker)
    base = model.get_base_model()
    full_bytes = sum(p.numel() * p.element_size() for n, p in base.named_parameters() if "lora_" not in n)
    shapes = {n.removesuffix(".base_layer"): s for n, s in linear_shapes(base).items() if "lora_" not in n}
    max_rank = int(model.peft_config["default"].r)
    engines = [
        LoraRefRollout(f"rollout{i}", shapes, max_rank=max_rank, max_adapter_versions=job.checkpoint_engine.max_adapter_versions)
        for i in range(job.rollout.num_engines)
    ]
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=job.trainer.lr)
    vocab = int(model.config.vocab_size)
    daemon = WeightSyncDaemon(job.checkpoint_engine, job.daemon)
    syncs: list[dict[str, Any]] = []
    losses: list[float] = []
    try:
        for r in engines:
            daemon.register(r.name, r)
        for step in range(job.trainer.steps):
            ids = _batch(job, vocab, step)
            logits = model(input_ids=ids).logits
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, vocab), ids[:, 1:].reshape(-1))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
            if (step + 1) % job.trainer.sync_every and step + 1 < job.trainer.steps:
                continue  # the last step always syncs
            t0 = time.perf_counter()
            outcome = daemon.sync(AdapterSource(model))
            if not outcome.ok or outcome.report is None:
                raise RuntimeError(f"adapter sync v{outcome.version} failed: {outcome.error}")
            seconds = time.perf_counter() - t0
            report = outcome.report
            install_ms = 1000 * max(float(r.last_finalize.get("install_s", 0.0)) for r in engines)
            row = {"version": outcome.version, "bytes": report["bytes"], "seconds": seconds, "gbps": report["gbps"], "install_ms": install_ms, "loss": losses[-1]}
            syncs.append(row)
            say(
                f"v{row['version']} adapter {row['bytes'] / 1e6:.2f} MB of {full_bytes / 1e6:.2f} MB ({100 * row['bytes'] / full_bytes:.1f} %) "
                f"in {seconds:.3f} s ({row['gbps']:.2f} GB/s), install {install_ms:.1f} ms, loss {row['loss']:.3f}"
            )
        sent = dict(AdapterSource(model).iter_weights())
        exact = all(
            r.version == syncs[-1]["version"] and all(torch.equal(t, sent[n]) for n, t in r.adapter()[0].items()) for r in engines
        ) if syncs else False
        result = {
            "weights": "adapters", "versions": [s["version"] for s in syncs], "syncs": syncs,
            "engines": {r.name: r.version for r in engines}, "adapter_bytes": syncs[-1]["bytes"] if syncs else 0,
            "full_bytes": full_bytes, "loss_first": losses[0], "loss_last": losses[-1], "exact": exact,
        }
        say(
            f"summary: {len(syncs)} adapter syncs, engines at {result['engines']}, adapter {result['adapter_bytes'] / 1e6:.2f} MB vs "
            f"{full_bytes / 1e6:.2f} MB full, loss {result['loss_first']:.3f} -> {result['loss_last']:.3f}, engines hold the trainer's adapter: {exact}"
        )
        return result
    finally:
        daemon.close()
