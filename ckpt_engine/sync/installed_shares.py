"""One sender's share of an installed-weight check with many senders (`checkpoint_engine.senders:
all`, `sync/installed.py`): no rank holds a whole tensor, so each folds the sampled positions of
every announced key that fall in the rows it sent, from its own pieces; rank 0 adds the shares."""

from __future__ import annotations

from typing import Any

import torch

from ckpt_engine.installed import digest_share_runs, wrap64
from ckpt_engine.manifest import BucketManifest
from ckpt_engine.planning.regions import Region
from ckpt_engine.sources.sharded import ShardedWeightSource
from ckpt_engine.sources.wire import torch_dtype

__all__ = ["sender_shares"]


def sender_shares(source: ShardedWeightSource, manifest: BucketManifest, announced: dict[str, Any]) -> list[int]:
    """This sender's share of every announced key's digest, in the announced order: the elements
    whose first byte lies in a chunk the plan has it send (its rows of a sharded tensor; all or,
    chunked over senders, part of a replicated one), read from its own piece. One walk of its
    pieces after its send (the trainer's weights do not move during the sync)."""
    seed, samples = int(announced["seed"]), int(announced["samples"])
    keys = [(str(n), Region.from_wire(n, r) if r is not None else None) for n, r in announced["keys"]]
    spans: dict[str, list[tuple[int, int]]] = {}
    for bucket in manifest.sender_buckets(source.sender_index):
        for e in bucket.entries:
            spans.setdefault(e.name, []).append((e.chunk_offset, e.chunk_offset + e.chunk_size))
    specs = {spec.name: spec for spec in manifest.specs}
    out: list[int] = [0] * len(keys)
    source.begin_pieces()
    try:
        flats: dict[str, tuple[torch.Tensor, int]] = {}
        for i, (name, region) in enumerate(keys):
            mine = spans.get(name)
            if not mine:
                continue
            spec = specs[name]
            wire = torch_dtype(spec.dtype)
            size = wire.itemsize  # chunk offsets count wire bytes
            if name not in flats:
                piece = source.local_piece(name)  # its own dtype: only the words read are cast to the wire's
                whole = tuple(piece.shape) == tuple(spec.shape)
                # element 0 of the piece: the tensor's own for a whole one, its first chunk's for a shard
                flats[name] = (piece.reshape(-1), 0 if whole else min(a for a, _ in mine) // size)
            flat, base = flats[name]
            runs = [(-(-a // size), -(-b // size)) for a, b in mine]  # elements whose first byte is in [a, b)
            out[i] = wrap64(int(digest_share_runs(flat, base, runs, spec.shape, region, seed, samples, wire)))
    finally:
        source.end_pieces()
    return out
