"""Weight sources: what a trainer hands to `sync_rollout_weights()`.

A source knows the name, wire dtype and global shape of every tensor up front (`metadata()`, no
gathering), and yields the full tensors lazily in that order (`iter_weights()`). On a sharded
trainer producing a tensor is a collective, so every trainer rank walks `iter_weights()`; only the
rank with `is_sender` true streams what it yields.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Protocol, runtime_checkable

import torch

from ckpt_engine.manifest import TensorSpec

__all__ = ["StateDictSource", "WatchedWeights", "WeightSource", "spec_of"]


@runtime_checkable
class WeightSource(Protocol):
    """Optional attributes: `is_sender` (default True) and `stable_tensors` (default False: a
    yielded tensor is valid only until the next one is requested)."""

    def metadata(self) -> list[TensorSpec]: ...

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]: ...


def spec_of(name: str, tensor: torch.Tensor, dtype: torch.dtype | None = None) -> TensorSpec:
    return TensorSpec(name, str(dtype if dtype is not None else tensor.dtype).removeprefix("torch."), tuple(tensor.shape))


class StateDictSource:
    """A plain name -> tensor mapping (or an nn.Module's state dict) as a weight source.

    `dtype` casts floating-point tensors on the wire (e.g. fp32 master weights sent as bf16);
    `keep_dtype` names tensors that must keep their own dtype (e.g. MoE router gates).
    """

    is_sender = True
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

    def _wire_dtype(self, name: str, t: torch.Tensor) -> torch.dtype:
        if self.dtype is not None and t.is_floating_point() and name not in self.keep_dtype:
            return self.dtype
        return t.dtype

    def metadata(self) -> list[TensorSpec]:
        return [spec_of(n, t, self._wire_dtype(n, t)) for n, t in self.weights.items()]

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.weights.items()


class WatchedWeights:
    """An iterator over a source's weights that remembers whether the source itself raised.

    A failure mid-stream is then blamed on what caused it: the trainer's source (named as such,
    with its exception) or the transfer and the engines.
    """

    def __init__(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._weights = weights
        self._it = iter(weights)
        self.error: BaseException | None = None

    def anchors(self) -> list[torch.Tensor] | None:
        """The wrapped walk's anchors (`sharded_source.PieceWalk.anchors`), so a transport may
        replay its copy plan; None when it names none."""
        get = getattr(self._weights, "anchors", None)
        if not callable(get):
            return None
        try:
            return get()
        except BaseException as exc:
            self.error = exc
            raise

    def close(self) -> None:
        """End a walk `anchors()` started."""
        close = getattr(self._weights, "close", None)
        if callable(close):
            close()

    def __iter__(self) -> WatchedWeights:
        return self

    def __next__(self) -> tuple[str, torch.Tensor]:
        try:
            return next(self._it)
        except StopIteration:
            raise
        except BaseException as exc:
            self.error = exc
            raise
