"""Installed-weight checks of a rank that holds checkpoint tensors under their own names (the
reference receiver): its reports (`installed.py` defines the digests and `Folds`). On the host its
tensors are folded in batches as they land, so only the last batch's fold follows the last bucket
(`HeldFold`); on a GPU every tensor is folded in one launch over kept tables (`Folder`) once the
last one landed, so only a read-back follows the receive (`HeldLaunch`)."""

from __future__ import annotations

import operator
import time
from collections.abc import Iterable, Mapping

import torch

from ckpt_engine.installed import Folds, InstalledReport, InstalledRequest, Key
from ckpt_engine.planning.regions import Region

__all__ = ["FOLD_BATCHES", "HeldDigests", "HeldFold", "HeldLaunch", "digest_held"]

FOLD_BATCHES = 8
"""A host rank folds a check's images in about this many batches as they land (`HeldFold`): the
stream hides all but the last (on the CPU box a 339-tensor fold after the last bucket took 8.5-19
ms, its last batch 1.7-5.5 ms). Not on a GPU: there a batch's cost is host work (its Python and a
launch: the 8 batches of a 7B check took 1.22 ms on one H200, `engine_landed_s`), which sat on a
colocated receive's path, while one launch over every tensor costs about one batch (`HeldLaunch`)."""
_CUDA = operator.attrgetter("is_cuda")



class HeldDigests:
    """The reports of a rank that holds checkpoint tensors under their own names (the reference
    receiver): `tensors` in each held region's shape, `regions` the region of each (absent: whole),
    both the rank's own for its life. What only a request's names decide (the keys, the tensors no
    sync of them writes) is kept from one check to the next, so a check costs the fold: on a GPU one
    launch over kept tables (`Folder`) instead of a gather and a cast per tensor (~3 launches each:
    ~1000 for a 7B model). `begin` a check as a receive starts and tell it what lands
    (`HeldFold`, `HeldLaunch`), or `report` at once."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], regions: Mapping[str, Region | None]) -> None:
        self.tensors, self.regions = tensors, regions
        self._kept: tuple[list[str], list[str], list[Key], list[str], dict[str, int], frozenset[str]] | None = None
        """The last request's names, those held, their keys, the tensors left unwritten, each held
        name's image, the held names as a set."""

    def begin(self, request: InstalledRequest) -> HeldFold | HeldLaunch:
        """A check of what the rank will hold once the coming loads are done."""
        t0 = time.perf_counter()
        if self._kept is None or self._kept[0] != request.names:
            held = [n for n in request.names if n in self.tensors]
            sent = set(request.names)
            self._kept = (
                list(request.names), held, [(n, self.regions.get(n)) for n in held], sorted(n for n in self.tensors if n not in sent),
                {n: i for i, n in enumerate(held)}, frozenset(held),
            )
        _, held, keys, unwritten, index, names = self._kept
        folds = Folds(request.seed, request.samples)
        views = list(map(self.tensors.__getitem__, held))  # each already in its region's shape
        if request.samples > 0 and views and all(map(_CUDA, views)):
            return HeldLaunch(views, names, folds, keys, list(unwritten), time.perf_counter() - t0)
        folds.note(views)
        return HeldFold(self.tensors, folds, keys, list(unwritten), index, time.perf_counter() - t0)

    def report(self, request: InstalledRequest) -> InstalledReport:
        return self.begin(request).report()  # what the rank holds now


class HeldFold:
    """One check of a `HeldDigests` rank on the host, folded as its tensors land: `landed(names)`
    once a loader wrote them, a batch at a time (`FOLD_BATCHES`), so only the last batch's fold
    follows the last bucket; `report` folds the rest (tensors no load named hold what they held) and
    answers. A tensor landing again after its fold is read again: its last landing counts."""

    def __init__(
        self, tensors: Mapping[str, torch.Tensor], folds: Folds, keys: list[Key], unwritten: list[str], index: dict[str, int], seconds: float,
    ) -> None:
        self.tensors, self.folds, self.keys, self.unwritten = tensors, folds, keys, unwritten
        self._index, self._kept_index = index, index
        """Each held name's image in `folds` (the kept map until a name lands twice)."""
        self._due: dict[int, None] = {}
        """Images landed and not read yet, in landing order."""
        self._read: set[int] = set()
        self._per = max(1, -(-len(keys) // FOLD_BATCHES))
        self.seconds = seconds

    def landed(self, names: Iterable[str]) -> None:
        """`names` were written (the rank's own names, in any number; others are ignored)."""
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
        values = self.folds.values()
        index = self._index
        digests = dict(zip(self.keys, values if index is self._kept_index else [values[index[n]] for n, _ in self.keys]))
        return InstalledReport(digests, self.unwritten, [], seconds=self.seconds + time.perf_counter() - t0)


class HeldLaunch:
    """One check of a `HeldDigests` rank whose tensors are all on a GPU: every tensor folded in one
    launch (`Folder`, kept tables) on the loads' stream as soon as the last held tensor landed,
    while its copies still run and before the receive's closing wait on them, so `report` is left
    one read-back; a tensor landing again after that launch (or none: `report` straight away) has
    everything folded again at `report`, after every load. Where a view is one the kernel cannot
    read, `report` folds through `folds`."""

    def __init__(self, views: list[torch.Tensor], names: frozenset[str], folds: Folds, keys: list[Key], unwritten: list[str], seconds: float) -> None:
        self.views, self.names, self.folds, self.keys, self.unwritten = views, names, folds, keys, unwritten
        self._left = set(names)
        """Held names not landed yet."""
        self._launched: torch.Tensor | None = None
        self._stream: torch.cuda.Stream | None = None
        """The stream the launch went on (the loads'): `report` reads the digests after it."""
        self._again = False
        """A held tensor landed after the launch: `report` folds everything again."""
        self.seconds = seconds

    def landed(self, names: Iterable[str]) -> None:
        """`names` were written (the rank's own names, in any number; others are ignored)."""
        t0 = time.perf_counter()
        if self._launched is not None or self._again:
            self._again = self._again or not self.names.isdisjoint(names)
        else:
            self._left.difference_update(names)
            if not self._left:
                self._launched = self._launch()
                self._again = self._launched is None
                self._stream = torch.cuda.current_stream(self.views[0].device)
        self.seconds += time.perf_counter() - t0

    def _launch(self) -> torch.Tensor | None:
        from ckpt_engine.installed_kernel import Folder  # Triton: only where a GPU folds

        try:
            return Folder(self.views).launch_all(self.folds.seed, self.folds.samples)
        except ValueError:  # an image the kernel cannot read: `report` folds through `folds`
            return None

    def report(self) -> InstalledReport:
        t0 = time.perf_counter()
        folded = self._launched if self._launched is not None and not self._again else self._launch()
        if folded is not None and folded is self._launched and self._stream is not None and self._stream != torch.cuda.current_stream(self._stream.device):
            torch.cuda.current_stream(self._stream.device).wait_stream(self._stream)
        if folded is not None:
            values = folded.tolist()  # on the current stream, after the launch and every load
        else:
            self.folds.note(self.views)
            values = self.folds.values()
        return InstalledReport(dict(zip(self.keys, values)), self.unwritten, [], seconds=self.seconds + time.perf_counter() - t0)


def digest_held(tensors: Mapping[str, torch.Tensor], regions: Mapping[str, Region | None], request: InstalledRequest) -> InstalledReport:
    """One report of a rank holding checkpoint tensors under their own names (`HeldDigests`, kept nothing)."""
    return HeldDigests(tensors, regions).report(request)
