"""Installed-weight digests (issue 42 item 5): what an engine rank holds after a sync, folded the
same way on both sides, so a loader that transposes, skips a tensor or races a copy is caught.

The digest of one region image (a tensor, or the region of it an engine rank holds, in the
region's own shape and C order; n elements) is

    D = sum over chosen positions p of  word(p) * h(p + seed)      (wrapping int64)

with word(p) the element's bits as a signed integer of its own width and h the delta checksum's
odd position weights (`delta/mixing.py`). `samples` = 0 reads every element: then D is the delta
codec's checksum of the image's bytes (`delta/checksums.py`, 8-byte words when the image's size
allows, else words of the element's width; no seed), about one read of the model per side;
otherwise K = `samples` positions, one in each of K equal strata of [0, n) at an offset drawn from
`seed`, the first and the last element always among them: a fault that touches a fraction f of a
tensor goes unseen with probability (1 - f)^K per check, and a fresh `seed` per check never
misses the same one twice. It is exact integer arithmetic, so an engine's CUDA rank and a trainer's
CPU agree bit for bit. Both sides compute D with torch ops on the tensor's own device, without a
host sync until the answers are read.

An engine answers `InstalledRequest` with one `InstalledReport` per rank: a digest per
(checkpoint name, region) it installed, the tensors of its own layout (parameters and persistent
buffers) that the sync does not write (`unwritten`), and those it cannot map back to checkpoint
regions (`unchecked`: named, never guessed), and the (name, region) keys the sync sent that it
did not install (`missing`: a loader that skipped a tensor leaves its layer waiting).

An engine whose ranks can only take digests while they load (vLLM's post-processing repacks a layer
once loaded), or that answers the check in its receive's reply (the reference receiver: no round
trip of its own), also implements `ArmsInstalledChecks`: the controller tells it the check before
the stream.
"""

from __future__ import annotations

import copy
import functools
import math
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from ckpt_engine.delta.checksums import checksum
from ckpt_engine.delta.mixing import mix
from ckpt_engine.planning.regions import Region

__all__ = [
    "DEFAULT_SAMPLES", "ArmsInstalledChecks", "Folds", "agreeing", "InstalledReport", "InstalledRequest", "Key", "digest", "digest_share_runs",
    "key_text", "region_view", "wire_keys", "wrap64",
]

DEFAULT_SAMPLES = 4096
"""Positions read per tensor region by default (`checkpoint_engine.verify_installed_samples`)."""
MAX_SEED = 1 << 40
_INTS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

Key = tuple[str, Region | None]
"""A checkpoint tensor's name and the region of it one engine rank holds (None: all of it)."""


@dataclass(frozen=True)
class InstalledRequest:
    """What the controller asks every engine rank to digest: the names the sync wrote (in the
    checkpoint's naming), the fold's `seed` and `samples` (0: every element)."""

    names: list[str]
    seed: int
    samples: int = DEFAULT_SAMPLES

    def to_wire(self) -> dict[str, Any]:
        return {"names": list(self.names), "seed": self.seed, "samples": self.samples}

    @classmethod
    def from_wire(cls, d: Any) -> InstalledRequest:
        if not isinstance(d, dict) or set(d) != {"names", "seed", "samples"}:
            raise ValueError(f"an installed-weight request is a map of names, seed, samples; got {d!r:.120}")
        names, seed, samples = d["names"], d["seed"], d["samples"]
        if not isinstance(names, list) or not set(map(type, names)) <= {str}:  # one C loop: read before a checked receive starts
            raise ValueError("installed-weight request: names must be a list of strings")
        for what, v, top in (("seed", seed, MAX_SEED), ("samples", samples, 1 << 40)):
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < top:
                raise ValueError(f"installed-weight request: {what} must be an int in [0, {top}), got {v!r:.40}")
        return cls(names, seed, samples)


@dataclass
class InstalledReport:
    """One engine rank's answer (see the module docstring)."""

    digests: dict[Key, int] = field(default_factory=dict)
    unwritten: list[str] = field(default_factory=list)
    unchecked: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    seconds: float = 0.0
    """What the rank spent digesting (as it loaded and when asked): the engine's side of the cost."""
    agreed: bool = False
    """The rank compared its digests with the source's itself, and they agreed (its receive's last
    call, told the source's digests: `digests` then left out, none to compare again)."""

    def to_wire(self) -> dict[str, Any]:
        """Columns (names, regions or None when every key is whole, digests), not a row per key: a
        7B report's 339 keys then cost no Python per key to check and rebuild (msgpack and JSON both)."""
        names, regions = wire_keys(list(self.digests))
        return {
            "names": names, "regions": regions, "digests": list(self.digests.values()), "unwritten": list(self.unwritten),
            "unchecked": list(self.unchecked), "missing": list(self.missing), "seconds": self.seconds, **({"agreed": True} if self.agreed else {}),
        }

    def agrees(self, source: InstalledReport) -> bool:
        """Whether every digest here equals the source's (`source`: the trainer's digests as a report)
        and nothing sent is missing: where an engine rank finalizes in its receive's last call under a
        check, it does so only then (the controller's compare still names what differs; tensors left
        unwritten fail a check only with `unwritten_tensors: error`, where no digests are sent ahead)."""
        return not self.missing and self.within(source.digests)

    def within(self, digests: dict[Key, int]) -> bool:
        """Whether every digest here is one of `digests` (one C loop; a report its rank `agreed` is)."""
        return self.agreed or self.digests.items() <= digests.items()

    @classmethod
    def from_wire(cls, d: Any, agreed: bool = False) -> InstalledReport:
        """`agreed`: the rank said its digests agree with the source's (`agreed`, or the report's own
        `agreed`): they are not read."""
        if not isinstance(d, dict) or not _REPORT_KEYS <= set(d) <= {*_REPORT_KEYS, "missing", "seconds", "agreed"}:
            raise ValueError(f"an installed-weight report is a map of {', '.join(sorted(_REPORT_KEYS))} (missing, seconds, agreed); got {d!r:.120}")
        said = d.get("agreed", False)
        if not isinstance(said, bool):
            raise ValueError(f"installed-weight report: agreed must be a bool, got {said!r:.40}")
        agreed = agreed or said
        if agreed:
            d = {**d, "names": [], "regions": None, "digests": []}
        names, regions, values = d["names"], d["regions"], d["digests"]
        kept = _KEYS[0]
        same = kept is not None and names == kept[0] and regions == kept[1]  # the keys of the last report read (one C compare)
        if not isinstance(names, list) or not isinstance(values, list) or len(values) != len(names) or not (same or set(map(type, names)) <= {str}):
            raise ValueError(f"installed-weight report: names must be a list of strings, as long as digests; got {names!r:.80}, {values!r:.80}")
        if not set(map(type, values)) <= {int}:
            raise ValueError(f"installed-weight report: digests must be ints, got {values!r:.120}")
        if regions is not None and (not isinstance(regions, list) or len(regions) != len(names)):
            raise ValueError(f"installed-weight report: regions must be None or one per name (a region or None), got {regions!r:.120}")
        seconds = d.get("seconds", 0.0)
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
            raise ValueError(f"installed-weight report: seconds must be a number, got {seconds!r:.40}")
        lists = [d[k] for k in ("unwritten", "unchecked")] + [d.get("missing", [])]
        if not all(isinstance(v, list) and set(map(type, v)) <= {str} for v in lists):
            raise ValueError("installed-weight report: unwritten, unchecked and missing must be lists of strings")
        if agreed:  # no keys: the last full report's stay kept
            keys: list[Key] = []
        elif same:
            keys = kept[2]  # type: ignore[index]
        else:
            held = [Region.from_wire(n, r) if r is not None else None for n, r in zip(names, regions)] if regions is not None else [None] * len(names)
            keys = list(zip(names, held))
            _KEYS[0] = (list(names), copy.deepcopy(regions), keys)  # copies: a caller may change its lists
        unwritten, unchecked, missing = lists
        return cls(dict(zip(keys, values)), unwritten, unchecked, missing, seconds=float(seconds), agreed=agreed)


_REPORT_KEYS = frozenset({"names", "regions", "digests", "unwritten", "unchecked"})
_NAME, _REGION = operator.itemgetter(0), operator.itemgetter(1)
_KEYS: list[tuple[list[str], list[Any] | None, list[Key]] | None] = [None]
"""The wire columns of the last report read and its keys: every check of a session reads reports of
the same keys (each worker's, the source's), so a report costs a compare of its names, not a key
built per name (~0.2 us each: 6 ms of a Qwen3-30B-A3B check's 9,435 keys, read three times)."""


def wire_keys(keys: list[Key]) -> tuple[list[str], list[Any] | None]:
    """`keys` as a report's wire form lists them: the names, and the regions (None when every key is whole)."""
    held = list(map(_REGION, keys))
    return list(map(_NAME, keys)), [r.to_wire() if r is not None else None for r in held] if any(held) else None  # a Region is never false


def agreeing(report: dict[str, Any], source: dict[str, Any]) -> bool | None:
    """Whether an engine rank's report (wire form) agrees with the source's (`InstalledReport.agrees`)
    without reading either: True or False where both list the same keys in the same order (one
    compare of the columns), None where only reading them says."""
    if report.get("missing"):
        return False
    if report.get("agreed") is True:  # the rank compared them itself as it read its digests back (vLLM: `InstalledCapture.expect`)
        return True
    if report.get("names") != source.get("names") or report.get("regions") != source.get("regions"):
        return None
    return bool(report.get("digests") == source.get("digests"))


@runtime_checkable
class ArmsInstalledChecks(Protocol):
    """An engine handle whose ranks must know a check before the stream (they digest while they load)."""

    def arm_installed(self, request: InstalledRequest) -> None:
        """Tell every rank the check of the sync about to stream (called before anything is paused)."""


def key_text(key: Key) -> str:
    """A key as problems name it: the name, and the region an engine rank holds of it."""
    name, r = key
    return name if r is None else f"{name}[dim {r.dim}: {r.start}:{r.start + r.length}]"


def region_view(t: torch.Tensor, region: Region | None) -> torch.Tensor:
    """`region` of `t` as a view (no copy)."""
    return t if region is None else t.narrow(region.dim, region.start, region.length)


def _positions(n: int, seed: int, samples: int, device: torch.device) -> torch.Tensor:
    if n <= samples:
        return torch.arange(n, dtype=torch.int64, device=device)
    ends = torch.arange(samples + 1, dtype=torch.int64, device=device) * n // samples  # stratum i: [ends[i], ends[i + 1]), >= 1 wide
    lo = ends[:-1]
    pos = lo + torch.remainder(_draws(seed, samples, device), ends[1:] - lo)
    pos[0], pos[-1] = 0, n - 1
    return pos


def _draws(seed: int, samples: int, device: torch.device) -> torch.Tensor:
    """mix(i + seed) for i in [0, samples): each stratum's draw, the same for every image of one
    check; kept on the host only (a kept GPU tensor would be read from other streams than the one
    that wrote it: an engine's compute stream, the trainer's)."""
    if device.type != "cpu":
        return mix(torch.arange(samples, dtype=torch.int64, device=device) + seed)
    return _host_draws(seed, samples)


@functools.lru_cache(maxsize=4)
def _host_draws(seed: int, samples: int) -> torch.Tensor:
    return mix(torch.arange(samples, dtype=torch.int64) + seed)  # never written in place


def _flat_index(pos: torch.Tensor, shape: Sequence[int], region: Region | None) -> torch.Tensor:
    """The flat element (C order) of a tensor of `shape` at each flat position `pos` of `region`'s
    image: the image's rows of `inner` elements sit `region.start` rows into each block of the
    tensor's `shape[dim]` (one division, none for a whole tensor or a region of rows)."""
    if region is None:
        return pos
    inner = math.prod(shape[region.dim + 1:])
    shifted = pos + region.start * inner
    if region.dim == 0 or shape[region.dim] == region.length:
        return shifted
    outer = torch.div(pos, region.length * inner, rounding_mode="floor")
    return shifted.add_(outer * ((shape[region.dim] - region.length) * inner))


def _unravel(pos: torch.Tensor, shape: tuple[int, ...]) -> list[torch.Tensor]:
    """`torch.unravel_index` by hand: the same coordinates, without the ~2.4 s its first call in a
    process costs (a checked sync's first fold on every rank)."""
    coords: list[torch.Tensor] = []
    for size in reversed(shape):
        coords.append(torch.remainder(pos, size))
        pos = torch.div(pos, size, rounding_mode="floor")
    return coords[::-1]


def _ints(dtype: torch.dtype) -> torch.dtype:
    """The signed integer dtype of `dtype`'s width, whose values the digests add up."""
    ints = _INTS.get(dtype.itemsize)
    if ints is None or dtype.is_complex:
        raise ValueError(f"no installed-weight digest for dtype {dtype}")
    return ints


def _as_ints(t: torch.Tensor, ints: torch.dtype) -> torch.Tensor:
    """`t`'s words reinterpreted as `ints` (bool through uint8, which `view` requires)."""
    return (t.view(torch.uint8) if t.dtype == torch.bool else t).view(ints)


def _gather(view: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    if view.is_contiguous():
        return view.reshape(-1).index_select(0, pos)
    return view[tuple(_unravel(pos, tuple(view.shape)))]


def digest(view: torch.Tensor, seed: int, samples: int = DEFAULT_SAMPLES, dtype: torch.dtype | None = None) -> torch.Tensor:
    """D of one region image (see the module docstring): a 0-d int64 tensor on `view`'s device.
    `dtype`: the image as that dtype (a source tensor cast on the wire): only the positions read are
    cast, so a sampled digest costs no cast of the whole tensor."""
    n = view.numel()
    dtype = dtype if dtype is not None else view.dtype
    ints = _ints(dtype)
    if n == 0:
        return torch.zeros((), dtype=torch.int64, device=view.device)
    if samples <= 0:  # every element: the codec's checksum of the bytes, in C order
        image = view.to(dtype).contiguous().reshape(-1)
        image = _as_ints(image, ints).view(torch.uint8)
        return checksum(image, 8 if image.numel() % 8 == 0 else image.element_size())
    pos = _positions(n, seed, samples, view.device)
    words = _as_ints(_gather(view, pos).to(dtype), ints).to(torch.int64)
    return words.mul_(mix(pos + seed)).sum()


def digest_share_runs(
    flat: torch.Tensor, base: int, runs: list[tuple[int, int]], shape: tuple[int, ...], region: Region | None, seed: int, samples: int,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """One sender's share of D of `region` of a tensor of `shape` (many senders, each holding runs
    of the tensor's flat elements): the sum over the sampled positions whose element lies in a run
    [lo, hi). D is a sum over positions, so the shares of runs that cover the tensor once add up
    (`wrap64`) to `digest(region_view(whole, region))`: no sender gathers a tensor. Sampled digests
    only (`samples` > 0: a full fold is the codec's checksum of whole words of the image).
    `flat` holds flat elements [base, base + flat.numel()) (C order) and the runs lie inside it. The
    positions are drawn once for all runs, and only the words read are cast to `dtype` (the wire's;
    default `flat`'s own), so a sender's share costs about one `digest` whatever its chunks. A
    region's flat elements are a shift of its positions (one division for an inner dimension, no
    unravel) and a sender's runs slices of them (they ascend), so a share is ~25 small ops, not ~50:
    a 7B-1-layer check's folds took ~1.7 ms a tensor on each trainer rank before."""
    if samples <= 0:
        raise ValueError("digest shares need a sampled digest (samples > 0)")
    dtype = dtype if dtype is not None else flat.dtype
    ints = _ints(dtype)
    image = list(shape)
    if region is not None:
        image[region.dim] = region.length
    n = math.prod(image)
    runs = [(lo, hi) for lo, hi in runs if hi > lo]
    if n == 0 or not runs:
        return torch.zeros((), dtype=torch.int64, device=flat.device)
    whole = math.prod(shape)
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(runs):  # their union: a position is the sender's if any run holds it
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(hi, merged[-1][1]))
        else:
            merged.append((lo, hi))
    pos = _positions(n, seed, samples, flat.device)
    index = _flat_index(pos, shape, region)
    if len(merged) > 1 or merged[0][0] > 0 or merged[0][1] < whole:  # else every position is the sender's
        if region is None or region.dim == 0 or region.length == shape[region.dim]:  # index ascends: each run is a slice of it
            cuts = torch.searchsorted(index, torch.tensor([x for run in merged for x in run], dtype=torch.int64, device=flat.device)).tolist()
            spans = [(a, b) for a, b in zip(cuts[::2], cuts[1::2]) if b > a]
            if not spans:
                return torch.zeros((), dtype=torch.int64, device=flat.device)
            index, pos = (torch.cat([v[a:b] for a, b in spans]) if len(spans) > 1 else v[spans[0][0]:spans[0][1]] for v in (index, pos))
        else:
            starts, ends = (torch.tensor(v, dtype=torch.int64, device=flat.device) for v in zip(*merged))
            run = torch.searchsorted(starts, index, right=True) - 1
            keep = (run >= 0) & (index < ends.index_select(0, run.clamp(min=0)))
            index, pos = index[keep], pos[keep]
    words = _as_ints(flat.index_select(0, index - base if base else index).to(dtype), ints).to(torch.int64)
    return words.mul_(mix(pos + seed)).sum()


def wrap64(value: int) -> int:
    """`value` as the wrapping int64 the digests are (shares added in Python)."""
    return (value + (1 << 63)) % (1 << 64) - (1 << 63)


class Folds:
    """The digests of many region images on one request (`seed`, `samples`), each equal to `digest`'s.

    `add` reads an image's sampled positions at once (a trainer's tensor may be gone when the answers
    are read); `note` only notes images and `read_later` reads those noted (some or all: on a GPU a
    launch a batch, its digests left on the device); `values` folds every image read, one read-back
    a device: not a lone `digest`'s ~20 kernels and a host sync an image (a 7B sync into vLLM on one
    H200, checked that way, took 9x an unchecked one). Full folds (`samples` 0) and empty images are
    `digest`'s own."""

    def __init__(self, seed: int, samples: int) -> None:
        self.seed, self.samples = seed, samples
        self.count = 0
        self._weights: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}
        self._rows: dict[tuple[int, torch.device, torch.dtype], tuple[list[int], list[torch.Tensor]]] = {}
        self._done: dict[int, torch.Tensor] = {}
        self._later: dict[int, tuple[torch.Tensor, torch.dtype]] = {}
        self._launched: list[tuple[list[int], torch.Tensor]] = []
        """The fold kernel's digests, on their device: the images' indices and the digests."""
        self._streams: set[Any] = set()
        """The CUDA streams the kernel ran on (`values` reads its digests after them)."""

    def add(self, view: torch.Tensor, dtype: torch.dtype | None = None, later: bool = False) -> int:
        """Read one image (as `dtype`, default its own: see `digest`); returns its index in `values`.
        `later`: only `note` it (its tensor must stay valid and unchanged until it is read)."""
        if later:
            return self.note([view], [dtype])
        i, self.count = self.count, self.count + 1
        dtype = dtype if dtype is not None else view.dtype
        _ints(dtype)  # an image no digest can fold is refused as it is added, later or not
        self._read(i, view, dtype)
        return i

    def note(self, views: Sequence[torch.Tensor], dtypes: Sequence[torch.dtype | None] | None = None) -> int:
        """Note every view (as its dtype in `dtypes`, default its own) to be read by `read_later`, in
        order, refusing at once one no digest can fold; returns the first one's index in `values`
        (the others follow). Each tensor must stay valid and unchanged until then. One call for all:
        a walk or a rank of hundreds of images pays no call per image (`add` each: ~0.5 us on the
        CPU box, 0.17 ms for a 7B model's 339)."""
        first = self.count
        casts = [d if d is not None else v.dtype for v, d in zip(views, dtypes)] if dtypes is not None else [v.dtype for v in views]
        for dtype in set(casts):
            _ints(dtype)
        self.count += len(views)
        self._later.update(zip(range(first, self.count), zip(views, casts)))
        return first

    def read_later(self, indices: Iterable[int] | None = None) -> None:
        """Read the images noted and not read yet among `indices` (default: every one), e.g. a
        bucket's once it landed: those on a GPU in one launch (`installed_kernel.py`) on the current
        stream, after what wrote them there, their digests left on the device; the others a few
        kernels per image size. An image is read once: later writes to its tensor are not seen."""
        if indices is None:
            later, self._later = list(self._later.items()), {}
        else:
            pop = self._later.pop
            later = [(i, pop(i)) for i in indices if i in self._later]
        uncast = [(i, v) for i, (v, dtype) in later if v.is_cuda and dtype == v.dtype] if self.samples > 0 else []
        if uncast:
            from ckpt_engine.installed_kernel import Folder, foldable  # Triton: only where a GPU folds

            try:  # kept tables answer at once (no per-view test); a view the kernel cannot read refuses
                folder = Folder([v for _, v in uncast])
            except ValueError:
                uncast = [(i, v) for i, v in uncast if foldable(v)]
                folder = Folder([v for _, v in uncast])
            if uncast:
                ids = [i for i, _ in uncast]
                self._launched.extend(([ids[j] for j in index], folded) for index, folded in folder.launch(self.seed, self.samples))
                self._streams.add(torch.cuda.current_stream(uncast[0][1].device))
        if len(uncast) < len(later):
            folded = {i for i, _ in uncast}
            for i, (view, dtype) in later:
                if i not in folded:
                    self._read(i, view, dtype)

    def drop_later(self) -> None:
        self._later = {}  # the images noted and not read yet: their digests are never asked

    def _read(self, i: int, view: torch.Tensor, dtype: torch.dtype) -> None:
        n = view.numel()
        if n == 0 or self.samples <= 0:
            self._done[i] = digest(view, self.seed, self.samples, dtype)
            return
        key = (n, view.device)
        if key not in self._weights:
            pos = _positions(n, self.seed, self.samples, view.device)
            self._weights[key] = (pos, mix(pos + self.seed))
        ints = _ints(dtype)
        words = _as_ints(_gather(view, self._weights[key][0]).to(dtype), ints)
        index, rows = self._rows.setdefault((n, view.device, ints), ([], []))
        index.append(i)
        rows.append(words)

    def values(self) -> list[int]:
        """Every image's D, in the order added (those not read yet are read first)."""
        self.read_later()
        parts: dict[torch.device, tuple[list[int], list[torch.Tensor]]] = {}
        for (n, device, _), (index, rows) in self._rows.items():
            folded = torch.stack(rows).to(torch.int64).mul_(self._weights[(n, device)][1]).sum(1)
            into = parts.setdefault(device, ([], []))
            into[0].extend(index)
            into[1].append(folded)
        for i, d in self._done.items():
            into = parts.setdefault(d.device, ([], []))
            into[0].append(i)
            into[1].append(d.reshape(1))
        for index, folded in self._launched:
            into = parts.setdefault(folded.device, ([], []))
            into[0].extend(index)
            into[1].append(folded)
        for stream in self._streams:  # a batch folded on another thread's current stream
            current = torch.cuda.current_stream(stream.device)
            if stream != current:
                current.wait_stream(stream)
        out = [0] * self.count
        for index, tensors in parts.values():  # one read-back per device
            for i, v in zip(index, (tensors[0] if len(tensors) == 1 else torch.cat(tensors)).cpu().tolist()):
                out[i] = int(v)
        return out
