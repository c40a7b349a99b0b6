"""The one-launch fold of many images equals `installed.digest` image by image: every element width,
strided views (fused rows, TP column slices, transposed and expanded views), images smaller than the
sample count, random seeds, the same views again with the kernel's table kept. Runs in Triton's interpreter on the CPU (the `fast` tier) and on a GPU."""

from __future__ import annotations


import pytest
import torch

from helpers_triton import run_cases

CASES = r"""
import torch
from ckpt_engine.installed import digest
from ckpt_engine.installed_kernel import Folder

device = DEVICE
g = torch.Generator().manual_seed(7)
base = torch.randint(-2**62, 2**62, (3 * 1024 * 1024 // 8,), generator=g, dtype=torch.int64).to(device)
qkv = base.view(torch.bfloat16)[: 96 * 4096].view(96, 4096)
images = [
    qkv[:64], qkv[64:80], qkv[80:96],                     # fused QKV rows
    qkv[:, 1024:2048],                                     # a TP column slice
    qkv.t()[7:300],                                        # transposed
    base.view(torch.float32)[:37],                         # fewer elements than samples
    base.view(torch.int8)[: 5 * 7 * 9 * 11].view(5, 7, 9, 11)[:, 1:6:2],  # 4 dims, stepped
    base.view(torch.float64)[:4097],
    base.view(torch.bfloat16)[:1],                         # one element
    base.view(torch.float16)[:3000].view(30, 100)[::3, ::7],
    base.view(torch.bfloat16)[:10].view(10, 1).expand(10, 50),  # stride 0
]
for seed, samples in COMBOS:
    got = Folder(images).fold(seed, samples)
    want = [int(digest(v, seed, samples)) for v in images]
    assert got == want, (seed, samples, [i for i, (a, b) in enumerate(zip(got, want)) if a != b])
# the kernel's tables are kept by the views' geometry: other views, then the first ones again
seed, samples = COMBOS[0]
for views in (images[::-1], images[2:5], images):
    assert Folder(views).fold(seed, samples) == [int(digest(v, seed, samples)) for v in views]
if device == "cuda":  # on a stream of its own, behind the current stream's writes (held back here), read back through pinned memory
    torch.cuda._sleep(200_000_000)
    base.mul_(3)
    behind = Folder(images).launch_behind(seed, samples)
    assert behind.values() == [int(digest(v, seed, samples)) for v in images]
print("ok")
"""


ALL = [(seed, samples) for seed in (0, 12345, (1 << 40) - 1) for samples in (1, 2, 4096, 10000)]


def _run(device: str, interpret: bool, combos: list[tuple[int, int]]) -> None:
    run_cases(CASES.replace("DEVICE", repr(device)).replace("COMBOS", repr(combos)), interpret)


def test_equals_digest_in_tritons_interpreter() -> None:
    pytest.importorskip("triton")
    _run("cpu", True, [(12345, 4096), ((1 << 40) - 1, 2)])


@pytest.mark.gpu
def test_equals_digest_on_a_gpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    _run("cuda", False, ALL)


def test_bad_input_is_refused_by_name() -> None:
    pytest.importorskip("triton")
    from ckpt_engine.installed_kernel import Folder

    with pytest.raises(ValueError, match="samples > 0"):
        Folder([torch.zeros(4)]).fold(1, 0)
    with pytest.raises(ValueError, match="image 1 .*complex"):
        Folder([torch.zeros(4), torch.zeros(4, dtype=torch.complex64)]).fold(1, 8)
    with pytest.raises(ValueError, match="image 0 .*5 dims"):
        Folder([torch.zeros(1, 1, 1, 1, 2)]).fold(1, 8)
