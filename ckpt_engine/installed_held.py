"""Installed-weight checks of a rank that holds checkpoint tensors under their own names (the
reference receiver): its reports (`installed.py` defines the digests and `Folds`). On the host its
tensors are folded as they land, so only the last batch's fold follows the last bucket; on a GPU
every tensor is folded once after the last bucket, in one launch over kept tables (`Folder`)."""

from __future__ import annotations

import operator
import time
from collections.abc import Iterable, Mapping

import torch

from ckpt_engine.installed import Folds, InstalledReport, InstalledRequest, Key
from ckpt_engine.planning.regions import Region

__all__ = ["FOLD_BATCHES", "HeldDigests", "HeldFold", "digest_held"]

FOLD_BATCHES = 8
"""A host rank folds a check's images in about this many batches as they land (`HeldFold`): the
stream hides all but the last (on the CPU box a 339-tensor fold after the last bucket took 8.5-19
ms, its last batch 1.7-5.5 ms). Not on a GPU: there a batch's cost is host work (its Python and a
launch: the 8 batches of a 7B check took 1.22 ms on one H200, `engine_landed_s`), which sat on a
colocated receive's path, while one launch over every tensor at the end costs about one batch."""
_CUDA = operator.attrgetter("is_cuda")



class HeldDigests:
    """The reports of a rank that holds checkpoint tensors under their own names (the reference
    receiver): `tensors` in each held region's shape, `regions` the region of each (absent: whole),
    both the rank's own for its life. What only a request's names decide (the keys, the tensors no
    sync of them writes) is kept from one check to the next, so a check costs the fold: on a GPU a
    launch a batch over kept tables (`Folder`) instead of a gather and a cast per tensor (~3 launches
    each: ~1000 for a 7B model). `begin` a check as a receive starts and fold its tensors as they
    land (`HeldFold`), or `report` at once."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], regions: Mapping[str, Region | None]) -> None:
        self.tensors, self.regions = tensors, regions
        self._kept: tuple[list[str], list[str], list[Key], list[str], dict[str, int]] | None = None
        """The last request's names, those held, their keys, the tensors left unwritten, each held name's image."""

    def begin(self, request: InstalledRequest) -> HeldFold:
        """A check of what the rank will hold once the coming loads are done."""
        t0 = time.perf_counter()
        if self._kept is None or self._kept[0] != request.names:
            held = [n for n in request.names if n in self.tensors]
            sent = set(request.names)
            self._kept = (
                list(request.names), held, [(n, self.regions.get(n)) for n in held], sorted(n for n in self.tensors if n not in sent),
                {n: i for i, n in enumerate(held)},
            )
        _, held, keys, unwritten, index = self._kept
        folds = Folds(request.seed, request.samples)
        views = list(map(self.tensors.__getitem__, held))  # each already in its region's shape
        at_end = request.samples > 0 and bool(views) and all(map(_CUDA, views))
        if not at_end:
            folds.note(views)
        return HeldFold(self.tensors, folds, keys, list(unwritten), index, time.perf_counter() - t0, views if at_end else None)

    def report(self, request: InstalledRequest) -> InstalledReport:
        return self.begin(request).report()  # what the rank holds now


class HeldFold:
    """One check of a `HeldDigests` rank. On the host, folded as its tensors land (`folds_landings`):
    `landed(names)` once a loader wrote them, a batch at a time (`FOLD_BATCHES`), so only the last
    batch's fold follows the last bucket; `report` folds the rest (tensors no load named hold what
    they held) and answers. A tensor landing again after its fold is read again: its last landing
    counts. On a GPU (`at_end`: the held tensors, all CUDA) `report` folds every tensor in one launch
    on the current stream, after the loads there (a receive ends waiting for them), and reads every
    digest back with one copy."""

    def __init__(
        self, tensors: Mapping[str, torch.Tensor], folds: Folds, keys: list[Key], unwritten: list[str], index: dict[str, int], seconds: float,
        at_end: list[torch.Tensor] | None = None,
    ) -> None:
        self.tensors, self.folds, self.keys, self.unwritten = tensors, folds, keys, unwritten
        self._at_end = at_end
        self.folds_landings = at_end is None
        """Whether the loads should call `landed` (on a GPU they need not: `report` reads everything)."""
        self._index, self._kept_index = index, index
        """Each held name's image in `folds` (the kept map until a name lands twice)."""
        self._due: dict[int, None] = {}
        """Images landed and not read yet, in landing order."""
        self._read: set[int] = set()
        self._per = max(1, -(-len(keys) // FOLD_BATCHES))
        self.seconds = seconds

    def landed(self, names: Iterable[str]) -> None:
        """`names` were written (the rank's own names, in any number; others are ignored)."""
        if self._at_end is not None:
            return
        t0 = time.perf_counter()
        index, due, read = self._index, self._due, self._read
        for n in names:
            i = index.get(n)
            if i is None:
                continue
            if i in read:  # this landing replaced what a batch read
                if index is self._kept_index:
                    index = self._index = dict(index)
                i = index[n] = self.folds.note([self.tensors[n]])
            due[i] = None
        if len(due) >= self._per:
            self.folds.read_later(due)
            read.update(due)
            self._due = {}
        self.seconds += time.perf_counter() - t0

    def report(self) -> InstalledReport:
        t0 = time.perf_counter()
        if self._at_end is not None:
            values = _fold_at_end(self._at_end, self.folds)
            return InstalledReport(dict(zip(self.keys, values)), self.unwritten, [], seconds=self.seconds + time.perf_counter() - t0)
        values = self.folds.values()
        index = self._index
        digests = dict(zip(self.keys, values if index is self._kept_index else [values[index[n]] for n, _ in self.keys]))
        return InstalledReport(digests, self.unwritten, [], seconds=self.seconds + time.perf_counter() - t0)


def _fold_at_end(views: list[torch.Tensor], folds: Folds) -> list[int]:
    """Every view's digest: one launch over kept tables, one read-back; through `folds` (the kernel
    for the views it reads, torch ops for the others) when one of them is an image it cannot read."""
    from ckpt_engine.installed_kernel import Folder  # Triton: only where a GPU folds

    try:
        folder = Folder(views)
    except ValueError:
        folds.note(views)
        return folds.values()
    return folder.fold(folds.seed, folds.samples)


def digest_held(tensors: Mapping[str, torch.Tensor], regions: Mapping[str, Region | None], request: InstalledRequest) -> InstalledReport:
    """One report of a rank holding checkpoint tensors under their own names (`HeldDigests`, kept nothing)."""
    return HeldDigests(tensors, regions).report(request)
