"""A staged version (issue 28): received and checked while the engine serves, made live at the swap.

A staged sync never writes the live weights while it streams; it keeps one `StagedVersion` until
the swap, with `apply()` (between two engine steps) and `discard()` (a failed stream):

- `StagedPatches`: a patch sync whose delta base is the loader's own tensors. Each patch was
  checked at arrival against the live words without writing them; `apply` writes the patches and
  dense frames, keeps the old words until the check of what it wrote passes (a live weight
  written by someone else since the stream restores them and raises), then moves the base on.
- `StagedBuckets`: the verified base images and reassembly tensors a receive would hand the
  loader, which nothing writes until the next sync; `apply` hands them over.
- `StagedCopy`: a dense sync (or a delta seed) landed in a staging copy of the live tensors it
  carries (kept across syncs); `apply` is one batched copy staging -> live.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from ckpt_engine.copies import batched_copy_
from ckpt_engine.delta.pieces import ScatteredImage
from ckpt_engine.pipeline.delta_bases import Bases, stamp_of
from ckpt_engine.staged import Bucket, StagedVersion

__all__ = ["read_words", "StagedBuckets", "StagedCopy", "StagedPatch", "StagedPatches", "StagingCopy", "StagingError", "write_words"]

logger = logging.getLogger(__name__)

class StagingError(RuntimeError):
    """A staged version could not be made live; the engine's weights are the previous version."""


@dataclass
class StagedPatch:
    """One bucket's staged frame: a checked patch (positions, values), or a dense frame (values
    only), with the live words it replaces (read at the stream: the swap's undo)."""

    bucket: int
    expect: int | torch.Tensor
    """The sender's checksum of the bucket after this frame (a dense frame's: computed here, 0-d)."""
    values: torch.Tensor
    old: torch.Tensor
    positions: torch.Tensor | None = None


class StagedPatches(StagedVersion):
    """A patch sync checked against the live weights (the in-place delta base) and kept."""

    mode = "patches"

    def __init__(
        self, bases: Bases, places: Mapping[int, ScatteredImage], frames: Sequence[StagedPatch], new_id: int,
        live: Mapping[str, torch.Tensor], yield_live: Callable[[], Iterator[Bucket]], wait: Callable[[str], None],
    ) -> None:
        self._bases = bases
        self._places = places
        self._frames = list(frames)
        self._new_id = new_id
        self._live = live
        self._stamps = dict(bases.stamps)
        self._yield_live = yield_live
        self._wait = wait
        self._done = False

    @property
    def nbytes(self) -> int:
        return sum(f.values.nbytes + f.old.nbytes + (f.positions.nbytes if f.positions is not None else 0) for f in self._frames)

    def apply(self) -> Iterator[Bucket]:
        """Refused (nothing written) if a live tensor was written since the stream's checks (its
        version counter moved); else every frame is written, and written back on any failure."""
        if self._done:
            raise RuntimeError("this staged version was applied or discarded already")
        self._done = True
        moved = [n for n, stamp in self._stamps.items() if n in self._live and stamp_of(self._live[n]) != stamp]
        if moved:
            raise StagingError(
                f"the live tensor {moved[0]!r} ({len(moved)} in all) changed since the stream checked the patches against it; "
                "nothing was written and the next sync must be dense"
            )
        written: list[StagedPatch] = []
        try:
            for f in self._frames:
                image = self._places.get(f.bucket)
                if image is None:
                    continue
                written.append(f)
                if f.positions is None:
                    write_words(image, f.values)
                else:
                    image.scatter(f.positions, f.values)
        except BaseException:
            self._roll_back(written)
            raise
        for f in self._frames:
            done = f.expect if isinstance(f.expect, torch.Tensor) else torch.tensor(f.expect, dtype=torch.int64, device=f.values.device)
            self._bases.sums[f.bucket] = done
        self._bases.sync_id = self._new_id
        self._bases.stamps = {n: stamp_of(self._live[n]) for n in self._stamps if n in self._live}
        self._frames.clear()
        yield from self._yield_live()

    def _roll_back(self, written: list[StagedPatch]) -> None:
        try:
            for f in reversed(written):
                image = self._places[f.bucket]
                if f.positions is None:
                    write_words(image, f.old)
                else:
                    image.scatter(f.positions, f.old)
            self._wait("writing back the previous version")
        except Exception:
            logger.critical("writing the previous version back after a failed swap failed: the engine's weights are not to be trusted")
            raise

    def discard(self) -> None:
        self._done = True
        self._frames.clear()


class StagedBuckets(StagedVersion):
    """The loader's buckets of a verified receive, held until the swap (views of base images and
    reassembly tensors that nothing writes before the next sync)."""

    mode = "patches"

    def __init__(self, buckets: Sequence[Bucket], on_discard: Callable[[], None] | None = None) -> None:
        self._buckets: Sequence[Bucket] | None = buckets
        self._on_discard = on_discard

    @property
    def nbytes(self) -> int:
        return 0  # views of memory the receiver keeps anyway

    def apply(self) -> Iterator[Bucket]:
        if self._buckets is None:
            raise RuntimeError("this staged version was applied or discarded already")
        buckets, self._buckets = self._buckets, None
        yield from buckets

    def discard(self) -> None:
        self._buckets = None
        if self._on_discard is not None:
            self._on_discard()


class StagedCopy(StagedVersion):
    """A sync landed in a staging copy of the live tensors it carries; the swap copies those in at once."""

    mode = "full"

    def __init__(self, live: Sequence[torch.Tensor], staging: Sequence[torch.Tensor], after: Callable[[], None] | None = None) -> None:
        self._pairs: tuple[list[torch.Tensor], list[torch.Tensor]] | None = (list(live), list(staging))
        self._after = after

    @property
    def nbytes(self) -> int:
        return 0  # the staging copy is kept across syncs; see StagingCopy.nbytes

    def apply(self) -> Iterator[Bucket]:
        if self._pairs is None:
            raise RuntimeError("this staged version was applied or discarded already")
        (live, staging), self._pairs = self._pairs, None
        batched_copy_(live, staging)
        if self._after is not None:
            self._after()
        return iter(())

    def discard(self) -> None:
        self._pairs = None


class StagingCopy:
    """A staging copy of the live tensors one sync carries (issue 45: only those; a tensor the sync
    leaves out is not in the copy, so the swap leaves it as it is). Kept across syncs per name: a
    name's buffer is reused while its live tensor keeps its storage, shape and dtype; a name the
    sync does not carry is freed before anything new is made, so the copy holds what the sync
    brings (what `staging_room` was asked for), not the model."""

    def __init__(self) -> None:
        self._keys: dict[str, tuple[int, tuple[int, ...], torch.dtype]] = {}
        self.tensors: dict[str, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def for_live(self, live: Mapping[str, torch.Tensor], names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The copy of `live`'s tensors named in `names` (a name `live` lacks is skipped), in
        `live`'s order; `tensors` is then exactly that dict."""
        wanted = set(names)
        keys = {n: (t.data_ptr(), tuple(t.shape), t.dtype) for n, t in live.items() if n in wanted}
        if keys == self._keys:
            return self.tensors
        kept = {n: t for n, t in self.tensors.items() if self._keys.get(n) == keys.get(n)}
        self.tensors = {}  # free what this sync does not carry before anything new is made
        self.tensors = {n: kept[n] if n in kept else torch.empty_like(live[n], memory_format=torch.contiguous_format) for n in keys}
        self._keys = keys
        return self.tensors

    def drop(self) -> None:
        self._keys, self.tensors = {}, {}


def read_words(image: ScatteredImage) -> torch.Tensor:
    """The bucket's words as they lie in the image's regions (padding words 0)."""
    out = torch.zeros(image.num_words, dtype=image.dtype, device=image.device)
    for first, view in image.regions:
        out[first : first + view.numel()].copy_(view)
    return out


def write_words(image: ScatteredImage, words: torch.Tensor) -> None:
    """Write a bucket's words (its bytes, viewed as the image's word) into the image's regions."""
    words = words.view(image.dtype)
    batched_copy_([view for _f, view in image.regions], [words[f : f + v.numel()] for f, v in image.regions])
