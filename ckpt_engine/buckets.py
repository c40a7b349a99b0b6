"""Deterministic bucket planner: tensor specs -> BucketManifest.

A pure function of (specs, bucket size, alignment), so senders cache the plan across syncs and
receivers can check it by digest. Tensors are packed in the order given, which is the order the
weight source yields them; a tensor larger than a bucket is split into bucket-sized chunks.
"""

from __future__ import annotations

from collections.abc import Sequence

from ckpt_engine.manifest import Bucket, BucketManifest, ManifestError, TensorMeta, TensorSpec, dtype_itemsize, make_manifest

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
) -> BucketManifest:
    """Pack `specs` into buckets of at most `bucket_size_bytes`.

    Each tensor starts at an `alignment`-aligned offset, so receivers can view it in place with its
    own dtype. A tensor that does not fit the rest of the current bucket opens a new one; a tensor
    larger than a whole bucket fills consecutive buckets chunk by chunk, and the next tensor
    continues after its last chunk.

    `solo_bytes`: a tensor of at least this size gets a bucket of its own. A lone tensor needs no
    packing (a stable sender broadcasts it from its own memory) and no unpacking (a receiver that
    offers its destination receives straight into it), which is what a CPU transport needs: there,
    every copy costs core time the socket copies also need, while a few more messages cost little.
    """
    if alignment < 1 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a power of two, got {alignment}")
    if bucket_size_bytes < alignment or bucket_size_bytes % alignment:
        raise ValueError(
            f"bucket_size_bytes must be a positive multiple of the alignment {alignment}, got {bucket_size_bytes}"
        )
    if solo_bytes is not None and (not isinstance(solo_bytes, int) or solo_bytes < 1):
        raise ValueError(f"solo_bytes must be a positive int or None, got {solo_bytes!r}")
    names: set[str] = set()
    buckets: list[Bucket] = []
    current: list[TensorMeta] = []
    offset = 0

    def close() -> None:
        nonlocal current, offset
        if current:
            buckets.append(Bucket(len(buckets), tuple(current)))
        current, offset = [], 0

    for spec in specs:
        if not isinstance(spec, TensorSpec):
            raise TypeError(f"plan_buckets takes TensorSpec items, got {type(spec).__name__}")
        if spec.name in names:
            raise ManifestError(f"{spec.name}: tensor appears twice in the weight metadata")
        names.add(spec.name)
        nbytes = spec.nbytes
        start = _align_up(offset, max(alignment, dtype_itemsize(spec.dtype)))
        if nbytes <= bucket_size_bytes:
            solo = solo_bytes is not None and nbytes >= solo_bytes
            if start + nbytes > bucket_size_bytes or (solo and current):
                close()
                start = 0
            current.append(TensorMeta(spec.name, spec.dtype, spec.shape, 0, nbytes, start))
            offset = start + nbytes
            if solo:
                close()
            continue
        # Larger than a bucket: start on a fresh bucket and fill whole buckets.
        close()
        done = 0
        while done < nbytes:
            size = min(bucket_size_bytes, nbytes - done)
            current.append(TensorMeta(spec.name, spec.dtype, spec.shape, done, size, 0))
            done += size
            offset = size
            if done < nbytes or solo_bytes is not None:
                close()  # with solo_bytes, the last chunk travels alone too
    close()
    return make_manifest(tuple(buckets), bucket_size_bytes, alignment)


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
