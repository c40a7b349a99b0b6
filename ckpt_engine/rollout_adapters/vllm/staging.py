"""A staged version in a vLLM worker: the next weights stream in on a background thread while the
engine keeps stepping on its live weights; the swap loads them between two engine steps.

Why a thread: vLLM runs `collective_rpc` calls in its engine loop between two steps, so a call that
blocked for the whole stream would stop generation for as long as today's pause. The call that
starts a staged receive returns at once; the controller then polls (one short call between steps
each) until every rank holds the whole version, checked, or (the native backend, whose calls return
nothing) each rank reports its end through the rendezvous store (`on_end`, `vllm/stage_outcome.py`).

Where the staged version lives. With a delta request (patches, or the dense seed of a delta chain)
the receiver's base images hold the new version once every patch has passed its check, and they are
not written again before the next receive: the staged version is their views, no copy. Otherwise
(delta off) each tensor is copied, as it lands, into a staging copy that is kept for the next
staged sync (`LoaderCopy`); `room` says whether one fits.

With a receive plan (TP/EP slices) the staged version is the rank's region items, kept as they
landed (views of the checked base images, or copies of only the slice bytes, so the staging copy
and `room` count what the rank receives, not the model); each item is checked against the plan as
it lands, and the swap assembles them into what vLLM's loaders take (`vllm/region_landing.py`).
This is why the worker does
not use `WeightReceiver.receive(stage=...)`: its `full` stage copies live tensors in the wire
layout, which a vLLM worker does not hold.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any, TypeVar

import torch

from ckpt_engine.rollout_adapters.vllm.region_landing import LandingFactory, RegionItem, RegionLanding
from ckpt_engine.rollout_adapters.vllm.shadow import ShadowWeights

__all__ = ["LoaderCopy", "OnEnd", "Prepare", "Sink", "StagedReceive", "Staging", "free_bytes"]

logger = logging.getLogger(__name__)

_Name = TypeVar("_Name", bound=Hashable)

Sink = Callable[[list[tuple[str, torch.Tensor]]], None]
"""Takes one bucket's loadable (name, tensor) pairs."""

OnEnd = Callable[[str | None], None]
"""Told once a staged receive ended: None when the version is whole and checked, else why it failed
(the native backend reports it through the rendezvous store, `vllm/stage_outcome.py`)."""

Prepare = Callable[["StagedReceive"], ShadowWeights | None]
"""Builds a checked staged version's post-processed image off the step path (`vllm/shadow.py`), or
None where it cannot (the swap then reloads)."""


def free_bytes(device: torch.device) -> int:
    """Memory this worker could still allocate on `device` (CUDA: free device memory; host:
    MemAvailable)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


class LoaderCopy:
    """Per name, a copy of what the loader would load, for a sync that brings no stable views; kept
    from sync to sync (a fresh allocation per sync would cost new pages every time). Keyed by the
    loader's names (or, with a receive plan, name and region), not the live tensors: vLLM's live
    weights have no wire layout (stacked qkv, repacked on CPU), so `pipeline/staging.py`'s staging
    copy of live tensors does not apply."""

    SLAB_ALIGN = 512
    """Byte alignment of each tensor in a slab (the CUDA caching allocator's block rounding)."""

    def __init__(self) -> None:
        self.tensors: dict[Hashable, torch.Tensor] = {}
        self.slabbed: frozenset[Hashable] = frozenset()
        """The names whose held tensors are the views of the last `slab` (none reallocated since)."""

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def keep(self, name: Hashable, tensor: torch.Tensor) -> torch.Tensor:
        held = self.tensors.get(name)
        if held is None or held.shape != tensor.shape or held.dtype != tensor.dtype or held.device != tensor.device:
            held = self.tensors[name] = torch.empty_like(tensor, memory_format=torch.contiguous_format)
            self.slabbed -= {name}
        held.copy_(tensor)
        return held

    def slot(self, name: Hashable, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The held tensor for `name` in this shape (allocated where none fits), its bytes as they
        are: a peer pull reads straight into it (`vllm/peer.py`), no copy."""
        held = self.tensors.get(name)
        if held is None or tuple(held.shape) != shape or held.dtype != dtype or held.device != device:
            held = self.tensors[name] = torch.empty(shape, dtype=dtype, device=device)
            self.slabbed -= {name}
        return held

    def slab(self, specs: Sequence[tuple[_Name, tuple[int, ...], torch.dtype]], device: torch.device) -> dict[_Name, torch.Tensor]:
        """Held tensors for `specs` as views of one allocation, in this order at `SLAB_ALIGN`-byte
        offsets, their bytes as they are: a peer pull registers the one region (9,435 registrations
        of a 30B-A3B staging copy cost a joiner ~2 s on 2xH200) and reads tensors lying back to back
        here and at the peer in one read. Where the last slab holds exactly these names on `device`
        in the same bytes, its views are laid again in this order (a pull lays the prepare's slab in
        its offer's order) and nothing is allocated."""
        offsets, total = [], 0
        for _, shape, dtype in specs:
            offsets.append(total)
            nbytes = dtype.itemsize * math.prod(shape)
            total += -(-nbytes // self.SLAB_ALIGN) * self.SLAB_ALIGN
        names = frozenset(name for name, _, _ in specs)
        if len(names) != len(specs):
            raise ValueError("a slab names a tensor twice")
        storage = self._slab_storage(names, device, total)
        buf = torch.empty(total, dtype=torch.uint8, device=device) if storage is None else torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (total,), (1,))
        views: dict[_Name, torch.Tensor] = {}
        for (name, shape, dtype), at in zip(specs, offsets):
            views[name] = self.tensors[name] = buf[at : at + dtype.itemsize * math.prod(shape)].view(dtype).view(shape)
        self.slabbed = names
        return views

    def _slab_storage(self, names: frozenset[Hashable], device: torch.device, total: int) -> torch.UntypedStorage | None:
        """The storage of the last slab when it holds exactly `names` on `device` in `total` bytes."""
        if not names or names != self.slabbed or any(n not in self.tensors for n in names):
            return None
        storages = {self.tensors[n].untyped_storage().data_ptr(): self.tensors[n].untyped_storage() for n in names}
        if len(storages) != 1:
            return None
        storage = next(iter(storages.values()))
        return storage if storage.nbytes() == total and storage.device == device else None

    def room(self, nbytes: int, device: torch.device, limit_bytes: int | None) -> tuple[bool, str]:
        """Whether a staging copy of `nbytes` fits: what is held already plus what is free (less a
        10 % margin), within `limit_bytes` when one is set. Returns (fits, why in words)."""
        held = self.nbytes
        if limit_bytes is not None and nbytes > limit_bytes:
            return False, f"a staging copy of {nbytes} bytes exceeds the engine's staging limit of {limit_bytes} bytes"
        extra = max(0, nbytes - held)
        free = free_bytes(device)
        if extra > 0.9 * free:
            return False, f"a staging copy needs {extra} more bytes on {device} and {free} are free"
        return True, f"{held} bytes held, {free} free"

    def retain(self, keys: Iterable[Hashable]) -> None:
        """Free what the last staged sync did not use (a layout change: whole tensors <-> regions)."""
        keep = set(keys)
        for key in [k for k in self.tensors if k not in keep]:
            del self.tensors[key]
        self.slabbed &= keep

    def drop(self) -> None:
        self.tensors.clear()
        self.slabbed = frozenset()


class StagedReceive:
    """One staged receive: runs `stream(self)` on a thread, which hands its pairs to `sink` (or, with
    a receive plan, its region items to the loader from `keep_regions`); `pairs` / `items` are the
    version it staged.

    `keep_views`: what the stream yields stays valid until the next receive (the receiver's base
    images), so it is kept as it is; else each tensor is copied into `copy`."""

    def __init__(
        self, digest: str, stream: Callable[[StagedReceive], dict[str, Any]], copy: LoaderCopy, keep_views: bool,
        prepare: Prepare | None = None, on_end: OnEnd | None = None,
    ) -> None:
        self.digest = digest
        self._on_end = on_end
        self._ended = threading.Event()  # set before `on_end` runs: a swap it lets in finds the version ready
        self.shadow: ShadowWeights | None = None  # the post-processed image; None: the swap reloads
        self._prepare = prepare
        self.pairs: list[tuple[str, torch.Tensor]] = []
        self.items: list[RegionItem] = []
        self._landing: LandingFactory | None = None
        self.report: dict[str, Any] | None = None
        self.error: str | None = None
        self._copy = copy
        self._keep_views = keep_views
        self._stream = stream
        self._thread = threading.Thread(target=self._run, name="ckpt-stage", daemon=True)
        self.started = time.perf_counter()

    @property
    def nbytes(self) -> int:
        """Bytes of the staged tensors (a tied head counted once)."""
        seen = {id(t): t for _, t in self.pairs} | {id(t): t for _, _, t in self.items}
        return sum(t.numel() * t.element_size() for t in seen.values())

    def start(self) -> StagedReceive:
        self._thread.start()
        return self

    def sink(self, pairs: list[tuple[str, torch.Tensor]]) -> None:
        """Keeps one bucket's loadable pairs (whole tensors)."""
        if self._keep_views:
            self.pairs.extend(pairs)
            return
        kept: dict[int, torch.Tensor] = {}  # a tied head arrives as its embedding's own tensor
        for name, tensor in pairs:
            t = kept.get(id(tensor))
            if t is None:
                t = kept[id(tensor)] = self._copy.keep(name, tensor)
            self.pairs.append((name, t))

    def keep_regions(self, landing: LandingFactory) -> tuple[RegionLanding, Callable[[list[RegionItem]], int]]:
        """Region delivery: the loader that keeps this sync's items for the swap, and the landing that
        checks them as they land (on `meta`: the real landing's checks, nothing allocated); its
        `incomplete()` at the end says whether the rank got every region."""
        self._landing = landing
        check = landing(torch.device("meta"), lambda pairs: None)

        def keep(items: list[RegionItem]) -> int:
            check.load(items)  # raises for a region the plan does not hold, or of a wrong shape
            for name, region, tensor in items:
                self.items.append((name, region, tensor if self._keep_views else self._copy.keep((name, region), tensor)))
            return len(items)

        return check, keep

    def load(self, load_weights: Callable[[list[tuple[str, torch.Tensor]]], Any], device: torch.device) -> None:
        """The swap's part: hand the staged version to vLLM's loader (region items assembled first)."""
        if self._landing is None:
            load_weights(self.pairs)
            return
        landing = self._landing(device, load_weights)
        landing.load(self.items)
        if landing.incomplete():  # checked as they landed; a swap never loads half a tensor
            raise RuntimeError(f"staged regions missing for {landing.incomplete()[:5]}")

    def _run(self) -> None:
        try:
            with torch.no_grad():
                report = self._stream(self)
            report["stage_s"] = time.perf_counter() - self.started
            if not self._keep_views:
                self._copy.retain([(n, r) for n, r, _ in self.items] if self._landing is not None else [n for n, _ in self.pairs])
            if self._prepare is not None:  # only a whole, checked version is prepared
                self.shadow = self._prepare(self)
                if self.shadow is not None:
                    report["shadow_s"] = self.shadow.build_s
            self.report = report
        except BaseException as exc:  # the controller reads it in the next poll
            self.error = f"{type(exc).__name__}: {exc}"
            self.pairs, self.items, self.shadow = [], [], None
            logger.warning("staged receive of manifest %s failed: %s", self.digest[:12], self.error)
        self._ended.set()
        if self._on_end is not None:
            try:
                self._on_end(self.error)
            except Exception:  # the controller then times out waiting, naming this rank
                logger.exception("staged receive of manifest %s: reporting its end failed", self.digest[:12])

    @property
    def running(self) -> bool:
        return not self._ended.is_set()

    @property
    def ready(self) -> bool:
        return not self.running and self.error is None and self.report is not None

    def join(self, timeout_s: float) -> bool:
        """Wait for the stream to end and its end to be reported (`on_end`: a discard that returns
        leaves no report still to land, so the waiting side can delete every outcome key after it;
        after a failure elsewhere the stream ends when the group aborts); whether it did."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def status(self) -> dict[str, Any]:
        return {"done": not self.running, "error": self.error, "report": self.report if not self.running else None}


class Staging:
    """A worker's staging: at most one staged version, and the staging copy kept across syncs."""

    def __init__(self) -> None:
        self.copy = LoaderCopy()
        self.version: StagedReceive | None = None
        self.limit_bytes: int | None = None  # the engine's staging limit, as last asked in `room`

    @property
    def running(self) -> bool:
        return self.version is not None and self.version.running

    def start(
        self, digest: str, stream: Callable[[StagedReceive], dict[str, Any]], keep_views: bool, prepare: Prepare | None = None,
        on_end: OnEnd | None = None,
    ) -> None:
        if self.running:
            raise RuntimeError("a staged receive is still streaming on this worker")
        self.version = StagedReceive(digest, stream, self.copy, keep_views, prepare, on_end)
        self.version.start()  # held before its thread runs: `on_end` may already find it takeable

    def status(self) -> dict[str, Any]:
        if self.version is None:
            return {"done": True, "error": "no staged receive was started on this worker", "report": None}
        return self.version.status()

    def take(self) -> StagedReceive:
        """The staged version, handed over once; raises unless a whole, checked version is staged (a
        failed one is dropped then: nothing can swap it in, and its views would hold their memory)."""
        v = self.version
        if v is None or not v.ready:
            why = "none was staged" if v is None else ("it is still streaming" if v.running else f"its receive failed ({v.error})")
            if v is not None and not v.running:
                self.version = None
            raise RuntimeError(f"swap refused: no complete staged version on this worker ({why}); the live weights are unchanged")
        self.version = None
        return v

    def discard(self, drop_copy: bool = False, timeout_s: float = 60.0) -> bool:
        """Drop the staged version (waiting up to `timeout_s` for a failed stream to end); whether
        there was one. `drop_copy` also frees the staging copy (on leaving the group)."""
        v, had = self.version, self.version is not None
        if v is not None and not v.join(timeout_s):
            raise RuntimeError(f"the staged receive of manifest {v.digest[:12]} is still streaming after {timeout_s}s; cannot discard it")
        self.version = None
        if drop_copy:
            self.copy.drop()
        return had

    def room(self, nbytes: int, device: torch.device, limit_bytes: int | None) -> tuple[bool, str]:
        self.limit_bytes = limit_bytes
        return self.copy.room(nbytes, device, limit_bytes)

    def shadow_room(self, nbytes: int, device: torch.device) -> tuple[bool, str]:
        """Whether a post-processed image of about `nbytes` fits beside the staging copy: within the
        engine's staging limit (the copy and the image together) and the free memory."""
        held = self.copy.nbytes
        if self.limit_bytes is not None and held + nbytes > self.limit_bytes:
            return False, f"the staging copy ({held} bytes) and a prepared image ({nbytes} bytes) exceed the staging limit of {self.limit_bytes} bytes"
        free = free_bytes(device)
        if nbytes > 0.9 * free:
            return False, f"a prepared image needs {nbytes} bytes on {device} and {free} are free"
        return True, ""

    def describe(self) -> dict[str, Any] | None:
        v = self.version
        if v is None:
            return None
        return {"digest": v.digest, "running": v.running, "ready": v.ready, "error": v.error,
                "shadow_bytes": v.shadow.nbytes if v.shadow is not None else 0}
