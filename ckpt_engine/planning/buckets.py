"""Deterministic bucket planner: tensor specs -> BucketManifest.

A pure function of (specs, bucket size, alignment), so senders cache the plan across syncs and
receivers can check it by digest. Tensors are packed in the order given, which is the order the
weight source yields them; a tensor larger than a bucket is split into bucket-sized chunks.
"""

from __future__ import annotations

from collections.abc import Sequence

from ckpt_engine.manifest import Bucket, BucketManifest, ManifestError, TensorMeta, TensorSpec, dtype_itemsize, make_manifest
from ckpt_engine.planning.ownership import OwnerMap, Shard, check_shards

__all__ = ["DEFAULT_ALIGNMENT", "plan_buckets"]

DEFAULT_ALIGNMENT = 256


def _align_up(x: int, alignment: int) -> int:
    return (x + alignment - 1) // alignment * alignment


def plan_buckets(
    specs: Sequence[TensorSpec],
    bucket_size_bytes: int,
    alignment: int = DEFAULT_ALIGNMENT,
    *,
    solo_bytes: int | None = None,
    num_senders: int = 1,
    owners: OwnerMap | None = None,
) -> BucketManifest:
    """Pack `specs` into buckets of at most `bucket_size_bytes`.

    Each tensor starts at an `alignment`-aligned offset (receivers view it in place with its own
    dtype); a tensor larger than a bucket fills consecutive buckets chunk by chunk.

    `solo_bytes`: a tensor of at least this size gets a bucket of its own, which needs no packing or
    unpacking: what a CPU transport wants, where every copy costs core time the sockets also need.

    `num_senders` / `owners`: each sender packs the pieces it owns into buckets of its own; a tensor
    nobody claims is cut evenly over all senders (at least a bucket) or goes whole to the sender with
    the fewest bytes so far. The senders' buckets are interleaved round-robin, the receivers' order.
    """
    if alignment < 1 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a power of two, got {alignment}")
    if bucket_size_bytes < alignment or bucket_size_bytes % alignment:
        raise ValueError(
            f"bucket_size_bytes must be a positive multiple of the alignment {alignment}, got {bucket_size_bytes}"
        )
    if solo_bytes is not None and (not isinstance(solo_bytes, int) or solo_bytes < 1):
        raise ValueError(f"solo_bytes must be a positive int or None, got {solo_bytes!r}")
    if not isinstance(num_senders, int) or num_senders < 1:
        raise ValueError(f"num_senders must be an int >= 1, got {num_senders!r}")
    names: set[str] = set()
    pieces: list[list[tuple[TensorSpec, int, int]]] = [[] for _ in range(num_senders)]
    load = [0] * num_senders
    for spec in specs:
        if not isinstance(spec, TensorSpec):
            raise TypeError(f"plan_buckets takes TensorSpec items, got {type(spec).__name__}")
        if spec.name in names:
            raise ManifestError(f"{spec.name}: tensor appears twice in the weight metadata")
        names.add(spec.name)
        shards = owners.get(spec.name) if owners is not None else None
        if spec.nbytes == 0:
            shards = [Shard(min(range(num_senders), key=lambda s: (load[s], s)), 0, 0)]
        elif shards is None and num_senders > 1 and spec.nbytes >= bucket_size_bytes:
            shards = _even_split(spec, num_senders)  # replicated and large: every sender sends a part
        elif shards is None:
            sender = min(range(num_senders), key=lambda s: (load[s], s))
            shards = [Shard(sender, 0, spec.nbytes)]
        else:
            shards = check_shards(spec, shards, num_senders)
        for sh in shards:
            pieces[sh.sender].append((spec, sh.start, sh.stop))
            load[sh.sender] += sh.nbytes
    per_sender = [_pack(p, bucket_size_bytes, alignment, solo_bytes) for p in pieces]
    buckets: list[Bucket] = []
    for ordinal in range(max((len(b) for b in per_sender), default=0)):
        for sender, own in enumerate(per_sender):
            if ordinal < len(own):
                buckets.append(Bucket(len(buckets), tuple(own[ordinal]), sender))
    return make_manifest(tuple(buckets), bucket_size_bytes, alignment, num_senders)


def _even_split(spec: TensorSpec, num_senders: int) -> list[Shard]:
    """A replicated tensor cut into `num_senders` nearly equal byte ranges on element bounds."""
    item = dtype_itemsize(spec.dtype)
    per = -(-spec.numel // num_senders) * item
    return [Shard(s, s * per, min(spec.nbytes, (s + 1) * per)) for s in range(num_senders) if s * per < spec.nbytes]


def _pack(
    pieces: Sequence[tuple[TensorSpec, int, int]], bucket_size_bytes: int, alignment: int, solo_bytes: int | None
) -> list[list[TensorMeta]]:
    """One sender's pieces (tensor, byte range) -> its buckets' entries, in order."""
    buckets: list[list[TensorMeta]] = []
    current: list[TensorMeta] = []
    offset = 0

    def close() -> None:
        nonlocal current, offset
        if current:
            buckets.append(current)
        current, offset = [], 0

    for spec, lo, hi in pieces:
        nbytes = hi - lo
        start = _align_up(offset, max(alignment, dtype_itemsize(spec.dtype)))
        if nbytes <= bucket_size_bytes:
            solo = solo_bytes is not None and nbytes >= solo_bytes
            if start + nbytes > bucket_size_bytes or (solo and current):
                close()
                start = 0
            current.append(TensorMeta(spec.name, spec.dtype, spec.shape, lo, nbytes, start))
            offset = start + nbytes
            if solo:
                close()
            continue
        # Larger than a bucket: start on a fresh bucket and fill whole buckets.
        close()
        done = 0
        while done < nbytes:
            size = min(bucket_size_bytes, nbytes - done)
            current.append(TensorMeta(spec.name, spec.dtype, spec.shape, lo + done, size, 0))
            done += size
            offset = size
            if done < nbytes or solo_bytes is not None:
                close()  # with solo_bytes, the last chunk travels alone too
    close()
    return buckets


MiB = 1 << 20


def auto_bucket_size_bytes(device: str, num_buffers: int) -> int:
    """Bucket size when the config leaves it unset: a slice of free memory, within sane bounds.

    On CUDA, 1/8 of free device memory shared by the rotating buffers, between 64 MiB and 1 GiB
    (NCCL reaches ~97% of its peak at 1 GiB on NVLink); on CPU 1/32 of available RAM, between
    16 MiB and 256 MiB.
    """
    import os

    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        free, _total = torch.cuda.mem_get_info(torch.device(device))
        size, lo, hi = free // 8 // num_buffers, 64 * MiB, 1024 * MiB
    else:
        try:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            free = 4096 * MiB
        size, lo, hi = free // 32 // num_buffers, 16 * MiB, 256 * MiB
    return max(lo, min(hi, size)) // MiB * MiB
