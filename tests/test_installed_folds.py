"""`installed.Folds` (many digests, about one kernel per image) equals `installed.digest` image by image:
the trainer's and the engines' sides of an installed-weight check fold through it, so any difference
would fail every checked sync (or, worse, pass a wrong one). Dtypes of every width, bool, a cast on
the wire, non-contiguous region views, images smaller than the sample count, empty ones, the full
fold (`samples` 0); on CPU, and on CUDA when there is one."""

from __future__ import annotations

import pytest
import torch

from ckpt_engine.installed import Folds, digest, region_view
from ckpt_engine.planning.regions import Region

DEVICES = ["cpu"] + ([pytest.param("cuda", marks=pytest.mark.gpu)] if torch.cuda.is_available() else [])


def images(device: str) -> list[tuple[torch.Tensor, torch.dtype | None]]:
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(96, 40, generator=g).to(torch.bfloat16)
    out = [
        (qkv, None),
        (region_view(qkv, Region(0, 32, 64)), None),  # rows of a fused tensor: contiguous
        (region_view(qkv, Region(1, 8, 16)), None),  # columns: not contiguous
        (torch.randn(96, 40, generator=g).to(torch.float16), None),  # same size, another dtype
        (torch.randn(5000, generator=g), None),
        (torch.randn(5000, generator=g), torch.bfloat16),  # cast on the wire
        (torch.randn(17, generator=g).to(torch.bfloat16), None),  # fewer elements than samples
        (torch.zeros(0), None),
        (torch.randint(0, 2, (64, 9), generator=g).bool(), None),
        (torch.randint(-100, 100, (33,), generator=g, dtype=torch.int8), None),
        (torch.randn(700, 3, generator=g).double(), None),
    ]
    return [(t.to(device), d) for t, d in out]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("samples", [0, 7, 4096])
def test_folds_equal_digest_image_by_image(device: str, samples: int) -> None:
    folds = Folds(12345, samples)
    cases = images(device)
    index = [folds.add(t, d) for t, d in cases]
    assert index == list(range(len(cases)))
    assert folds.values() == [int(digest(t, 12345, samples, d)) for t, d in cases]


def test_a_changed_word_changes_only_its_images_digest() -> None:
    cases = images("cpu")
    before = Folds(7, 0)
    for t, d in cases:
        before.add(t, d)
    hit = cases[4][0].clone()
    hit[1234] += 1.0
    after = Folds(7, 0)
    for i, (t, d) in enumerate(cases):
        after.add(hit if i == 4 else t, d)
    changed = [i for i, (a, b) in enumerate(zip(before.values(), after.values())) if a != b]
    assert changed == [4]


@pytest.mark.parametrize("device", DEVICES)
def test_images_added_later_are_read_when_asked_and_equal_digest(device: str) -> None:
    """`add(later=True)` (a stable walk's tensors, folded while the engines digest theirs) notes an
    image and reads it at `read_later` or `values`: the same digests, mixed with images read at once,
    of the values at read time; `drop_later` forgets the unread ones."""
    cases = images(device)
    folds = Folds(99, 64)
    index = [folds.add(t, d, later=i % 2 == 0) for i, (t, d) in enumerate(cases)]
    assert index == list(range(len(cases)))
    assert folds.values() == [int(digest(t, 99, 64, d)) for t, d in cases]
    moved = cases[4][0].clone()
    folds = Folds(99, 64)
    folds.add(moved, later=True)
    moved += 1.0  # read at `values`, not at `add`
    assert folds.values() == [int(digest(moved, 99, 64))]
    folds = Folds(99, 64)
    folds.add(cases[0][0], later=True)
    folds.drop_later()
    assert folds.values() == [0]  # never read
    with pytest.raises(ValueError, match="no installed-weight digest"):
        Folds(99, 64).add(torch.zeros(3, dtype=torch.complex64, device=device), later=True)  # refused as the walk passes


@pytest.mark.parametrize("device", DEVICES)
def test_images_read_in_batches_as_they_land_equal_digest(device: str) -> None:
    """`read_later(indices)` reads some noted images now (a bucket's, as it lands: on a GPU one
    launch, the digests left on the device) and leaves the rest for later: the digests are the same,
    each of the image as it was when its batch was read; indices already read or never noted are
    passed over."""
    cases = images(device)
    folds = Folds(5, 64)
    first = folds.note([t for t, _ in cases], [d for _, d in cases])
    assert first == 0
    moved = cases[0][0]
    folds.read_later([0, 3, 4])
    want0 = int(digest(moved, 5, 64))
    moved += 1.0  # after its batch: not seen
    folds.read_later([3, 1, 99])  # 3 again: passed over
    want = [want0] + [int(digest(t, 5, 64, d)) for t, d in cases[1:]]
    assert folds.values() == want
    assert folds.values() == want  # asked again: the same
