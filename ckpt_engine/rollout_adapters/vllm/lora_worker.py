"""Adapter versions inside a vLLM worker, in vLLM's own LoRA manager, without a disk round trip.

vLLM 0.32 loads a LoRA adapter only from a path (`WorkerLoRAManager._load_adapter` reads
`adapter_config.json` and the safetensors file). Here the received tensors become a `LoRAModel`
through vLLM's own `LoRAModel.from_lora_tensors` and `PEFTHelper` (validated against the engine's
`LoRAConfig` like a loaded adapter), and go straight into the worker's LRU LoRA manager under the
id `lora_int_id(version)`, activated at once (`preload`; in-process `LLM`). Requests name a version
by its `ckpt-engine://adapter/<engine>/v<version>` path, which nothing reads: the in-process
controller hands out `LoRARequest`s with id `lora_int_id(version)`; vLLM's OpenAI server gives the
ids itself when the controller registers a version by name (`/v1/load_lora_adapter`), and the
worker builds that id's `LoRAModel` from the kept tensors (no preload then).

Three hooks on vLLM's `WorkerLoRAManager` (wrapped once per process, at class level: the native
weight-transfer engine is handed only the model; managers of no `VllmLoraCore` run vLLM's own code)
keep it consistent with `AdapterVersions` and the installed-weight checks:
- `_load_adapter` (vLLM calls it for an id it does not hold: the server's registration, or an id
  its LRU cache evicted) builds the version its path names from the tensors kept in memory; other
  paths load as before. An id of a
  version already unloaded (a request that waited in the queue, never started, across two syncs)
  gets the newest version: it starts now, and new requests get the newest.
- `set_active_adapters` (every step, with the step's LoRA requests) tells which versions running
  requests still use; an older version goes after its last request.
- `add_adapter` (the LRU worker manager's: it adds an adapter and activates it into the LoRA slots;
  the server's registration calls it) has a checked version's slots compared right after vLLM
  activated it (`activated`); the outcome is reported in the worker's health (`slot_check`).
And one on vLLM's `LRUCacheLoRAModelManager`:
- `activate_adapter` (it writes a version into a LoRA slot; vLLM calls it again for a version its
  LRU evicted from the slots, `max_loras`, or from its CPU cache, `max_cpu_loras`, and rebuilt) has
  the slots of a version whose install was checked compared again each time vLLM writes them
  (`reactivated`); the outcomes are reported in the worker's health (`slot_rechecks`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from ckpt_engine.installed import InstalledReport, InstalledRequest
from ckpt_engine.lora_format import ADAPTER_CONFIG, LoraSpec
from ckpt_engine.rollout_adapters.lora_receiver import LoraReceiverCore, LoraTarget
from ckpt_engine.rollout_adapters.vllm.compat import features_of
from ckpt_engine.rollout_adapters.vllm.lora_installed import adapter_report, checkpoint_names, slot_problems

__all__ = ["LORA_PATH_PREFIX", "VllmLoraCore", "lora_base_shapes", "lora_int_id", "lora_path", "version_of_lora_path"]

logger = logging.getLogger(__name__)

LORA_PATH_PREFIX = "ckpt-engine://adapter/"
"""`LoRARequest.lora_path` of a ckpt-engine version (vLLM requires a non-empty path; none is read)."""


def lora_int_id(version: int) -> int:
    """vLLM's LoRA id of an adapter version (ids must be > 0; versions start at 0)."""
    return version + 1


def lora_path(engine: str, version: int) -> str:
    """`LoRARequest.lora_path` naming `version` of `engine`'s adapter (read by nobody; parsed by the worker)."""
    return f"{LORA_PATH_PREFIX}{engine}/v{version}"


def version_of_lora_path(path: object) -> int | None:
    """The version a `lora_path()` names; None for any other path (an adapter loaded from disk)."""
    text = str(path)
    if not text.startswith(LORA_PATH_PREFIX):
        return None
    tail = text.rsplit("/v", 1)[-1]
    return int(tail) if tail.isdigit() else None


def lora_base_shapes(model: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """HF module path -> (out_features, in_features) of every module vLLM wrapped for LoRA, with
    vLLM's stacking undone (`qkv_proj` -> q/k/v_proj, `gate_up_proj` -> gate/up_proj), global shapes."""
    from vllm.lora.layers import BaseLayerWithLoRA
    from vllm.model_executor.layers.linear import LinearBase, QKVParallelLinear

    packed: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", {}) or {})
    shapes: dict[str, tuple[int, int]] = {}
    for name, module in model.named_modules():
        base = getattr(module, "base_layer", None) if isinstance(module, BaseLayerWithLoRA) else None
        if not isinstance(base, LinearBase):
            continue
        leaf = name.rsplit(".", 1)[-1]
        parent = name[: -len(leaf)]
        if leaf in packed:
            if isinstance(base, QKVParallelLinear):
                rows = [base.total_num_heads * base.head_size, base.total_num_kv_heads * base.head_size, base.total_num_kv_heads * base.v_head_size]
            else:
                rows = list(base.output_sizes)
            for sub, r in zip(packed[leaf], rows):
                shapes[f"{parent}{sub}"] = (int(r), int(base.input_size))
        else:
            shapes[name] = (int(base.output_size), int(base.input_size))
    return shapes


class SlotCheckedCore(LoraReceiverCore[int]):
    """A vLLM worker's `LoraReceiverCore` whose health also says how the LoRA slots of the newest
    checked version compared: behind the OpenAI server vLLM activates a version inside its own call
    (the registration), where nothing may raise, so the handle reads the outcome here."""

    slot_check: dict[str, Any] | None = None
    """{"version", "problems"}: problems None until vLLM activated the version; None: not checked."""

    def __init__(
        self, target: Callable[[], LoraTarget], build: Callable[[int, dict[str, torch.Tensor], LoraSpec], int], unload: Callable[[int], None],
        max_versions: int, device: torch.device,
    ) -> None:
        super().__init__(target, build, unload, max_versions, device)
        self.slot_rechecks: dict[str, Any] = {"count": 0, "problems": []}
        """The comparisons of a checked version's slots each time vLLM wrote them again (after its
        LRU evicted the version): how many, and the problems found (the last 20)."""

    def health(self) -> dict[str, Any]:
        return {**super().health(), "slot_check": self.slot_check, "slot_rechecks": self.slot_rechecks}


class VllmLoraCore:
    """One vLLM worker's adapter versions (every method runs in the worker: via collective_rpc from
    the worker extension, or from the native weight-transfer engine)."""

    def __init__(self, get_model: Callable[[], torch.nn.Module], vllm_config: Any, max_versions: int) -> None:
        adapters = getattr(get_model(), "lora_manager", None)  # vLLM's LoRAModelManager sets it on the model
        if adapters is None or vllm_config.lora_config is None:
            raise RuntimeError(
                "adapter syncs need vLLM's LoRA support: start the engine with enable_lora=True "
                "(and max_lora_rank >= the adapter's rank, max_loras >= max_adapter_versions)"
            )
        self.adapters = adapters
        """vLLM's `LRUCacheLoRAModelManager`: the LoRA models this worker holds, by id."""
        self.lora_config = vllm_config.lora_config
        self._vocab_size = int(vllm_config.model_config.get_vocab_size())
        text = vllm_config.model_config.hf_config.get_text_config()
        self._max_positions = getattr(text, "max_position_embeddings", None)
        self._model = get_model
        self._tensors: dict[int, tuple[dict[str, torch.Tensor], LoraSpec]] = {}
        self._shapes: tuple[int, dict[str, tuple[int, int]]] | None = None
        self._ids: dict[int, set[int]] = {}
        """Version -> the LoRA ids vLLM holds it under (ours with preload, the server's)."""
        self.preload = True
        """Install each version under `lora_int_id(version)` at finalize (in-process `LLM`); off
        behind the OpenAI server, whose registration loads it under its own id."""
        self._features = features_of()
        """What this vLLM release's LoRA loading offers (`vllm/compat.py`), decided once."""
        self._armed: InstalledRequest | None = None
        """The installed-weight check of the sync under way (`vllm/lora_installed.py`)."""
        self._checked: tuple[int, Any] | None = None
        """(id of the staged tensors, the `LoRAModel` the check read): finalize installs that one."""
        self._built: dict[int, Any] = {}
        """Version -> its checked `LoRAModel`, for the server's first load of it (preload off)."""
        self._slots_due: int | None = None
        """Behind the server: the checked version whose slots are compared when vLLM activates it."""
        self._slots_checked: set[int] = set()
        """Versions whose slots were checked when first activated: compared again whenever vLLM
        writes them into a slot again (`reactivated`)."""
        # received on the model's device (NCCL and CUDA IPC land only there), kept on the host as vLLM
        # keeps its CPU LoRA models (`_install`)
        device = next(get_model().parameters()).device
        self.core = SlotCheckedCore(self.target, self._install, self._unload, max_versions, device)
        _install_hooks()
        _CORES[id(adapters)] = self

    # --- the engine's LoRA config ------------------------------------------------------------
    def target(self) -> LoraTarget:
        model = self._model()
        if self._shapes is None or self._shapes[0] != id(model):
            self._shapes = (id(model), lora_base_shapes(model))
        shapes = self._shapes[1]
        wanted = self.lora_config.target_modules
        targets = frozenset(wanted) if wanted else frozenset(m.rsplit(".", 1)[-1] for m in shapes)
        return LoraTarget(int(self.lora_config.max_lora_rank), shapes, targets)

    # --- install / unload --------------------------------------------------------------------
    def _lora_model(self, lora_id: int, tensors: dict[str, torch.Tensor], spec: LoraSpec) -> Any:
        """vLLM's own `LoRAModel` from in-memory tensors, checked like an adapter loaded from disk."""
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        helper = PEFTHelper.from_dict({**spec.peft_config(), "vllm_max_position_embeddings": self._max_positions})
        helper.validate_legal(self.lora_config)
        adapters = self.adapters
        # lora_B copied: vLLM merges the scaling into lora_B in place when it adds a model
        # (`optimize`; nothing writes lora_A), and `from_lora_tensors` keeps CPU tensors of the LoRA
        # dtype as they are; the kept tensors must stay as received, since a version is rebuilt from
        # them (eviction, the server's id, vLLM dropping every LoRA model after a weight update).
        lora = LoRAModel.from_lora_tensors(
            lora_id, {n: t.clone() if ".lora_B." in n else t for n, t in tensors.items()}, helper, device="cpu", dtype=self.lora_config.lora_dtype, model_vocab_size=self._vocab_size,
            weights_mapper=self._weights_mapper(), skip_prefixes=getattr(adapters.model, "lora_skip_prefixes", None),
        )
        if self._features.lora_modules_to_save:
            adapters._validate_modules_to_save(lora)
        return lora

    def _weights_mapper(self) -> Any:
        mapper = getattr(self.adapters.model, "hf_to_vllm_mapper", None)
        if mapper is None:
            return None
        return mapper.get_rename_mapper() if self._features.lora_rename_mapper else mapper.get_unstacked_mapper()

    def _install(self, version: int, tensors: dict[str, torch.Tensor], spec: LoraSpec) -> int:
        lora_id = lora_int_id(version)
        checked, self._checked = self._checked, None
        armed, self._armed = self._armed, None
        received, tensors = tensors, {n: t.cpu() for n, t in tensors.items()}
        if checked is not None and checked[0] == id(received):  # the staged dict the check read (its config popped since)
            lora = checked[1]  # the model the installed-weight check read
            lora.id = lora_id
        else:
            lora = self._lora_model(lora_id, tensors, spec)  # checked here even when the server loads it later
        self._tensors[version] = (tensors, spec)
        self.core.slot_check = None if armed is None else {"version": version, "problems": None}
        if not self.preload:
            self._built = {version: lora}  # the server's first load of this version takes it
            self._slots_due = version if armed is not None else None  # checked when vLLM activates it
            return lora_id
        adapters = self.adapters
        adapters.remove_adapter(lora_id)  # a stale one of the same id (never served: versions only grow)
        if len(adapters) + 1 > adapters.capacity:
            adapters.remove_oldest_adapter()  # its tensors stay here: `_load_adapter` rebuilds it if asked
        adapters.add_adapter(lora)
        adapters.activate_adapter(lora_id)
        if armed is not None:  # the slots vLLM's set_lora wrote, against what it was handed (each TP rank: its slice)
            problems = self._slot_problems(version, lora_id, tensors)
            if problems:  # this rank answers its own (the handle names the worker; each problem its TP rank)
                adapters.remove_adapter(lora_id)
                self._tensors.pop(version, None)
                raise RuntimeError(f"adapter version {version} not installed: {'; '.join(problems[:10])}")
            self._slots_checked.add(version)
        self._ids.setdefault(version, set()).add(lora_id)
        return lora_id

    def _slot_problems(self, version: int, lora_id: int, tensors: dict[str, torch.Tensor]) -> list[str]:
        """The slot check of `version`, active under `lora_id` (`lora_installed.slot_problems`), kept
        for `health` (the handle behind the OpenAI server reads it there)."""
        adapters = self.adapters
        lora = adapters.get_adapter(lora_id)
        problems = slot_problems(adapters, lora, adapters.lora_index_to_id.index(lora_id), checkpoint_names(tensors, self._weights_mapper()))
        self.core.slot_check = {"version": version, "problems": problems}
        return problems

    def activated(self, request: Any) -> None:
        """vLLM's worker manager added (and activated) `request`'s adapter: behind the OpenAI server,
        the registration of a checked version (or the first request naming it) lands here, and its
        slots are compared now. A difference is kept for `health` and logged; nothing is raised
        inside vLLM's call (the handle fails the sync and unregisters the name)."""
        if self._slots_due is None:  # every step's adapters come here too: nothing due
            return
        version, lora_id = version_of_lora_path(request.lora_path), int(request.lora_int_id)
        if version != self._slots_due or version not in self._tensors or lora_id not in self.adapters.lora_index_to_id:
            return
        self._slots_due = None
        problems = self._slot_problems(version, lora_id, self._tensors[version][0])
        if problems:
            self.core.stale = True  # out of service until a complete sync
            logger.error("adapter version %s: its LoRA slots differ: %s", version, "; ".join(problems[:10]))
        else:
            self._slots_checked.add(version)

    def reactivated(self, lora_id: int) -> None:
        """vLLM wrote LoRA id `lora_id` into a slot again (its LRU had evicted it from the slots, or
        from its CPU cache and `load` rebuilt it): a version whose slots were checked when first
        activated is compared again, as then. Nothing may raise inside vLLM's step: a difference
        is kept for `health` (`slot_rechecks`), logged by name, and the worker is stale (out of
        service until a complete sync)."""
        version = next((v for v, ids in self._ids.items() if lora_id in ids), None)
        if version is None or version not in self._slots_checked or version not in self._tensors:
            return  # not ours, not checked when installed, or unloaded
        adapters = self.adapters
        names = checkpoint_names(self._tensors[version][0], self._weights_mapper())
        problems = slot_problems(adapters, adapters.get_adapter(lora_id), adapters.lora_index_to_id.index(lora_id), names)
        rechecks = self.core.slot_rechecks
        rechecks["count"] += 1
        if problems:
            said = [f"adapter version {version}, written into its LoRA slot again after vLLM's LRU evicted it: {p}" for p in problems]
            rechecks["problems"] = (rechecks["problems"] + said)[-20:]
            self.core.stale = True
            logger.error("%s", "; ".join(said[:10]))

    # --- installed-weight checks (vllm/lora_installed.py) --------------------------------------
    def installed_arm(self, request: InstalledRequest) -> None:
        """Before the stream: the check of this sync (the slots are compared at its install)."""
        self._armed, self._checked = request, None

    def installed(self, request: InstalledRequest) -> InstalledReport:
        """After the receive, before finalize: the received adapter built into vLLM's `LoRAModel` (the
        one finalize installs), each checkpoint tensor read back from it."""
        staged = self.core.staged
        if staged is None:
            return InstalledReport(missing=[f"{n}: no complete adapter received" for n in request.names])
        tensors = {n: t.cpu() for n, t in staged.items()}
        # built before its version is known: a provisional id (vLLM wants one > 0), set at the install
        lora = self._lora_model(2**31 - 1, {n: t for n, t in tensors.items() if n != ADAPTER_CONFIG}, LoraSpec.decode(tensors[ADAPTER_CONFIG]))
        self._checked = (id(staged), lora)
        return adapter_report(lora, tensors, request, self._weights_mapper())

    def _unload(self, version: int) -> None:
        self._tensors.pop(version, None)
        self._slots_checked.discard(version)
        for lora_id in self._ids.pop(version, set()):
            self.adapters.remove_adapter(lora_id)

    # --- what the hooks on vLLM's worker LoRA manager ask ------------------------------------
    def load(self, request: Any, version: int) -> Any:
        """The `LoRAModel` of `version` under the request's id (the newest when it was unloaded)."""
        if version not in self._tensors:
            newest = self.core.versions.newest
            if newest is None:
                raise RuntimeError(f"LoRA {request.lora_name!r}: no ckpt-engine adapter version is installed")
            logger.warning("LoRA %s: version unloaded before the request started; serving version %s", request.lora_name, newest)
            version = newest
        self._ids.setdefault(version, set()).add(int(request.lora_int_id))
        built = self._built.pop(version, None)
        if built is not None:  # the checked model, once (vLLM merges the scaling into it when it adds it)
            built.id = request.lora_int_id
            return built
        return self._lora_model(request.lora_int_id, *self._tensors[version])

    def observe(self, requests: set[Any]) -> None:
        """A step's LoRA requests: versions none of them uses (but the newest) go."""
        self.core.observe({v for v in (version_of_lora_path(r.lora_path) for r in requests if r) if v is not None})


_CORES: dict[int, VllmLoraCore] = {}
"""id(vLLM's LoRAModelManager) -> the core of that worker (one per worker process)."""


def _install_hooks() -> None:
    """Wrap `WorkerLoRAManager._load_adapter` and `set_active_adapters`, the LRU worker manager's
    `add_adapter` and the LRU model manager's `activate_adapter`, once per process, so that a worker
    manager whose model manager belongs to a `VllmLoraCore` builds ckpt-engine versions from memory,
    reports each step's LoRA requests and has a checked version's slots compared once vLLM activated
    it, and again whenever vLLM writes them again after an eviction. At class level: vLLM hands the native
    weight-transfer engine only the model, never the worker's LoRA manager; every other manager
    (and every other path) runs vLLM's own code unchanged."""
    from vllm.lora.model_manager import LRUCacheLoRAModelManager
    from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager, WorkerLoRAManager

    if getattr(WorkerLoRAManager, "_ckpt_engine_hooked", False):
        return
    load_from_path = WorkerLoRAManager._load_adapter
    set_active = WorkerLoRAManager.set_active_adapters
    add = LRUCacheWorkerLoRAManager.add_adapter  # the worker's manager (adds and activates)
    activate = LRUCacheLoRAModelManager.activate_adapter  # the model manager's (writes the slots)

    def _load_adapter(self: Any, request: Any) -> Any:
        core = _CORES.get(id(self._adapter_manager))
        version = version_of_lora_path(request.lora_path)
        if core is None or version is None:
            return load_from_path(self, request)
        return core.load(request, version)

    def set_active_adapters(self: Any, requests: set[Any], mapping: Any) -> None:
        core = _CORES.get(id(getattr(self, "_adapter_manager", None)))
        if core is not None:
            core.observe(requests)
        set_active(self, requests, mapping)

    def add_adapter(self: Any, request: Any) -> bool:
        loaded = add(self, request)
        core = _CORES.get(id(self._adapter_manager))
        if core is not None:
            core.activated(request)
        return loaded

    def activate_adapter(self: Any, lora_id: int) -> bool:
        written = activate(self, lora_id)  # False: already in a slot (nothing written)
        core = _CORES.get(id(self))
        if written and core is not None:
            core.reactivated(lora_id)
        return written

    WorkerLoRAManager._load_adapter = _load_adapter
    LRUCacheLoRAModelManager.activate_adapter = activate_adapter
    LRUCacheWorkerLoRAManager.add_adapter = add_adapter
    WorkerLoRAManager.set_active_adapters = set_active_adapters
    WorkerLoRAManager._ckpt_engine_hooked = True
