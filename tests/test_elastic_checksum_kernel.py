"""The peer join's one-launch checksums (`elastic.checksum_kernel`) equal the delta codec's
`checksum` tensor by tensor, launched by address (`checksums_at`, what `offer.tensor_checksums`
launches): every word size, sizes below, at and across a block and a 2**16-word group, tails, a
tensor of one word, odd byte counts, views at offsets inside one buffer. Runs in Triton's
interpreter on the CPU and on a GPU."""

from __future__ import annotations


import pytest
import torch

from helpers_triton import run_cases

CASES = r"""
import torch
from ckpt_engine.delta.checksums import checksum
from ckpt_engine.elastic.checksum_kernel import BLOCK, checksums_at

device = DEVICE
g = torch.Generator().manual_seed(11)
flat = torch.randint(0, 256, (6 * 65536 * 8 + 4096,), generator=g, dtype=torch.uint8).to(device)
views, words = [], []
at = 0
for word in (8, 4, 2, 1):
    for n in (1, 3, BLOCK - 1, BLOCK, BLOCK + 5, 65536 - 7, 65536 + BLOCK + 1, 2 * 65536 + 3):
        nbytes = n * word
        at = (at + 7) // 8 * 8
        if at + nbytes > flat.numel():
            at = 0
        views.append(flat[at : at + nbytes])
        words.append(word)
        at += nbytes
views.append(flat[1 : 1 + 1001]); words.append(1)        # odd bytes at an odd address
views.append(flat[2 : 2 + 2 * 777]); words.append(2)     # 2-byte words at a 2-byte offset
views.append(flat[:0]); words.append(8)                   # empty: 0
want = [int(checksum(v, w, impl="torch")) if v.numel() else 0 for v, w in zip(views, words)]
at = checksums_at([(v.data_ptr(), v.numel(), w) for v, w in zip(views, words)], flat.device).tolist()  # what tensor_checksums launches
assert at == want, [i for i, (a, b) in enumerate(zip(at, want)) if a != b]
print("ok")
"""


def _run(device: str, interpret: bool) -> None:
    run_cases(CASES.replace("DEVICE", repr(device)), interpret)


def test_equals_the_codecs_checksum_in_tritons_interpreter() -> None:
    pytest.importorskip("triton")
    _run("cpu", True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_equals_the_codecs_checksum_on_a_gpu() -> None:
    _run("cuda", False)

