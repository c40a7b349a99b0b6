"""Weight sources: what a trainer hands to `sync_rollout_weights()`.

A source knows the name, wire dtype and global shape of every tensor up front (`metadata()`, no
gathering), and yields the full tensors lazily in that order (`iter_weights()`); on a sharded
trainer every rank walks it (producing a tensor is a collective) and only `is_sender` streams.
`WeightSource` declares every attribute the library reads, with its default (as vLLM's
`weight_transfer/base.py:WeightSource` does); sources that send from every rank extend
`ShardedWeightSource` (`sharded.py`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from ckpt_engine.manifest import TensorSpec
from ckpt_engine.sources.layouts import Layout, layout_of

__all__ = ["StateDictSource", "WatchedWeights", "WeightSource", "WeightWalk", "drain", "spec_of", "tensors_device"]


class WeightSource(ABC):
    """A trainer's weights, as one sync reads them (every trainer rank holds one); every rank calls
    `iter_weights()` once per sync and walks it to its end."""

    is_sender: bool = True
    """Whether this rank streams what `iter_weights()` yields (the others only walk it)."""
    stable_tensors: bool = False
    """Whether every yielded tensor stays valid and unchanged until the sync ends (e.g. a plain
    state dict): the transport may then send from it without a copy, and an installed-weight check
    may list it once more before the stream (`sync/installed.py`: its walk must then run no
    collective). False: a yielded tensor is valid only until the next one is requested."""
    fresh_tensors: bool = False
    """Whether every yielded tensor is new memory the source never writes again (e.g. a quantized
    temporary): a sender that is not `stable_tensors` may then hold a bucket's pieces and pack them
    in one batched copy, and region delivery may keep them without a clone."""
    process_group: Any = None
    """The trainer's process group over which a sync with many senders is announced (None: the
    default group)."""

    @property
    def device(self) -> torch.device | None:
        """The device the yielded tensors live on, known before the walk (None: not known). A sender
        whose configuration names no device takes this one, never the process's current CUDA device
        by accident (a trainer on cuda:1 with cuda:0 current would otherwise join the group from the
        engine's GPU)."""
        return None

    @abstractmethod
    def metadata(self) -> list[TensorSpec]:
        """Name, wire dtype and global shape of every tensor, in `iter_weights()` order; no gather."""

    @abstractmethod
    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full tensor) in `metadata()` order; a fresh walk on every call."""


_SPECS: dict[tuple[str, torch.dtype, torch.Size], TensorSpec] = {}
_SPECS_MAX = 1 << 20


def drain(source: WeightSource) -> None:
    """Walk `source` to its end, sending nothing: a refused sync still runs the gathers the other
    trainer ranks run in step (its walk is a collective)."""
    for _ in source.iter_weights():
        pass


def spec_of(name: str, tensor: torch.Tensor, dtype: torch.dtype | None = None) -> TensorSpec:
    """The tensor's spec, made (and checked) once per name, dtype and shape: a source's metadata is
    read every sync, and 18,867 checked specs (Qwen3-30B-A3B) cost ~100 ms of host time each time.
    Specs are frozen, so one instance serves every sync (and the plan's key compares them by
    identity first)."""
    dt = dtype if dtype is not None else tensor.dtype
    key = (name, dt, tensor.shape)
    spec = _SPECS.get(key)
    if spec is None:
        if len(_SPECS) >= _SPECS_MAX:  # names that never repeat: start over rather than grow
            _SPECS.clear()
        spec = _SPECS[key] = TensorSpec(name, str(dt).removeprefix("torch."), tuple(tensor.shape))
    return spec


class StateDictSource(WeightSource):
    """A plain name -> tensor mapping (or an nn.Module's state dict) as a weight source.

    `dtype` casts floating-point tensors on the wire (e.g. fp32 master weights sent as bf16);
    `keep_dtype` names tensors that must keep their own dtype (e.g. MoE router gates).
    """

    stable_tensors = True  # the mapping keeps every tensor alive for the whole sync

    def __init__(
        self,
        weights: Mapping[str, torch.Tensor] | torch.nn.Module,
        dtype: torch.dtype | None = None,
        keep_dtype: frozenset[str] | set[str] = frozenset(),
    ) -> None:
        if isinstance(weights, torch.nn.Module):
            weights = weights.state_dict()
        self.weights = dict(weights)
        self.dtype = dtype
        self.keep_dtype = frozenset(keep_dtype)
        self._layout: Layout | None = None

    def _wire_dtype(self, name: str, t: torch.Tensor) -> torch.dtype:
        if self.dtype is not None and t.is_floating_point() and name not in self.keep_dtype:
            return self.dtype
        return t.dtype

    def metadata(self) -> list[TensorSpec]:
        self._layout = layout_of(tuple(self.weights), list(self.weights.values()), (self.dtype, self.keep_dtype), self._walk)
        return list(self._layout.specs)

    def _walk(self) -> Layout:
        """Every tensor's spec and their device, read one by one (`sources/layouts.py` keeps them)."""
        if self.dtype is None:  # spec_of's cache, looked up inline: ~20 % less host time a tensor on a MoE's ~19,000
            get = _SPECS.get
            specs = [get((n, t.dtype, t.shape)) or spec_of(n, t) for n, t in self.weights.items()]
        else:
            specs = [spec_of(n, t, self._wire_dtype(n, t)) for n, t in self.weights.items()]
        return Layout(specs, tensors_device(self.weights.values()))

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.weights.items()

    @property
    def device(self) -> torch.device | None:
        """The device the last `metadata()` read with the specs, taken once (a sync reads the
        metadata, then the device, within its start); else read from the tensors."""
        layout, self._layout = self._layout, None
        return layout.device if layout is not None else tensors_device(self.weights.values())


def tensors_device(tensors: Iterable[torch.Tensor]) -> torch.device | None:
    """The one accelerator device that `tensors` live on (host tensors beside them are copied
    anyway), the host when all are host tensors, None when they span several accelerators."""
    devices = {t.device for t in tensors}
    accelerators = {d for d in devices if d.type != "cpu"}
    if len(accelerators) == 1:
        return accelerators.pop()
    return torch.device("cpu") if devices == {torch.device("cpu")} else None


class WeightWalk(Iterator[tuple[str, torch.Tensor]]):
    """One walk of a source's weights as a sender consumes it: (name, tensor) pairs, plus `anchors()`
    (the tensors every yielded tensor is a view of, for a recorded copy plan; None: unknown) and
    `close()`, which ends a walk `anchors()` started."""

    fresh: bool = False
    """The walk's source is `fresh_tensors` (see `WeightSource`): the sender may hold its pieces."""

    def anchors(self) -> list[torch.Tensor] | None:
        return None

    def close(self) -> None:
        """End a walk `anchors()` started (nothing by default)."""


class WatchedWeights(WeightWalk):
    """A walk over a source's weights that remembers whether the source itself raised, so a failure
    mid-stream is blamed on the trainer's source or on the transfer; a `WeightWalk`'s anchors pass on."""

    def __init__(self, weights: Iterable[tuple[str, torch.Tensor]], *, fresh: bool = False) -> None:
        self._walk = weights if isinstance(weights, WeightWalk) else None
        self.fresh = fresh or (self._walk is not None and self._walk.fresh)
        self._it = iter(weights)
        self.error: BaseException | None = None

    def anchors(self) -> list[torch.Tensor] | None:
        """The wrapped walk's anchors (see `WeightWalk`); None for a plain iterator."""
        if self._walk is None:
            return None
        try:
            return self._walk.anchors()
        except BaseException as exc:
            self.error = exc
            raise

    def close(self) -> None:
        if self._walk is not None:
            self._walk.close()

    def __next__(self) -> tuple[str, torch.Tensor]:
        try:
            return next(self._it)
        except StopIteration:
            raise
        except BaseException as exc:
            self.error = exc
            raise
