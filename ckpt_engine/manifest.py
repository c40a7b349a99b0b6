"""The bucket manifest: what every receiver must know before a byte moves.

A manifest lists, for every bucket, which tensor chunk lies at which offset. It travels as msgpack
(never pickle) and is validated completely on decode, because it comes from another process and
decides where received bytes are written.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any

import msgpack

__all__ = [
    "DTYPE_ITEMSIZE",
    "BucketManifest",
    "Bucket",
    "ManifestError",
    "TensorMeta",
    "TensorSpec",
    "decode_manifest",
    "encode_manifest",
    "dtype_itemsize",
]

MANIFEST_FORMAT = 1
MAX_MANIFEST_BYTES = 256 * 1024 * 1024
MAX_NAME_LEN = 1024
MAX_NDIM = 16
MAX_TENSOR_BYTES = 1 << 46
MAX_BUCKET_BYTES = 1 << 40
MAX_ENTRIES = 10_000_000

# Wire dtype names and their sizes. Names are torch's (`str(torch.float32)` minus the prefix), so
# the manifest can be read without importing torch.
DTYPE_ITEMSIZE: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint64": 8,
    "uint32": 4,
    "uint16": 2,
    "uint8": 1,
    "bool": 1,
    "complex64": 8,
    "complex128": 16,
}


class ManifestError(ValueError):
    """A manifest (or tensor spec) is malformed, inconsistent or hostile."""


def dtype_itemsize(dtype: str) -> int:
    try:
        return DTYPE_ITEMSIZE[dtype]
    except KeyError:
        raise ManifestError(
            f"unknown dtype {dtype!r}; known dtypes: {', '.join(sorted(DTYPE_ITEMSIZE))}"
        ) from None


@dataclass(frozen=True)
class TensorSpec:
    """Name, wire dtype and global shape of one tensor the rollout needs."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        _check_name(self.name)
        dtype_itemsize(self.dtype)
        _check_shape(self.name, self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class TensorMeta:
    """One chunk of one tensor inside one bucket.

    `chunk_offset`/`chunk_size` are bytes of the tensor's flat (row-major) byte image;
    `bucket_offset` is where that chunk starts in the bucket. A tensor that fits a bucket is one
    chunk covering all its bytes.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    chunk_offset: int
    chunk_size: int
    bucket_offset: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_ITEMSIZE[self.dtype]

    @property
    def is_whole(self) -> bool:
        return self.chunk_offset == 0 and self.chunk_size == self.nbytes

    @property
    def is_last_chunk(self) -> bool:
        return self.chunk_offset + self.chunk_size == self.nbytes


@dataclass(frozen=True)
class Bucket:
    """The chunks that travel together in one broadcast."""

    index: int
    entries: tuple[TensorMeta, ...]

    @property
    def nbytes(self) -> int:
        """Bytes actually used (end of the last chunk); only these travel."""
        return max((e.bucket_offset + e.chunk_size for e in self.entries), default=0)


@dataclass(frozen=True)
class BucketManifest:
    bucket_size_bytes: int
    alignment: int
    buckets: tuple[Bucket, ...]
    digest: str

    @property
    def num_buckets(self) -> int:
        return len(self.buckets)

    @property
    def specs(self) -> list[TensorSpec]:
        """Tensors in send order, one per tensor (not per chunk)."""
        return [
            TensorSpec(e.name, e.dtype, e.shape)
            for b in self.buckets
            for e in b.entries
            if e.chunk_offset == 0
        ]

    @property
    def num_tensors(self) -> int:
        return sum(1 for b in self.buckets for e in b.entries if e.chunk_offset == 0)

    @property
    def total_bytes(self) -> int:
        return sum(e.chunk_size for b in self.buckets for e in b.entries)

    @property
    def wire_bytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)


def _check_name(name: Any) -> None:
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_LEN:
        raise ManifestError(f"tensor name must be a non-empty str of at most {MAX_NAME_LEN} chars, got {name!r:.80}")


def _check_shape(name: str, shape: Any) -> None:
    if not isinstance(shape, tuple) or len(shape) > MAX_NDIM:
        raise ManifestError(f"{name}: shape must be a tuple of at most {MAX_NDIM} dims, got {shape!r:.80}")
    for d in shape:
        if not _is_int(d) or d < 0:
            raise ManifestError(f"{name}: shape dims must be non-negative ints, got {shape!r}")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _content(buckets: tuple[Bucket, ...], bucket_size: int, alignment: int) -> dict[str, Any]:
    return {
        "format": MANIFEST_FORMAT,
        "bucket_size": bucket_size,
        "alignment": alignment,
        "buckets": [
            [[e.name, e.dtype, list(e.shape), e.chunk_offset, e.chunk_size, e.bucket_offset] for e in b.entries]
            for b in buckets
        ],
    }


def compute_digest(buckets: tuple[Bucket, ...], bucket_size: int, alignment: int) -> str:
    packed = msgpack.packb(_content(buckets, bucket_size, alignment), use_bin_type=True)
    return hashlib.sha256(packed).hexdigest()


def make_manifest(buckets: tuple[Bucket, ...], bucket_size: int, alignment: int) -> BucketManifest:
    """Build and validate a manifest (the planner's only way to make one)."""
    manifest = BucketManifest(bucket_size, alignment, buckets, compute_digest(buckets, bucket_size, alignment))
    validate_manifest(manifest)
    return manifest


def encode_manifest(manifest: BucketManifest) -> bytes:
    content = _content(manifest.buckets, manifest.bucket_size_bytes, manifest.alignment)
    content["digest"] = manifest.digest
    return msgpack.packb(content, use_bin_type=True)


def decode_manifest(data: bytes) -> BucketManifest:
    """Decode and validate a manifest received from another process.

    Raises ManifestError on anything truncated, oversized, mistyped or inconsistent.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ManifestError(f"manifest must be bytes, got {type(data).__name__}")
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"manifest is {len(data)} bytes, more than the limit {MAX_MANIFEST_BYTES}")
    try:
        raw = msgpack.unpackb(
            bytes(data),
            raw=False,
            strict_map_key=True,
            max_bin_len=0,
            max_str_len=MAX_NAME_LEN * 4,
            max_array_len=MAX_ENTRIES,
            max_map_len=16,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises several unrelated types on bad input
        raise ManifestError(f"manifest is not valid msgpack: {exc}") from None
    if not isinstance(raw, dict):
        raise ManifestError(f"manifest must be a map, got {type(raw).__name__}")
    expected = {"format", "bucket_size", "alignment", "buckets", "digest"}
    if set(raw) != expected:
        raise ManifestError(f"manifest keys must be {sorted(expected)}, got {sorted(map(str, raw))}")
    if raw["format"] != MANIFEST_FORMAT:
        raise ManifestError(f"unsupported manifest format {raw['format']!r} (this side reads {MANIFEST_FORMAT})")
    bucket_size, alignment, digest = raw["bucket_size"], raw["alignment"], raw["digest"]
    if not _is_int(bucket_size) or not 1 <= bucket_size <= MAX_BUCKET_BYTES:
        raise ManifestError(f"bucket_size must be an int in [1, {MAX_BUCKET_BYTES}], got {bucket_size!r}")
    if not _is_int(alignment) or alignment < 1 or alignment & (alignment - 1):
        raise ManifestError(f"alignment must be a power of two, got {alignment!r}")
    if not isinstance(digest, str) or len(digest) != 64:
        raise ManifestError("digest must be a 64-char sha256 hex string")
    if not isinstance(raw["buckets"], list):
        raise ManifestError("buckets must be a list")
    buckets = []
    for bi, entries in enumerate(raw["buckets"]):
        if not isinstance(entries, list):
            raise ManifestError(f"bucket {bi} must be a list of entries")
        metas = []
        for entry in entries:
            if not isinstance(entry, list) or len(entry) != 6:
                raise ManifestError(f"bucket {bi}: entry must be [name, dtype, shape, chunk_offset, chunk_size, bucket_offset]")
            name, dtype, shape, c_off, c_size, b_off = entry
            _check_name(name)
            if not isinstance(dtype, str):
                raise ManifestError(f"{name}: dtype must be a string")
            dtype_itemsize(dtype)
            if not isinstance(shape, list):
                raise ManifestError(f"{name}: shape must be a list")
            shape_t = tuple(shape)
            _check_shape(name, shape_t)
            for field, value in (("chunk_offset", c_off), ("chunk_size", c_size), ("bucket_offset", b_off)):
                if not _is_int(value) or value < 0:
                    raise ManifestError(f"{name}: {field} must be a non-negative int, got {value!r}")
            metas.append(TensorMeta(name, dtype, shape_t, c_off, c_size, b_off))
        buckets.append(Bucket(bi, tuple(metas)))
    manifest = BucketManifest(bucket_size, alignment, tuple(buckets), digest)
    validate_manifest(manifest)
    if compute_digest(manifest.buckets, bucket_size, alignment) != digest:
        raise ManifestError("manifest digest does not match its content (corrupt or tampered)")
    return manifest


def validate_manifest(manifest: BucketManifest) -> None:
    """Check the invariants every receiver relies on before writing a byte.

    Every chunk lies inside its bucket, chunks in a bucket do not overlap, every tensor's chunks
    are consecutive in send order and cover its bytes exactly once, and names are unique.
    """
    size = manifest.bucket_size_bytes
    seen: set[str] = set()
    open_tensor: TensorMeta | None = None  # a tensor whose chunks continue into the next entry
    for bucket in manifest.buckets:
        if not bucket.entries:
            raise ManifestError(f"bucket {bucket.index} is empty")
        spans: list[tuple[int, int, str]] = []
        for e in bucket.entries:
            nbytes = math.prod(e.shape) * dtype_itemsize(e.dtype)
            if nbytes > MAX_TENSOR_BYTES:
                raise ManifestError(f"{e.name}: {nbytes} bytes is more than the limit {MAX_TENSOR_BYTES}")
            if e.chunk_offset == 0 and e.chunk_size == nbytes and e.bucket_offset % DTYPE_ITEMSIZE[e.dtype]:
                raise ManifestError(f"{e.name}: bucket_offset {e.bucket_offset} is not aligned for {e.dtype}")
            if e.bucket_offset + e.chunk_size > size:
                raise ManifestError(
                    f"{e.name}: chunk [{e.bucket_offset}, {e.bucket_offset + e.chunk_size}) lies outside "
                    f"bucket {bucket.index} of {size} bytes"
                )
            if e.chunk_offset + e.chunk_size > nbytes:
                raise ManifestError(f"{e.name}: chunk ends at {e.chunk_offset + e.chunk_size}, past the tensor's {nbytes} bytes")
            if open_tensor is not None:
                if (e.name, e.dtype, e.shape) != (open_tensor.name, open_tensor.dtype, open_tensor.shape) or (
                    e.chunk_offset != open_tensor.chunk_offset + open_tensor.chunk_size
                ):
                    raise ManifestError(f"{open_tensor.name}: chunks do not cover the tensor contiguously")
            else:
                if e.chunk_offset != 0:
                    raise ManifestError(f"{e.name}: first chunk must start at offset 0, got {e.chunk_offset}")
                if e.name in seen:
                    raise ManifestError(f"{e.name}: tensor appears twice in the manifest")
                seen.add(e.name)
            if e.chunk_size == 0 and nbytes != 0:
                raise ManifestError(f"{e.name}: zero-size chunk of a non-empty tensor")
            open_tensor = None if e.chunk_offset + e.chunk_size == nbytes else e
            spans.append((e.bucket_offset, e.bucket_offset + e.chunk_size, e.name))
        spans.sort()
        for (s0, e0, n0), (s1, _e1, n1) in zip(spans, spans[1:]):
            if s1 < e0:
                raise ManifestError(f"bucket {bucket.index}: {n0} and {n1} overlap at [{s1}, {e0})")
    if open_tensor is not None:
        raise ManifestError(f"{open_tensor.name}: manifest ends before the tensor's last chunk")
