"""A peer join's checksums (`elastic.offer.tensor_checksums`): the delta codec's checksum of each
tensor's bytes, taken where the tensor lives, the same for the same bytes wherever they lie."""

from __future__ import annotations

import pytest
import torch

from ckpt_engine.delta.checksums import checksum
from ckpt_engine.elastic.offer import tensor_bytes, tensor_checksums

MASK = (1 << 64) - 1


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [
        torch.randn(4096, generator=g),  # 16 KiB: 8-byte words
        (torch.randn(777, generator=g) * 10).to(torch.bfloat16),  # 1,554 bytes: 2-byte words
        torch.randint(0, 255, (1001,), generator=g, dtype=torch.uint8),  # odd: bytes
        torch.randn(6, generator=g).to(torch.float16),  # 12 bytes: 4-byte words
    ]


def test_each_is_the_delta_codecs_checksum_with_words_chosen_by_the_size() -> None:
    ts = _tensors()
    words = [8, 2, 1, 4]
    assert tensor_checksums(ts) == [int(checksum(tensor_bytes(t), w)) & MASK for t, w in zip(ts, words)]


def test_the_same_bytes_at_another_offset_give_the_same_checksum() -> None:
    t = _tensors()[0]
    odd = t.view(torch.uint8)[2 : 2 + 2048].view(torch.float16)  # not 8-byte aligned: checksummed from an aligned copy
    assert odd.data_ptr() % 8
    assert tensor_checksums([odd]) == tensor_checksums([odd.clone()])


def test_a_flipped_bit_or_a_moved_word_changes_it_and_an_empty_tensor_is_zero() -> None:
    t = _tensors()[0]
    flipped = t.clone()
    flipped.view(torch.uint8)[1234] ^= 1
    swapped = t.clone()
    swapped[[10, 11]] = swapped[[11, 10]]  # same words, other positions
    base, one, two, empty = tensor_checksums([t, flipped, swapped, torch.empty(0)])
    assert len({base, one, two}) == 3 and empty == 0


def test_a_strided_tensor_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="contiguous tensors only"):
        tensor_bytes(torch.randn(8, 8).t())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_device_tensor_gives_the_hosts_value_without_leaving_the_device() -> None:
    ts = _tensors()
    on_host = tensor_checksums(ts)
    assert tensor_checksums([t.cuda() for t in ts]) == on_host
    assert tensor_checksums([t.cuda() if i % 2 else t for i, t in enumerate(ts)]) == on_host
