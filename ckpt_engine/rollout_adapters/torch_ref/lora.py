"""`LoraRefRollout`: the reference receiver for adapter-only syncs (tests, and users without an engine).

It keeps adapter versions exactly as an engine must (`LoraReceiverCore`: validated against its LoRA
config before a byte moves, staged while receiving, installed whole on finalize, at most
`max_adapter_versions` live, an older version unloaded after its last request), as plain tensor
dicts. Its receiving rank runs in the calling process (a thread of the session's pool), so a test
needs no engine process. Requests are modelled by `begin_request()` (takes the newest version)
and `end_request(version)`.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Any

import torch

from ckpt_engine.lora_format import LoraSpec
from ckpt_engine.rollout_adapters.lora_local import LocalLoraRollout
from ckpt_engine.rollout_adapters.lora_receiver import LoraReceiverCore, LoraTarget

__all__ = ["LoraRefRollout", "linear_shapes"]


def linear_shapes(model: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of every `nn.Linear` of an HF model, by module path."""
    return {n: (m.out_features, m.in_features) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


class LoraRefRollout(LocalLoraRollout[int]):
    """An in-process engine that holds adapter versions as tensor dicts."""

    def __init__(
        self,
        name: str,
        base_shapes: Mapping[str, tuple[int, int]],
        *,
        max_rank: int,
        targets: frozenset[str] | set[str] | None = None,
        max_adapter_versions: int = 2,
    ) -> None:
        self.target = LoraTarget(max_rank, dict(base_shapes), frozenset(targets) if targets is not None else None)
        self._adapters: dict[int, tuple[dict[str, torch.Tensor], LoraSpec]] = {}
        super().__init__(name, LoraReceiverCore(lambda: self.target, self._build, self._adapters.pop, max_adapter_versions))
        self._requests: dict[int, int] = {}
        self.last_finalize: dict[str, Any] = {}
        """The last switch: `install_s` (staged tensors -> the newest version)."""

    def engine_key(self) -> Hashable:
        return ("lora-ref", id(self))

    def _build(self, version: int, tensors: dict[str, torch.Tensor], spec: LoraSpec) -> int:
        self._adapters[version] = (tensors, spec)
        return version

    # --- what the engine serves --------------------------------------------------------------
    @property
    def version(self) -> int | None:
        return self.core.versions.newest

    def adapter(self, version: int | None = None) -> tuple[dict[str, torch.Tensor], LoraSpec]:
        """The tensors and config of `version` (default: the newest)."""
        v = version if version is not None else self.version
        if v is None or v not in self._adapters:
            raise KeyError(f"engine {self.name!r} holds no adapter version {v} (live: {list(self._adapters)})")
        return self._adapters[v]

    def live_versions(self) -> list[int]:
        return list(self.core.versions.live)

    def begin_request(self) -> int:
        """A new request: it gets the newest version, and keeps it until `end_request`."""
        with self._lock:
            v = self.version
            if v is None:
                raise RuntimeError(f"engine {self.name!r} holds no adapter version yet")
            self._requests[v] = self._requests.get(v, 0) + 1
            self.core.versions.in_use = set(self._requests)
            return v

    def end_request(self, version: int) -> None:
        with self._lock:
            self._requests[version] -= 1
            if not self._requests[version]:
                del self._requests[version]
            self.core.observe(set(self._requests))

    # --- LocalLoraRollout -----------------------------------------------------------------------
    def finalize(self, version: int) -> None:
        with self._lock:
            self.last_finalize = self.core.finalize(version)
