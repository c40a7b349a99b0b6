"""Installed-weight checks of an adapter (LoRA) sync inside a vLLM worker (issue 42 item 5).

An adapter version reaches vLLM's kernels in two steps, each checked where vLLM exposes it:
1. **vLLM's `LoRAModel`** (`LoRAModel.from_lora_tensors`: the weights mapper, the LoRA dtype, one
   `LoRALayerWeights` per module), built from the received tensors before the version is installed.
   `adapter_report` reads each checkpoint tensor back out of it (`lora_a` of the module its name maps
   to, `lora_b` before vLLM merges the scaling into it) and digests it like any installed tensor,
   so the controller compares it with the source (`sync/installed.py`): a mapper that sends a tensor
   to the wrong module, a transpose or a dropped tensor differs by name. It runs at `verify`, before
   finalize; the model checked is the one finalize installs (`VllmLoraCore`).
2. **The LoRA slots** the kernels read (`lora_a_stacked` / `lora_b_stacked` of every LoRA layer,
   written by vLLM's `set_lora` when the version is activated: sliced for TP, packed for fused
   QKV / gate_up, scaled). Activation happens at finalize (in process: the worker activates it;
   behind the OpenAI server: the registration's `add_adapter` activates it, or else the first request
   naming it), after the controller's compare, so `slot_problems` compares each slot with what vLLM's
   own model manager hands `set_lora` for it, exactly, right after the activation: a `set_lora` that
   skips a module or copies a transposed tensor fails the finalize, naming the checkpoint tensor
   (and a TP worker's rank), and the version is never published (behind the server: its name
   unregistered, `served_slot_problems` in `vllm/lora.py`). A TP worker's slots hold the slice vLLM's
   `slice_lora_a/b` cut of what it was handed (lora_B of a column-parallel layer by output rows,
   lora_A of a row-parallel one by input columns): each rank compares its own slice, cut by those
   same functions, and answers its own problems (the handle names the worker, each problem its TP rank).

vLLM writes a version's slots again itself after its LRU evicted it (from the `max_loras` slots, or
from the `max_cpu_loras` cache, then rebuilt from the worker's tensors): each time, a version whose
slots were checked at its install is compared again the same way (`VllmLoraCore.reactivated`).
Nothing may raise inside vLLM's step, so a difference is named in the worker's health
(`slot_rechecks`: the version, the checkpoint tensor, the slot) and its log, and the worker is
stale. Not checked: the slots of a layer whose slices vLLM expands (a 4-slice layer fed 3 packed
tensors).
Through vLLM's weight-transfer API step 1 runs as for any channel (its `installed` phase); step 2
runs when vLLM first activates the version, but its outcome is only logged by the worker (that route
cannot ask the workers' health, and the sync has ended by then).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch

from ckpt_engine.installed import InstalledReport, InstalledRequest, Key, digest
from ckpt_engine.lora_format import ADAPTER_CONFIG, PEFT_PREFIX

__all__ = ["adapter_report", "checkpoint_names", "slot_problems"]


def checkpoint_names(staged: Mapping[str, torch.Tensor], mapper: Any) -> dict[tuple[str, bool], str]:
    """(vLLM module name, is lora_A) -> the checkpoint name it came from (vLLM's own name parser)."""
    from vllm.lora.utils import parse_fine_tuned_lora_name

    return {parse_fine_tuned_lora_name(n, mapper): n for n in staged if n != ADAPTER_CONFIG}


def adapter_report(lora: Any, staged: Mapping[str, torch.Tensor], request: InstalledRequest, mapper: Any) -> InstalledReport:
    """Digests of every requested checkpoint tensor as vLLM's `LoRAModel` `lora` holds it (step 1)."""
    t0 = time.perf_counter()
    names = checkpoint_names(staged, mapper)
    held: dict[str, torch.Tensor] = {}
    unchecked: dict[str, str] = {}
    for (module, is_a), name in names.items():
        weights = lora.loras.get(module)
        tensor = None if weights is None else (weights.lora_a if is_a else weights.lora_b)
        if tensor is None:
            continue
        if tensor.dtype != staged[name].dtype:
            unchecked[name] = f"{name} (vLLM holds it as {tensor.dtype}, the sync sent {staged[name].dtype})"
            continue
        held[name] = tensor
    if ADAPTER_CONFIG in staged:
        held[ADAPTER_CONFIG] = staged[ADAPTER_CONFIG]  # the PEFT config the worker decoded
    keys: list[Key] = [(n, None) for n in dict.fromkeys(request.names) if n in held]
    values = [digest(held[n], request.seed, request.samples) for n, _ in keys]
    answers = torch.stack([v.cpu() for v in values]).tolist() if values else []
    missing = sorted(f"{n}: vLLM's LoRA model has no such tensor" for n in request.names if n not in held and n in staged and n not in unchecked)
    return InstalledReport(dict(zip(keys, answers)), [], sorted(unchecked.values()), missing, time.perf_counter() - t0)


def slot_problems(adapters: Any, lora: Any, index: int, names: Mapping[tuple[str, bool], str]) -> list[str]:
    """Every slot of LoRA slot `index` that differs from what vLLM's model manager hands `set_lora`
    for `lora` (step 2; after `activate_adapter`, so `lora` is packed and scaled as installed); on a
    TP worker, from this rank's slice of it, cut as `set_lora` cuts it."""
    from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA

    problems: list[str] = []
    for module_name, module in adapters.modules.items():
        weights = adapters._get_lora_layer_weights(lora, module_name)
        if not weights or not hasattr(module, "lora_a_stacked"):
            continue
        a, b = weights.lora_a, weights.lora_b
        a_list, b_list = (a if isinstance(a, list) else [a]), (b if isinstance(b, list) else [b])
        if len(a_list) != len(module.lora_a_stacked) or len(b_list) != len(module.lora_b_stacked):
            continue  # vLLM expands these slices itself (a 4-slice layer): not followed
        tp = getattr(module, "tp_size", 1)
        where = ""
        if tp > 1:
            if not isinstance(module, BaseLinearLayerWithLoRA):
                continue  # a vocab-parallel embedding or logits processor cuts its own way: not followed
            # this rank's slice, cut by the functions set_lora cuts it with (a packed layer: a list each)
            a_list, b_list = _as_list(module.slice_lora_a(a)), _as_list(module.slice_lora_b(b))
            where = f" (TP rank {module.tp_rank} of {tp})"
        subs = adapters.packed_modules.get(module_name) if isinstance(a, list) else None  # full names of q/k/v_proj
        for i, (ai, bi) in enumerate(zip(a_list, b_list)):
            sub = module_name if subs is None else subs[i]
            for is_a, want, stacked in ((True, ai, module.lora_a_stacked[i]), (False, bi, module.lora_b_stacked[i])):
                if want is None:
                    continue
                got = stacked[index, 0, : want.shape[0], : want.shape[1]]
                if not torch.equal(got, want.to(device=got.device, dtype=got.dtype)):
                    name = names.get((sub, is_a), f"{PEFT_PREFIX}{sub}.lora_{'A' if is_a else 'B'}.weight")
                    problems.append(f"{name}: vLLM's LoRA slot {index} of {module_name}{where} differs from the adapter it built")
    return problems


def _as_list(x: Any) -> list[Any]:
    return x if isinstance(x, list) else [x]

