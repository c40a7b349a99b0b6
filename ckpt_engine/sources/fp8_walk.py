"""The FP8 wire's walk (`Fp8WireSource.iter_weights`): which weights quantize together, and a record
of the walk that the next sync of the same tensors replays.

Why a record: on 2xH200 a Qwen3-30B-A3B FP8 sync was bound by this walk's host time (45 ms for
4,656 expert weights at 12 layers, against 24 ms for the link to move the bytes), per weight: the
grouping decisions, the grouped launch's table and checks. All of that depends only on the metadata
and on where the weights live, so a walk of a `stable_tensors` source records its steps (each
grouped launch with its table already on the device) and the next walk replays them while the
source yields the very same tensors, at the same addresses and layouts; left per weight are a few
identity and layout comparisons in list passes, its result views and the yield. Anything else
(another tensor, a moved one, another name) ends the replay there, and the rest walks as usual.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import chain, islice
from operator import attrgetter, is_
from typing import Any, Protocol

import torch

from ckpt_engine.fp8.layout import BLOCK
from ckpt_engine.fp8.quantize import quantize_block_fp8
from ckpt_engine.manifest import TensorSpec
from ckpt_engine.sources.wire import torch_dtype

__all__ = ["GroupKernel", "GroupLaunch", "IntoLaunch", "Quantized", "WalkCounts", "WalkPlan", "Walker", "tensor_layout", "to_wire"]


class GroupLaunch(Protocol):
    """One grouped launch, made once for its weights (`quantize_kernel.GroupLaunch`)."""

    ptrs: list[int]
    """The weights' addresses it was made for (`run` takes only weights still there)."""
    pos: list[int]
    """Weight i's codes are `run(ws)[pos[i]]`, its scales `run(ws)[len(ws) + pos[i]]`."""

    def run(self, ws: Sequence[torch.Tensor]) -> list[torch.Tensor]: ...


class GroupKernel(Protocol):
    """What the walk needs of a grouped quantize (`fp8/quantize_kernel.py` on CUDA)."""

    MAX_GROUP: int

    def groupable(self, w: torch.Tensor) -> bool: ...

    def plan_group(self, ws: Sequence[torch.Tensor], *, checked: bool = False) -> GroupLaunch: ...

    def plan_into(self, ws: Sequence[torch.Tensor], codes_at: Sequence[int], scales_at: Sequence[int]) -> IntoLaunch:
        """A launch writing into a bucket's buffer at those byte offsets (`sources/fp8_fill.py`)."""


class IntoLaunch(Protocol):
    """A grouped launch into a bucket's buffer (`quantize_kernel.IntoLaunch`), made once per bucket."""

    def run(self, out: torch.Tensor) -> None: ...


@dataclass
class WalkCounts:
    """Which path the quantized weights of one walk took: `grouped` weights in `launches` grouped
    launches, `alone` weights one launch each (a 30B-A3B walk whose experts go alone pays a launch's
    host time 18,432 times); `replayed` launches of those came from the last walk's record;
    `filled` buckets were written into the sender's slot by the walk itself (`fp8_fill.py`), in
    which `lent` tensors sent as they are travelled from their own memory (`fp8/direct.py` `Ask`)."""

    launches: int = 0
    grouped: int = 0
    alone: int = 0
    replayed: int = 0
    filled: int = 0
    lent: int = 0


@dataclass(frozen=True)
class Quantized:
    """A quantized weight's spec, wire dtype, shape (as torch compares it), wire bytes and scale
    tensor name, worked out once per source: the walk asks them per weight and sync."""

    spec: TensorSpec
    dtype: torch.dtype
    shape: torch.Size
    nbytes: int
    scale: str


def to_wire(spec: TensorSpec, t: torch.Tensor) -> torch.Tensor:
    """A yielded tensor (or a row block of it) in its wire dtype: a source may yield a float dtype
    to cast from (fp32 masters), and the quantized bytes must be those of the wire's."""
    return t.reshape(-1, *spec.shape[1:]).to(torch_dtype(spec.dtype))


@dataclass
class _Group:
    """One grouped launch as a walk made it: the source's items it took (names; which are weights,
    which passed between them as they are), its launch, and what it yields (names, and picks into
    the launch's results followed by the tensors passed between). Recorded: the weights (weakly: a
    record must not keep a trainer's tensors alive) and their layouts (`tensor_layout`)."""

    names: tuple[str, ...]
    weight_at: list[int]
    between_at: list[int]
    launch: GroupLaunch
    out_names: list[str]
    picks: list[int]
    refs: list[weakref.ref[torch.Tensor]] = field(default_factory=list)
    layout: tuple[list[Any], ...] = ()

    def emit(self, ws: Sequence[torch.Tensor], between: list[torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        views = self.launch.run(ws)
        return zip(self.out_names, map((views + between).__getitem__, self.picks))

    def weights_if_same(self, names: tuple[str, ...], ts: tuple[torch.Tensor, ...]) -> Sequence[torch.Tensor] | None:
        """The weights among the items `names`, `ts` if they are the recorded ones (names, objects,
        addresses and layouts as they were), else None. One pass per attribute, in C where it can
        be: a 30B-A3B group holds hundreds of weights, and these checks are most of a replay's
        host time a weight after its result views."""
        if names != self.names:
            return None
        ws = ts if not self.between_at else [ts[j] for j in self.weight_at]
        if not all(map(is_, ws, [r() for r in self.refs])) or list(map(torch.Tensor.data_ptr, ws)) != self.launch.ptrs:
            return None
        return ws if tensor_layout(ws) == self.layout else None


def tensor_layout(ws: Sequence[torch.Tensor]) -> tuple[list[Any], ...]:
    """Shapes, dtypes and contiguity: at the same address these fix what a launch reads (a grouped
    weight is contiguous, so its strides follow from its shape)."""
    return list(map(_shape, ws)), list(map(_dtype, ws)), list(map(torch.Tensor.is_contiguous, ws))


_shape, _dtype = attrgetter("shape"), attrgetter("dtype")


@dataclass
class _Alone:
    """A weight the recorded walk quantized alone (not groupable), recorded as `_Group` records its
    weights: a replay takes the same decision only for the same tensor."""

    plan: Quantized
    ref: weakref.ref[torch.Tensor]
    stamp: tuple[int, torch.Size, tuple[int, ...], torch.dtype]

    def same(self, t: torch.Tensor) -> bool:
        return t is self.ref() and _stamp(t) == self.stamp


def _stamp(t: torch.Tensor) -> tuple[int, torch.Size, tuple[int, ...], torch.dtype]:
    return t.data_ptr(), t.shape, t.stride(), t.dtype


Step = str | _Alone | _Group
"""A step of a recorded walk: a tensor passed on as it is (its name), a weight quantized alone, or
a grouped launch."""


@dataclass
class WalkPlan:
    """A recorded walk of a stable source (module docstring)."""

    steps: list[Step]


class Walker:
    """One walk: `walk` groups consecutive weights (up to `group_bytes`, of one kernel, dtype and
    device) into one launch where they stay valid until it (`holds`: the source's own tensors), or
    are this walk's own (a cast to the wire dtype made here); tensors sent as they are, read between
    two weights, wait for the launch (a dense model's biases and norms would otherwise end nearly
    every group). With `record`, a walk from the start that cast none of its weights (and grouped
    some) leaves its `WalkPlan` in `recorded`; `replay` takes one."""

    def __init__(
        self, quantized: dict[str, Quantized], kernel_of: Callable[[torch.Tensor], GroupKernel | None], group_bytes: int, holds: bool,
    ) -> None:
        self.quantized, self.kernel_of, self.group_bytes, self.holds = quantized, kernel_of, group_bytes, holds
        self.counts = WalkCounts()
        self.recorded: WalkPlan | None = None
        self.missed = False
        """A replay met another walk than its record's (the rest walked as usual)."""

    def walk(self, it: Iterator[tuple[str, torch.Tensor]], *, record: list[Step] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """`record`: the steps of this walk so far (a list to go on with), or None: not recorded."""
        counts, quantized, holds, group_bytes = self.counts, self.quantized, self.holds, self.group_bytes
        steps = record
        p = _Pending()
        for name, t in it:
            plan = quantized.get(name)
            if plan is None:
                if p.ws and holds and p.held + t.nbytes <= group_bytes:  # a bias or norm between two weights does not end the group
                    p.between_at.append(len(p.names))
                    p.names.append(name)
                    p.between.append(t)
                    p.held += t.nbytes
                    continue
                if p.ws:
                    yield from p.flush(counts, steps)
                if steps is not None:
                    steps.append(name)
                yield name, t
                continue
            w = t if t.dtype is plan.dtype and t.shape == plan.shape else to_wire(plan.spec, t)
            if w is not t:
                steps = None  # this walk's own casts: new tensors every walk
            k = self.kernel_of(w)
            if k is None or not ((holds or w.dtype is not t.dtype) and k.groupable(w)):
                if p.ws:
                    yield from p.flush(counts, steps)
                if steps is not None:
                    steps.append(_Alone(plan, weakref.ref(t), _stamp(t)))
                yield from self.alone(plan, w)
                continue
            here = (k, w.dtype, w.get_device())
            if p.ws and (here != p.key or p.held + plan.nbytes > group_bytes or len(p.ws) == k.MAX_GROUP):
                yield from p.flush(counts, steps)
            if not p.ws:
                p.kernel, p.key, p.held = k, here, 0
            p.weight_at.append(len(p.names))
            p.names.append(name)
            p.plans.append(plan)
            p.ws.append(w)
            p.held += plan.nbytes
        if p.ws:
            yield from p.flush(counts, steps)
        if steps is not None and any(isinstance(step, _Group) for step in steps):  # nothing to replay without a grouped launch
            self.recorded = WalkPlan(steps)

    def alone(self, plan: Quantized, w: torch.Tensor) -> tuple[tuple[str, torch.Tensor], ...]:
        """A weight quantized alone, as it comes (a launch of its own on CUDA, the eager recipe elsewhere)."""
        q, s = quantize_block_fp8(w, BLOCK)
        self.counts.alone += 1
        return (plan.spec.name, q.view(plan.spec.shape)), (plan.scale, s)

    def replay(self, plan: WalkPlan, it: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The walk `plan` recorded, while `it` yields what it recorded; from the first difference on
        (`missed`), the rest of `it` walks as usual, recorded after the steps that replayed."""
        counts = self.counts
        for i, step in enumerate(plan.steps):
            if not isinstance(step, _Group):
                item = next(it, None)
                name = step if isinstance(step, str) else step.plan.spec.name
                if item is None or item[0] != name or not (isinstance(step, str) or step.same(item[1])):
                    self.missed = True
                    yield from self.walk(chain([] if item is None else [item], it), record=plan.steps[:i])
                    return
                yield from (item,) if isinstance(step, str) else self.alone(step.plan, item[1])
                continue
            items = list(islice(it, len(step.names)))
            names, ts = zip(*items) if items else ((), ())
            ws = step.weights_if_same(names, ts)
            if ws is None:
                self.missed = True
                yield from self.walk(chain(items, it), record=plan.steps[:i])
                return
            counts.launches += 1
            counts.replayed += 1
            counts.grouped += len(ws)
            yield from step.emit(ws, [ts[j] for j in step.between_at])
        more = next(it, None)
        if more is not None:  # the record ended before the source: the rest walks as usual
            self.missed = True
            yield from self.walk(chain([more], it), record=list(plan.steps))


@dataclass
class _Pending:
    """The weights waiting for one grouped launch, and the tensors read between them."""

    kernel: GroupKernel | None = None
    key: tuple[object, torch.dtype, int] | None = None  # the kernel, dtype and device index
    held: int = 0
    names: list[str] = field(default_factory=list)
    weight_at: list[int] = field(default_factory=list)
    between_at: list[int] = field(default_factory=list)
    plans: list[Quantized] = field(default_factory=list)
    ws: list[torch.Tensor] = field(default_factory=list)
    between: list[torch.Tensor] = field(default_factory=list)

    def flush(self, counts: WalkCounts, steps: list[Step] | None) -> Iterator[tuple[str, torch.Tensor]]:
        """Quantize the pending weights in one launch: each one's codes and scales, in order, with
        the tensors read between them where they were read; recorded in `steps` (if any). Every
        weight passed `groupable`, and they share a dtype and device, so the kernel does not ask
        again. The pending state is emptied (the weights are not needed once the launch is queued)."""
        assert self.kernel is not None  # pending only fills where a grouped kernel takes the weights
        ws, n = self.ws, len(self.ws)
        launch = self.kernel.plan_group(ws, checked=True)
        out_names: list[str] = []
        picks: list[int] = []
        w_i = b_i = 0
        weights = iter(self.plans)
        for j in range(len(self.names)):
            if b_i < len(self.between_at) and self.between_at[b_i] == j:
                out_names.append(self.names[j])
                picks.append(2 * n + b_i)
                b_i += 1
                continue
            plan = next(weights)
            out_names += (plan.spec.name, plan.scale)  # the codes already in the weight's shape, the scales in theirs
            picks += (launch.pos[w_i], n + launch.pos[w_i])
            w_i += 1
        group = _Group(tuple(self.names), self.weight_at, self.between_at, launch, out_names, picks)
        if steps is not None:
            group.refs, group.layout = [weakref.ref(w) for w in ws], tensor_layout(ws)
            steps.append(group)
        counts.launches += 1
        counts.grouped += n
        between = self.between
        self.names, self.weight_at, self.between_at, self.plans, self.ws, self.between = [], [], [], [], [], []
        return group.emit(ws, between)
