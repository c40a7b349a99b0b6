"""The bucket manifest: what every receiver must know before a byte moves.

A manifest lists, for every bucket, which tensor chunk lies at which offset. It travels as msgpack
(never pickle) and is validated completely on decode, because it comes from another process and
decides where received bytes are written.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable
from functools import cached_property
from dataclasses import dataclass
from typing import Any

import msgpack

__all__ = [
    "DTYPE_ITEMSIZE",
    "BucketManifest",
    "Bucket",
    "ManifestBudget",
    "ManifestError",
    "TensorMeta",
    "TensorSpec",
    "decode_manifest",
    "encode_manifest",
    "dtype_itemsize",
]

MANIFEST_FORMAT = 2
MAX_MANIFEST_BYTES = 64 * 1024 * 1024
MAX_NAME_LEN = 1024
MAX_NDIM = 16
MAX_TENSOR_BYTES = 1 << 46
MAX_BUCKET_BYTES = 1 << 40
MAX_ENTRIES = 2_000_000
"""Chunks in one manifest, all buckets together (DeepSeek-V3 / Kimi-K2 shapes need ~10^5)."""
MAX_SENDERS = 1 << 16
_MIN_ENTRY_BYTES = 12
"""The smallest encoded entry ([name, dtype, [], 0, 0, 0] with 1-char strings): an entry count
the remaining bytes cannot hold is refused before anything is built."""

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

    @cached_property  # the send loops ask per entry and per sync (a frozen dataclass keeps it in __dict__)
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_ITEMSIZE[self.dtype]

    @cached_property
    def is_whole(self) -> bool:
        return self.chunk_offset == 0 and self.chunk_size == self.nbytes


@dataclass(frozen=True)
class Bucket:
    """The chunks that travel together in one broadcast, all from one sender."""

    index: int
    entries: tuple[TensorMeta, ...]
    sender: int = 0

    @cached_property  # asked several times per bucket and sync on both sides (a MoE bucket holds hundreds of entries)
    def nbytes(self) -> int:
        """Bytes actually used (end of the last chunk); only these travel."""
        return max((e.bucket_offset + e.chunk_size for e in self.entries), default=0)


@dataclass(frozen=True)
class BucketManifest:
    """Every bucket of one sync plan, in the order receivers consume them.

    With several senders each bucket names its sender; a tensor's chunks may come from several
    senders (each owns a byte range, e.g. an FSDP dim-0 shard), and receivers finish a tensor when
    every chunk has landed. Receivers never learn more about how the trainer was sharded.
    """

    bucket_size_bytes: int
    alignment: int
    buckets: tuple[Bucket, ...]
    digest: str
    num_senders: int = 1

    @property
    def num_buckets(self) -> int:
        return len(self.buckets)

    @cached_property
    def specs(self) -> list[TensorSpec]:
        """Tensors in order of their first chunk, one per tensor (not per chunk); built once (a sync
        reads it several times: ~1 ms each for a 7B model's 339 tensors). Do not modify."""
        seen: set[str] = set()
        out = []
        for b in self.buckets:
            for e in b.entries:
                if e.name not in seen:
                    seen.add(e.name)
                    out.append(TensorSpec(e.name, e.dtype, e.shape))
        return out

    # Read several times a sync (plan, staging, report, delta): a manifest is immutable once built
    # (frozen, tuples throughout), so each is summed once (~0.5 ms a sum at 18,867 tensors).
    @cached_property
    def num_tensors(self) -> int:
        return len({e.name for b in self.buckets for e in b.entries})

    @cached_property
    def total_bytes(self) -> int:
        return sum(e.chunk_size for b in self.buckets for e in b.entries)

    @cached_property
    def wire_bytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    def sender_buckets(self, sender: int) -> list[Bucket]:
        """The buckets one sender streams, in its order."""
        return [b for b in self.buckets if b.sender == sender]

    def bytes_per_sender(self) -> list[int]:
        out = [0] * self.num_senders
        for b in self.buckets:
            out[b.sender] += sum(e.chunk_size for e in b.entries)
        return out


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


def _content(buckets: tuple[Bucket, ...], bucket_size: int, alignment: int, num_senders: int) -> dict[str, Any]:
    return {
        "format": MANIFEST_FORMAT,
        "bucket_size": bucket_size,
        "alignment": alignment,
        "num_senders": num_senders,
        "buckets": [
            [b.sender, [[e.name, e.dtype, list(e.shape), e.chunk_offset, e.chunk_size, e.bucket_offset] for e in b.entries]]
            for b in buckets
        ],
    }


_KEYS = ("format", "bucket_size", "alignment", "num_senders", "buckets", "digest")


def compute_digest(buckets: tuple[Bucket, ...], bucket_size: int, alignment: int, num_senders: int = 1) -> str:
    packed = msgpack.packb(_content(buckets, bucket_size, alignment, num_senders), use_bin_type=True)
    return hashlib.sha256(packed).hexdigest()


def make_manifest(buckets: tuple[Bucket, ...], bucket_size: int, alignment: int, num_senders: int = 1) -> BucketManifest:
    """Build and validate a manifest (the planner's only way to make one)."""
    digest = compute_digest(buckets, bucket_size, alignment, num_senders)
    manifest = BucketManifest(bucket_size, alignment, buckets, digest, num_senders)
    validate_manifest(manifest)
    return manifest


def encode_manifest(manifest: BucketManifest) -> bytes:
    content = _content(manifest.buckets, manifest.bucket_size_bytes, manifest.alignment, manifest.num_senders)
    content["digest"] = manifest.digest
    return msgpack.packb(content, use_bin_type=True)


class _Reader:
    """Streaming msgpack reads with a budget: nothing is built before its size is checked."""

    def __init__(self, data: bytes) -> None:
        self.size = len(data)
        self.unpacker = msgpack.Unpacker(
            raw=False, strict_map_key=True, max_buffer_size=max(1, len(data)), max_bin_len=0,
            max_str_len=MAX_NAME_LEN * 4, max_array_len=MAX_ENTRIES, max_map_len=len(_KEYS), max_ext_len=0,
        )
        self.unpacker.feed(data)

    def array(self, what: str, limit: int) -> int:
        n = self.unpacker.read_array_header()
        if n > limit:
            raise ManifestError(f"{what} has {n} items, more than the limit {limit}")
        return n

    def value(self) -> Any:
        return self.unpacker.unpack()

    def left(self) -> int:
        return self.size - self.unpacker.tell()


MIN_BUCKET_BYTES = 4096
"""The smallest bucket a config makes (`bucket_size_bytes`): what a budget counts buckets by."""


@dataclass(frozen=True)
class ManifestBudget:
    """What a receiver expects: a manifest shaped to fit the global limits would cost seconds and
    hundreds of MB, so a receiver refuses more entries or bytes than an honest plan of its own
    tensors could hold (each tensor from each sender of its group, one split per bucket), from the header."""

    tensors: int
    nbytes: int
    name_bytes: int
    """The longest expected name, UTF-8 encoded."""
    ndim: int
    senders: int = 1  # of the receiver's weight-sync group (1 before it joined one); a manifest naming more is refused

    @classmethod
    def expecting(cls, specs: Iterable[TensorSpec], *, senders: int = 1) -> ManifestBudget:
        specs = list(specs)
        return cls(
            len(specs), sum(s.nbytes for s in specs),
            max((len(s.name.encode()) for s in specs), default=0), max((len(s.shape) for s in specs), default=0), senders,
        )

    def buckets(self, bucket_size: int, num_senders: int) -> int:
        honest = self.nbytes // max(bucket_size, MIN_BUCKET_BYTES) + num_senders * (self.tensors + 1)
        return 2 * honest + _SLACK_ENTRIES

    def entries(self, bucket_size: int, num_senders: int) -> int:
        honest = num_senders * self.tensors + self.buckets(bucket_size, num_senders)
        return min(MAX_ENTRIES, 2 * honest + _SLACK_ENTRIES)

    def max_bytes(self, bucket_size: int, num_senders: int) -> int:
        entry = max(self.name_bytes, 128) + 5 + 32 + 1 + 9 * max(self.ndim, 4) + 3 * 9 + 1  # name, dtype, shape, three offsets
        return 1024 + self.entries(bucket_size, num_senders) * entry + self.buckets(bucket_size, num_senders) * 16


_SLACK_ENTRIES = 1024  # beyond twice an honest plan: another small model's manifest decodes, its mismatch is named


def decode_manifest(data: bytes, budget: ManifestBudget | None = None) -> BucketManifest:
    """Decode and validate a manifest received from another process (ManifestError on anything
    truncated, oversized, mistyped or inconsistent).

    Read as a stream with a budget on the entries the remaining bytes can hold, so a hostile manifest
    is refused without building millions of objects first; with the receiver's `budget`, anything
    more than its own tensors could need is refused after the header (milliseconds, a few kB).
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ManifestError(f"manifest must be bytes, got {type(data).__name__}")
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"manifest is {len(data)} bytes, more than the limit {MAX_MANIFEST_BYTES}")
    try:
        if budget is not None:
            _check_budget(data, budget)
        return _decode(_Reader(bytes(data)), budget)
    except ManifestError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types on bad input
        raise ManifestError(f"manifest is not valid msgpack: {type(exc).__name__}: {exc}") from None


def _check_budget(data: bytes | bytearray | memoryview, budget: ManifestBudget) -> None:
    """Refuse, from the header alone, a manifest `budget` does not allow (a malformed header is left to the decode)."""
    r = _Reader(bytes(data[:512]))
    try:
        r.unpacker.read_map_header()
        head = {r.value(): r.value() for _ in _KEYS[:4]}
        claimed, most = head["num_senders"], budget.max_bytes(int(head["bucket_size"]), budget.senders)
    except Exception:
        return
    if _is_int(claimed) and claimed > budget.senders:  # the claim never sizes the budget
        raise ManifestError(f"manifest names {claimed} senders; this receiver's weight-sync group has {budget.senders}")
    if len(data) > most:
        raise ManifestError(f"manifest is {len(data)} bytes, more than {most} that this receiver's {budget.tensors} tensors could need")


def _decode(r: _Reader, budget: ManifestBudget | None = None) -> BucketManifest:
    try:
        n = r.unpacker.read_map_header()
    except Exception:
        raise ManifestError("manifest must be a map") from None
    if n != len(_KEYS):
        raise ManifestError(f"manifest keys must be {list(_KEYS)}, got a map of {n} keys")
    head: dict[str, Any] = {}
    for want in _KEYS:
        key = r.value()
        if key != want:
            raise ManifestError(f"manifest keys must be {list(_KEYS)} in this order, got {key!r:.40} where {want!r} belongs")
        if key == "buckets":
            head[key] = _decode_buckets(r, head, budget)
        else:
            head[key] = r.value()
            _check_head(key, head[key])
    if r.left() != 0:
        raise ManifestError(f"{r.left()} bytes follow the manifest")
    bucket_size, alignment, num_senders, digest = head["bucket_size"], head["alignment"], head["num_senders"], head["digest"]
    manifest = BucketManifest(bucket_size, alignment, head["buckets"], digest, num_senders)
    validate_manifest(manifest)
    if compute_digest(manifest.buckets, bucket_size, alignment, num_senders) != digest:
        raise ManifestError("manifest digest does not match its content (corrupt or tampered)")
    return manifest


def _check_head(key: str, value: Any) -> None:
    if key == "format" and value != MANIFEST_FORMAT:
        raise ManifestError(f"unsupported manifest format {value!r:.40} (this side reads {MANIFEST_FORMAT})")
    if key == "bucket_size" and (not _is_int(value) or not 1 <= value <= MAX_BUCKET_BYTES):
        raise ManifestError(f"bucket_size must be an int in [1, {MAX_BUCKET_BYTES}], got {value!r:.40}")
    if key == "alignment" and (not _is_int(value) or value < 1 or value & (value - 1)):
        raise ManifestError(f"alignment must be a power of two, got {value!r:.40}")
    if key == "num_senders" and (not _is_int(value) or not 1 <= value <= MAX_SENDERS):
        raise ManifestError(f"num_senders must be an int in [1, {MAX_SENDERS}], got {value!r:.40}")
    if key == "digest" and (not isinstance(value, str) or len(value) != 64):
        raise ManifestError("digest must be a 64-char sha256 hex string")


def _decode_buckets(r: _Reader, head: dict[str, Any], expected: ManifestBudget | None = None) -> tuple[Bucket, ...]:
    budget = most = min(MAX_ENTRIES, r.left() // _MIN_ENTRY_BYTES)
    if expected is not None:  # the receiver's own tensors and group bound the entries and the buckets
        budget = min(budget, expected.entries(head["bucket_size"], expected.senders))
        most = min(budget, expected.buckets(head["bucket_size"], expected.senders))
    num_buckets = r.array("buckets", most)
    buckets = []
    for bi in range(num_buckets):
        if r.array(f"bucket {bi}", 2) != 2:
            raise ManifestError(f"bucket {bi} must be [sender, entries]")
        sender = r.value()
        if not _is_int(sender) or not 0 <= sender < head["num_senders"]:
            raise ManifestError(f"bucket {bi}: sender must be an int in [0, {head['num_senders']}), got {sender!r:.40}")
        budget = min(budget, r.left() // _MIN_ENTRY_BYTES)
        n = r.array(f"bucket {bi}'s entries (all buckets together)", budget)
        budget -= n
        metas = []
        for _ in range(n):
            if r.array(f"bucket {bi}: entry", 6) != 6:
                raise ManifestError(f"bucket {bi}: entry must be [name, dtype, shape, chunk_offset, chunk_size, bucket_offset]")
            name = r.value()
            _check_name(name)
            dtype = r.value()
            if not isinstance(dtype, str):
                raise ManifestError(f"{name}: dtype must be a string")
            dtype_itemsize(dtype)
            ndim = r.array(f"{name}: shape", MAX_NDIM)
            shape = tuple(r.value() for _ in range(ndim))
            _check_shape(name, shape)
            offsets = (r.value(), r.value(), r.value())
            for field, value in zip(("chunk_offset", "chunk_size", "bucket_offset"), offsets):
                if not _is_int(value) or value < 0:
                    raise ManifestError(f"{name}: {field} must be a non-negative int, got {value!r:.40}")
            metas.append(TensorMeta(name, dtype, shape, *offsets))
        buckets.append(Bucket(bi, tuple(metas), sender))
    return tuple(buckets)


def validate_manifest(manifest: BucketManifest) -> None:
    """Check the invariants every receiver relies on before writing a byte: every chunk lies inside
    its bucket, chunks in a bucket do not overlap, each tensor's chunks cover it exactly once, and
    each sender's chunks of one tensor form one contiguous byte range sent in order."""
    size = manifest.bucket_size_bytes
    if not 1 <= manifest.num_senders <= MAX_SENDERS:
        raise ManifestError(f"num_senders must be in [1, {MAX_SENDERS}], got {manifest.num_senders}")
    tensors: dict[str, tuple[str, tuple[int, ...], int]] = {}
    covered: dict[str, list[tuple[int, int]]] = {}
    open_piece: dict[int, TensorMeta] = {}  # per sender: a piece whose chunks continue
    done_pieces: set[tuple[int, str]] = set()
    for bucket in manifest.buckets:
        if not bucket.entries:
            raise ManifestError(f"bucket {bucket.index} is empty")
        if not 0 <= bucket.sender < manifest.num_senders:
            raise ManifestError(f"bucket {bucket.index}: sender {bucket.sender} is not in [0, {manifest.num_senders})")
        spans: list[tuple[int, int, str]] = []
        for e in bucket.entries:
            nbytes = math.prod(e.shape) * dtype_itemsize(e.dtype)
            if nbytes > MAX_TENSOR_BYTES:
                raise ManifestError(f"{e.name}: {nbytes} bytes is more than the limit {MAX_TENSOR_BYTES}")
            known = tensors.setdefault(e.name, (e.dtype, e.shape, nbytes))
            if known[:2] != (e.dtype, e.shape):
                raise ManifestError(f"{e.name}: chunks disagree on dtype/shape ({known[0]} {known[1]} vs {e.dtype} {e.shape})")
            if e.chunk_offset == 0 and e.chunk_size == nbytes and e.bucket_offset % DTYPE_ITEMSIZE[e.dtype]:
                raise ManifestError(f"{e.name}: bucket_offset {e.bucket_offset} is not aligned for {e.dtype}")
            if e.bucket_offset + e.chunk_size > size:
                raise ManifestError(
                    f"{e.name}: chunk [{e.bucket_offset}, {e.bucket_offset + e.chunk_size}) lies outside "
                    f"bucket {bucket.index} of {size} bytes"
                )
            if e.chunk_offset + e.chunk_size > nbytes:
                raise ManifestError(f"{e.name}: chunk ends at {e.chunk_offset + e.chunk_size}, past the tensor's {nbytes} bytes")
            if e.chunk_size == 0 and nbytes != 0:
                raise ManifestError(f"{e.name}: zero-size chunk of a non-empty tensor")
            prev = open_piece.pop(bucket.sender, None)
            if prev is not None and prev.name == e.name and e.chunk_offset == prev.chunk_offset + prev.chunk_size:
                pass  # the sender's piece continues
            else:
                if prev is not None and prev.name == e.name:
                    raise ManifestError(f"{e.name}: a sender's chunks must cover one contiguous range in order")
                if (bucket.sender, e.name) in done_pieces:
                    raise ManifestError(f"{e.name}: tensor appears twice from sender {bucket.sender}")
                done_pieces.add((bucket.sender, e.name))
            open_piece[bucket.sender] = e
            covered.setdefault(e.name, []).append((e.chunk_offset, e.chunk_offset + e.chunk_size))
            spans.append((e.bucket_offset, e.bucket_offset + e.chunk_size, e.name))
        spans.sort()
        for (s0, e0, n0), (s1, _e1, n1) in zip(spans, spans[1:]):
            if s1 < e0:
                raise ManifestError(f"bucket {bucket.index}: {n0} and {n1} overlap at [{s1}, {e0})")
    for name, ranges in covered.items():
        nbytes = tensors[name][2]
        ranges.sort()
        end = 0
        for start, stop in ranges:
            if start != end:
                what = "overlap" if start < end else "a gap"
                if ranges[0][0] == 0 and len({s for s, _ in ranges}) != len(ranges):
                    raise ManifestError(f"{name}: tensor appears twice in the manifest")
                raise ManifestError(f"{name}: chunks do not cover the tensor exactly once ({what} at byte {min(start, end)})")
            end = stop
        if end != nbytes:
            raise ManifestError(f"{name}: manifest ends before the tensor's last chunk (covered {end} of {nbytes} bytes)")
