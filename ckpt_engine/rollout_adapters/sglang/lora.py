"""`SglangLoraRollout`: adapter-only syncs into an SGLang server, through a PEFT folder on disk.

SGLang 0.5.23's `/load_lora_adapter_from_tensors` carries the tensors in SGLang's multiprocessing
serializer, which is pickle; nothing on ckpt-engine's wires is pickle, so that route is not used.
Instead the adapter's controller side receives the adapter (a few MB) as one more rank of the
weight-sync group, in the caller's process, writes it as a PEFT folder
(`adapter_model.safetensors` + `adapter_config.json`) under `adapter_dir` (a directory the server
can read: same host or a shared file system; `server_dir` when the server mounts it elsewhere), and
has SGLang load it with `/load_lora_adapter` under the name `<engine>-v<version>`. Requests name a
version with SGLang's `lora_path: <that name>`. The rule that the manifest is checked before a byte
moves, staging, and versions are `LoraReceiverCore`'s, as for every engine.

SGLang's `/unload_lora_adapter` stops new requests naming a version at once and frees it after the
requests that use it finished (answering then): so the previous versions stay loaded while they fit
in `max_adapter_versions`, and before a new version is loaded the oldest beyond that are unloaded
(the sync waits for their last requests, within `timeout_s`), so at most `max_adapter_versions`
are ever loaded. Start SGLang with `--enable-lora --max-lora-rank R --lora-target-modules ...`
and `--max-loaded-loras` >= `max_adapter_versions`; give the same rank and modules here.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Hashable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from ckpt_engine.lora_format import LoraSpec
from ckpt_engine.manifest import TensorSpec
from ckpt_engine.rollout_adapters.lora_local import LocalLoraRollout
from ckpt_engine.rollout_adapters.lora_receiver import LoraReceiverCore, LoraTarget
from ckpt_engine.rollout_adapters.sglang.rollout import SglangClient, hf_expected_specs

__all__ = ["SglangLoraRollout", "write_peft_folder"]

logger = logging.getLogger(__name__)


def write_peft_folder(folder: Path, tensors: dict[str, torch.Tensor], spec: LoraSpec) -> None:
    """`folder` as PEFT saves an adapter (written beside it, then renamed: a reader never sees half)."""
    from safetensors.torch import save_file

    partial = folder.with_name(f".{folder.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(partial / "adapter_model.safetensors"))
    (partial / "adapter_config.json").write_text(json.dumps(spec.peft_config(), sort_keys=True))
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(partial, folder)


class SglangLoraRollout(LocalLoraRollout[str]):
    """One LoRA-enabled SGLang server for adapter syncs; its receiving rank runs in this process."""

    def __init__(
        self,
        client: SglangClient,
        *,
        adapter_dir: str | os.PathLike[str],
        max_lora_rank: int,
        lora_target_modules: Iterable[str] | None = None,
        server_dir: str | None = None,
        max_adapter_versions: int = 2,
        expected_specs: Sequence[TensorSpec] | None = None,
    ) -> None:
        if isinstance(max_lora_rank, bool) or not isinstance(max_lora_rank, int) or max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be a positive int (the server's --max-lora-rank), got {max_lora_rank!r}")
        self.client = client
        self.adapter_dir = Path(adapter_dir)
        if not self.adapter_dir.is_dir():
            raise ValueError(f"engine {client.name!r}: adapter_dir {str(self.adapter_dir)!r} is not a directory (the server must read it)")
        self.server_dir = server_dir if server_dir is not None else str(self.adapter_dir)
        self._max_rank = max_lora_rank
        self._targets = frozenset(lora_target_modules) if lora_target_modules is not None else None
        self._expected = list(expected_specs) if expected_specs is not None else None
        self._target: LoraTarget | None = None
        self._specs: dict[int, LoraSpec] = {}
        super().__init__(client.name, LoraReceiverCore(self.target, self._write, self._retired, max_adapter_versions))
        self.loaded: list[int] = []
        """Versions SGLang holds, oldest first (this controller's loads)."""
        self.version: int | None = None
        self.last_finalize: dict[str, Any] = {}

    def engine_key(self) -> Hashable:
        return ("sglang", self.client.base_url)

    def target(self) -> LoraTarget:
        """The server's LoRA config: the given rank and modules, base shapes from the served model."""
        if self._target is None:
            specs = self._expected if self._expected is not None else list(hf_expected_specs(str(self.client.get_model_info()["model_path"])).values())
            shapes = {s.name[: -len(".weight")]: (int(s.shape[0]), int(s.shape[1])) for s in specs if s.name.endswith(".weight") and len(s.shape) == 2}
            self._target = LoraTarget(self._max_rank, shapes, self._targets)
        return self._target

    def lora_name(self, version: int | None = None) -> str:
        """SGLang's name of `version` (default: the newest): a request's `lora_path`."""
        v = version if version is not None else self.version
        if v is None:
            raise RuntimeError(f"engine {self.name!r} serves no adapter version yet: sync one first")
        return f"{self.name}-v{v}"

    def folder(self, version: int) -> Path:
        return self.adapter_dir / self.lora_name(version)

    # --- LoraReceiverCore's engine side --------------------------------------------------------
    def _write(self, version: int, tensors: dict[str, torch.Tensor], spec: LoraSpec) -> str:
        write_peft_folder(self.folder(version), tensors, spec)
        return self.lora_name(version)

    def _retired(self, version: int) -> None:
        """The core no longer counts `version` live; SGLang keeps it until `_make_room` unloads it."""

    # --- LocalLoraRollout -------------------------------------------------------------------------
    def finalize(self, version: int) -> None:
        """Write the folder, unload the versions beyond `max_adapter_versions`, load the new one:
        requests naming it are served from then on."""
        t0 = time.perf_counter()
        self.core.finalize(version)
        t1 = time.perf_counter()
        self._make_room()
        t2 = time.perf_counter()
        self.client.load_lora_adapter(self.lora_name(version), f"{self.server_dir.rstrip('/')}/{self.lora_name(version)}")
        self.loaded.append(version)
        self.version = version
        self.last_finalize = {"write_s": t1 - t0, "unload_s": t2 - t1, "load_s": time.perf_counter() - t2}

    def _make_room(self) -> None:
        keep = self.core.versions.max_versions - 1
        while len(self.loaded) > keep:
            old = self.loaded.pop(0)
            self.client.unload_lora_adapter(self.lora_name(old))
            shutil.rmtree(self.folder(old), ignore_errors=True)

    def health(self) -> dict[str, Any]:
        self.client.health()
        return {**self.core.health(), "loaded": list(self.loaded)}
