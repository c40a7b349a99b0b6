"""Many copies in one launch (`copy_kernel.py`): every fusable pair equals its source byte for byte
(chunk edges, short tails, one 16-byte word), the tables are kept for the same tensor objects and
rebuilt for new ones, pairs it cannot take are handed back, and it keeps no tensor alive. Runs in
Triton's interpreter on the CPU (the `fast` tier) and on a GPU, where `copies.copy_large_alone_`
takes this path."""

from __future__ import annotations


import pytest
import torch

from helpers_triton import run_cases

CASES = r"""
import gc, weakref
import torch
from ckpt_engine.copy_kernel import FusedCopy, ReplayedCopies, fusable

device = DEVICE
g = torch.Generator().manual_seed(3)

def rand(n, dtype=torch.bfloat16):
    return torch.randint(-30000, 30000, (n,), generator=g, dtype=torch.int32).to(dtype).to(device)

# chunks of 4 KiB: pairs below, at and across chunk edges, a 16-byte pair, a 2-D one, other dtypes
sizes = [8, 2048, 2048 + 8, 3 * 2048 - 8, 20000]
srcs = [rand(n) for n in sizes] + [rand(96 * 64).view(96, 64), rand(1000, torch.float32), rand(4, torch.int32)]
dsts = [torch.zeros_like(s) for s in srcs]
assert all(fusable(d, s) for d, s in zip(dsts, srcs))
FusedCopy(dsts, srcs, chunk_bytes=4096).launch()
assert all(torch.equal(d, s) for d, s in zip(dsts, srcs)), "FusedCopy"

# ReplayedCopies: a fused row view, an odd-sized pair, a misaligned, a strided and a cast pair handed back
base = rand(64 * 64).view(64, 64)
fused_dst = torch.zeros(96, 64, dtype=torch.bfloat16, device=device)
pairs = [
    (fused_dst[32:96], base),                                            # rows of a fused parameter: fusable
    (torch.zeros(7, dtype=torch.bfloat16, device=device), rand(7)),      # 14 bytes: handed back
    (torch.zeros(16, dtype=torch.bfloat16, device=device), rand(17)[1:]),  # source 2 bytes off alignment: handed back
    (torch.zeros(32, 64, dtype=torch.bfloat16, device=device), rand(64 * 64).view(64, 64)[:, :32].t()),  # strided source: handed back
    (torch.zeros(64, dtype=torch.float32, device=device), rand(64)),     # a cast: handed back
    (torch.zeros(4096, dtype=torch.bfloat16, device=device), rand(4096)),
]
d_list, s_list = [d for d, _ in pairs], [s for _, s in pairs]
replayed = ReplayedCopies(kept=2)

def copy_all(d_list, s_list):
    left = replayed.copy(d_list, s_list)
    for i in left:
        d_list[i].copy_(s_list[i])
    return left

assert copy_all(d_list, s_list) == list(range(6)), "pairs seen once are all handed back"
assert all(torch.equal(d, s.to(d.dtype)) for d, s in pairs), "first copy"
for s in s_list:
    s.add_(1)
left = copy_all(d_list, s_list)
assert left == [1, 2, 3, 4], left
assert all(torch.equal(d, s.to(d.dtype)) for d, s in pairs), "second copy (the table's first)"
assert torch.count_nonzero(fused_dst[:32]) == 0, "rows outside the pair written"
table = replayed._tables[next(iter(replayed._tables))].copy

# the same objects, their values changed in place: the kept table copies the new values
for s in s_list:
    s.add_(1)
assert copy_all(d_list, s_list) == left
assert replayed._tables[next(iter(replayed._tables))].copy is table, "the table was not kept"
assert torch.equal(d_list[0], s_list[0]) and torch.equal(d_list[5], s_list[5]), "replay"

# a new source object at the same place in the list: seen once, copied by the caller; then its own table
s_list[5] = rand(4096)
assert copy_all(d_list, s_list) == list(range(6))
assert torch.equal(d_list[5], s_list[5]), "a replaced source"
s_list[5].add_(1)
assert copy_all(d_list, s_list) == left and torch.equal(d_list[5], s_list[5]), "a replaced source, its table"
assert len(replayed._tables) == 2

# the same object, its data replaced (`param.data = ...`): elsewhere now, so no old table is used
moved = rand(4096)
s_list[5].data = moved.clone()
assert copy_all(d_list, s_list) == list(range(6)) and torch.equal(d_list[5], moved), "a source whose data moved"
s_list[5].add_(1)
assert copy_all(d_list, s_list) == left and torch.equal(d_list[5], s_list[5]), "a moved source, its new table"

# nothing kept alive, and a dead tensor's table is never used again
ref = weakref.ref(s_list[0])
del pairs, s, base
s_list[0] = rand(64 * 64).view(64, 64)
gc.collect()
assert ref() is None, "a copy table kept a source alive"
copy_all(d_list, s_list)
assert torch.equal(d_list[0], s_list[0]), "after a source died"
assert len(replayed._tables) == 2, "more tables kept than asked"

if device != "cpu":  # the library's copies take this path on a GPU
    from ckpt_engine.copies import copy_large_alone_
    srcs = [rand(n) for n in (7, 64, 1 << 20, (3 << 20) + 8)] + [rand(300).view(30, 10)[:, :5]]
    dsts = [torch.zeros(s.shape, dtype=s.dtype, device=device) for s in srcs]
    for _ in range(3):  # seen once, then its table, then replayed
        for s in srcs:
            s.add_(1)
        copy_large_alone_(dsts, srcs)
        assert all(torch.equal(d, s) for d, s in zip(dsts, srcs)), "copy_large_alone_"
print("ok")
"""


def _run(device: str, interpret: bool) -> None:
    run_cases(CASES.replace("DEVICE", repr(device)), interpret)


def test_copies_in_tritons_interpreter() -> None:
    pytest.importorskip("triton")
    _run("cpu", True)


@pytest.mark.gpu
def test_copies_on_a_gpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    _run("cuda", False)


def test_bad_pairs_are_refused_by_name() -> None:
    pytest.importorskip("triton")
    from ckpt_engine.copy_kernel import FusedCopy

    with pytest.raises(ValueError, match="2 destinations for 1 sources"):
        FusedCopy([torch.zeros(8), torch.zeros(8)], [torch.zeros(8)])
    with pytest.raises(ValueError, match=r"pair 0 \(torch.float32 \(3,\)"):
        FusedCopy([torch.zeros(3)], [torch.zeros(3)])
    with pytest.raises(ValueError, match="multiple of 16"):
        FusedCopy([], [], chunk_bytes=24)
