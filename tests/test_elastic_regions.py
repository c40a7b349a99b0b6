"""A peer join registers memory regions, not tensors (issue 43: a 30B-A3B image's 9,435 tensors):
where each tensor lies in a region (`elastic/regions.py`: a CUDA segment, else its storage), a
joiner's staging copy as one slab laid again in the offer's order with no new memory
(`LoaderCopy.slab`), reads of tensors lying back to back on both sides joined into one
(`pull._runs`: never across memory that is not free here), and a pull from a slab into a slab
landing every byte exactly, over UCX on the CPU box in one process."""

from __future__ import annotations

import os

import pytest
import torch

from ckpt_engine.elastic.offer import PeerOffer, TensorOffer, tensor_bytes
from ckpt_engine.elastic.peer_source import PeerSource
from ckpt_engine.elastic.prepared import JoinPrep
from ckpt_engine.elastic.pull import _runs, read_checked
from ckpt_engine.elastic.regions import group, regions_of
from ckpt_engine.rollout_adapters.vllm.staging import LoaderCopy
from ckpt_engine.transports.nixl_agent import NixlAgent, load_nixl
from test_elastic_join import nixl_missing
from test_elastic_prepare import Held

CPU = torch.device("cpu")
SPECS = [(f"w{i}", (n,), torch.bfloat16) for i, n in enumerate([7, 256, 1000, 1, 4096, 333])]


def test_a_span_lies_in_the_segment_holding_it_else_in_its_storage() -> None:
    segments = [(1 << 20, 1 << 16), (1 << 24, 1 << 12)]
    spans = [((1 << 20) + 512, 100), ((1 << 24) + 64, 64), ((1 << 20) + 4096, 512), (1 << 30, 32)]
    storages = [((1 << 20) + 512, 512), ((1 << 24), 128), ((1 << 20) + 4096, 512), (1 << 30, 64)]
    regions, where = group(spans, storages, segments)
    assert regions == [(1 << 20, 1 << 16), (1 << 24, 1 << 12), (1 << 30, 64)]
    assert where == [(0, 512), (1, 64), (0, 4096), (2, 0)]
    with pytest.raises(ValueError, match="view 0 .100 bytes at 0x100200. lies outside its storage"):
        group(spans[:1], [((1 << 20) + 600, 64)], [])


def test_a_slab_is_one_region_and_tensors_allocated_one_by_one_one_each() -> None:
    slab = LoaderCopy().slab(SPECS, CPU)
    regions = regions_of([tensor_bytes(t) for t in slab.values()])
    storage = next(iter(slab.values())).untyped_storage()
    assert regions.spans == [(storage.data_ptr(), storage.nbytes())]
    assert [off for _, off in regions.where] == [t.data_ptr() - storage.data_ptr() for t in slab.values()]
    alone = [torch.empty(n, dtype=d) for _, (n,), d in SPECS]
    assert len(regions_of([tensor_bytes(t) for t in alone]).spans) == len(SPECS)


def test_a_slab_is_laid_again_in_another_order_with_no_new_memory() -> None:
    copy = LoaderCopy()
    first = copy.slab(SPECS, CPU)
    base = next(iter(first.values())).untyped_storage().data_ptr()
    assert [t.data_ptr() - base for t in first.values()] == [0, 512, 1024, 3072, 3584, 11776]
    again = copy.slab(SPECS[::-1], CPU)
    assert {t.untyped_storage().data_ptr() for t in again.values()} == {base} and copy.slabbed == {n for n, _, _ in SPECS}
    assert [again[n].data_ptr() - base for n, _, _ in SPECS[::-1]] == [0, 1024, 9216, 9728, 11776, 12288]
    assert all(copy.tensors[n] is again[n] and tuple(again[n].shape) == s for n, s, _ in SPECS)
    copy.slot("w1", (3, 3), torch.float32, CPU)  # reallocated alone: no longer the slab's
    assert "w1" not in copy.slabbed
    other = copy.slab(SPECS, CPU)  # names the slab no longer holds: a new one
    assert next(iter(other.values())).untyped_storage().data_ptr() != base
    copy.retain(["w0"])
    assert copy.slabbed == {"w0"}
    copy.drop()
    assert copy.slabbed == frozenset()


@pytest.mark.skipif(bool(nixl_missing()), reason=nixl_missing())
def test_reads_join_tensors_back_to_back_on_both_sides_and_never_cross_memory_in_use() -> None:
    peer = LoaderCopy().slab(SPECS, CPU)
    peer_base = next(iter(peer.values())).data_ptr()
    offered = [TensorOffer(n, "bfloat16", s, 0, peer[n].data_ptr() - peer_base, peer[n].nbytes, 0) for n, s, _ in SPECS]
    agent = NixlAgent(load_nixl(), "runs", [])
    try:
        mine = LoaderCopy().slab(SPECS, CPU)
        reg = regions_of([tensor_bytes(t) for t in mine.values()])
        agent.register_regions(reg.spans, CPU)
        todo = [(t, tensor_bytes(mine[t.name])) for t in offered]
        (run,) = _runs(todo, agent)  # the same padding on both sides: one read, padding included
        assert (run.offset, run.address, run.nbytes, run.count) == (0, mine["w0"].data_ptr(), 11776 + 333 * 2, len(SPECS))
        # Another layout here (the slab laid in the reverse order): no two follow each other alike.
        mine2 = LoaderCopy().slab(SPECS[::-1], CPU)
        agent.register_regions(regions_of([tensor_bytes(t) for t in mine2.values()]).spans, CPU)
        assert len(_runs([(t, tensor_bytes(mine2[t.name])) for t in offered], agent)) == len(SPECS)
        # Tensors allocated one by one here: each its own read (a gap between two allocations is not free).
        alone = {n: torch.empty(s, dtype=d) for n, s, d in SPECS}
        agent.register_regions(regions_of([tensor_bytes(t) for t in alone.values()]).spans, CPU)
        assert len(_runs([(t, tensor_bytes(alone[t.name])) for t in offered], agent)) == len(SPECS)
        # A tensor of the pull lying in the padding between two others here: that padding is not read along.
        flat = torch.empty(16384, dtype=torch.uint8)
        agent.register_regions([(flat.data_ptr(), flat.numel())], CPU)
        a, b = TensorOffer("a", "uint8", (100,), 0, 0, 100, 0), TensorOffer("b", "uint8", (100,), 0, 512, 100, 0)
        inside = TensorOffer("c", "uint8", (8,), 0, 4096, 8, 0)
        two = [(a, flat[:100]), (b, flat[512:612])]
        assert len(_runs(two, agent)) == 1
        assert len(_runs([*two, (inside, flat[200:208])], agent)) == 3
    finally:
        agent.close()


@pytest.mark.skipif(bool(nixl_missing()), reason=nixl_missing())
def test_a_pull_from_a_slab_into_a_slab_lands_every_byte_in_one_region_each() -> None:
    g = torch.Generator().manual_seed(3)
    peer = Held(LoaderCopy().slab(SPECS, CPU))
    for t in peer.tensors.values():
        t.view(torch.int16).copy_(torch.randint(-2**15, 2**15, t.shape, generator=g, dtype=torch.int16))
    source = PeerSource(peer)
    try:
        copy = LoaderCopy()
        prep = JoinPrep()
        info = prep.prepare(copy.slab(sorted(SPECS), CPU), 60.0)
        offer = PeerOffer.decode(source.offer(1, 60.0), "peer")
        assert (len(offer.regions), info["regions"]) == (1, 1)
        into = copy.slab([(t.name, t.shape, torch.bfloat16) for t in offer.tensors], CPU)  # the offer's order, the same memory
        nbytes, _, prepared = read_checked(into, offer, "peer", 60.0, lambda: None, prep)
        assert prepared == {"used": True, "early": len(SPECS), "late": 0} and nbytes == sum(t.nbytes for t in peer.tensors.values())
        assert all(torch.equal(into[n].view(torch.int16), t.view(torch.int16)) for n, t in peer.tensors.items())
    finally:
        source.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_lie_in_their_caching_allocator_segments() -> None:
    """3 MiB tensors allocated one by one (a 30B-A3B expert's size, as a staged sync's copies are)
    share 20 MiB segments: fewer regions than tensors, each tensor inside its region; a slab is one."""
    device = torch.device("cuda")
    alone = [torch.empty(768 * 2048, dtype=torch.bfloat16, device=device) for _ in range(24)]
    regions = regions_of([tensor_bytes(t) for t in alone])
    expandable = "expandable_segments:true" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").lower()  # then: their storages
    assert len(regions.spans) == len(alone) if expandable else len(regions.spans) < len(alone)
    for t, (r, off) in zip(alone, regions.where):
        addr, size = regions.spans[r]
        assert addr + off == t.data_ptr() and off + t.nbytes <= size
    slab = LoaderCopy().slab([(f"e{i}", (768, 2048), torch.bfloat16) for i in range(24)], device)
    assert len(regions_of([tensor_bytes(t) for t in slab.values()]).spans) == 1
