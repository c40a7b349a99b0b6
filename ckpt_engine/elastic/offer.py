"""What a serving peer advertises to an engine that joins from it: the version it holds, its NIXL
agent, and where each held tensor lies with a checksum of its bytes (msgpack, never pickle).

The offer is a head (process id, offer id, version, agent name) and a table. A controller and the
peer's own check read only the head (`OfferHead.decode`); the joiner decodes the table once per join
(`PeerOffer.decode`) and passes the decoded offer along. The table is columns, not an entry per
tensor: the names as one list, everything else as little-endian int arrays (msgpack bin), because a
30B-A3B image is 9,435 tensors and an entry per tensor took 0.03-0.12 s to decode on the CPU box,
2-3 times a join.

The joiner checks an offer against what it holds before it touches anything (`check_for`): the
version it was asked for, every tensor it holds offered with the same dtype, shape and size, and
each descriptor well formed. What it then reads is checked against the advertised checksums, so a
tensor read while the peer moved on (a sync landed in it mid-pull) or from a wrong address is
refused instead of served.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, overload

import msgpack
import numpy as np
import torch

from ckpt_engine.delta import accel
from ckpt_engine.delta.checksums import checksum
from ckpt_engine.transports.nixl_agent import SlotOffer
from ckpt_engine.versions import check_version

__all__ = ["OfferHead", "OfferTable", "PeerOffer", "TensorOffer", "checksum_word", "tensor_bytes", "tensor_checksums"]

_MASK64 = (1 << 64) - 1
_HEAD = {"instance", "offer_id", "version", "agent", "metadata", "memory", "device_id", "table"}
_COLUMNS = {"regions", "names", "dtypes", "dtype", "ndim", "dims", "region", "offset", "nbytes", "checksum"}
_I64, _U64, _U8 = np.dtype("<i8"), np.dtype("<u8"), np.dtype("u1")


def tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (what a one-sided read moves); a strided tensor is
    refused (its reshape would be a copy, and a read would land in the copy)."""
    if not t.is_contiguous():
        raise ValueError(f"a peer join reads and registers contiguous tensors only, got one of shape {list(t.shape)} with strides {list(t.stride())}")
    return t.reshape(-1).view(torch.uint8)


def checksum_word(nbytes: int) -> int:
    """The word size a checksum of `nbytes` bytes sums in: 8 where the size allows, fewer otherwise,
    chosen by the size alone so a peer and a joiner always agree."""
    return next(w for w in (8, 4, 2, 1) if nbytes % w == 0)


def tensor_checksums(tensors: Sequence[torch.Tensor]) -> list[int]:
    """The delta codec's position-weighted checksum of each tensor's bytes (`delta.checksums`),
    computed where the tensor lives, with one transfer to the host per device for all of them: a
    device tensor never goes to the host (host CRC-32 of device tensors ran at ~0.5 GB/s on an
    H200 host, which set a GPU join's time), and the value is the same on every device for the
    same bytes. Words of 8 bytes where the size allows, fewer otherwise, chosen by the size alone
    so a peer and a joiner always agree. On a GPU with Triton every tensor of a device is summed
    in one launch per word size (`checksum_kernel`: 9,435 launches a side were 0.9 s of a
    30B-A3B join); elsewhere tensor by tensor with torch ops."""
    out = [0] * len(tensors)
    pending: dict[torch.device, tuple[list[int], list[torch.Tensor], list[int]]] = {}
    for i, t in enumerate(tensors):
        if not t.is_contiguous():
            t = t.contiguous()
        n = t.nbytes
        if n == 0:
            continue
        word = checksum_word(n)
        if t.data_ptr() % word:  # a view at an odd offset: its words need an aligned copy
            t = t.clone()
        where, held, words = pending.setdefault(t.device, ([], [], []))
        where.append(i)
        held.append(t)
        words.append(word)
    for device, (where, held, words) in pending.items():
        if accel.triton_on(device):
            from ckpt_engine.elastic import checksum_kernel

            sums = checksum_kernel.checksums_at([(t.data_ptr(), t.nbytes, w) for t, w in zip(held, words)], device)
        else:
            sums = torch.stack([checksum(tensor_bytes(t.detach()), w) for t, w in zip(held, words)])
        for i, value in zip(where, sums.tolist()):  # `held` keeps every tensor (and copy) alive until read
            out[i] = value & _MASK64
    return out


class TensorOffer(NamedTuple):
    """One held tensor as a peer offers it: where its bytes lie in the peer's registered memory
    (`offset` bytes into region `region` of the offer; an empty tensor lies nowhere: 0, 0)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    region: int
    offset: int
    nbytes: int
    checksum: int


@dataclass(frozen=True)
class OfferTable(Sequence[TensorOffer]):
    """The offered tensors as columns (one list each, index i is tensor i); a row is a `TensorOffer`."""

    names: list[str]
    dtypes: list[str]
    shapes: list[tuple[int, ...]]
    region: list[int]
    offset: list[int]
    nbytes: list[int]
    checksum: list[int]

    def __len__(self) -> int:
        return len(self.names)

    @overload
    def __getitem__(self, i: int) -> TensorOffer: ...
    @overload
    def __getitem__(self, i: slice) -> list[TensorOffer]: ...
    def __getitem__(self, i: int | slice) -> TensorOffer | list[TensorOffer]:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        return TensorOffer(self.names[i], self.dtypes[i], self.shapes[i], self.region[i], self.offset[i], self.nbytes[i], self.checksum[i])

    def __iter__(self) -> Iterator[TensorOffer]:
        return map(TensorOffer._make, zip(self.names, self.dtypes, self.shapes, self.region, self.offset, self.nbytes, self.checksum))

    def encode(self, regions: Sequence[tuple[int, int]]) -> bytes:
        """The table's wire form (with the regions it points into): columns, msgpack bin arrays."""
        kinds = sorted(set(self.dtypes))
        index = {k: i for i, k in enumerate(kinds)}
        return msgpack.packb({
            "regions": np.asarray(regions, dtype=_U64).reshape(-1, 2).tobytes(),
            "names": self.names,
            "dtypes": kinds,
            "dtype": np.fromiter((index[d] for d in self.dtypes), _U8, len(self)).tobytes(),
            "ndim": np.fromiter(map(len, self.shapes), _U8, len(self)).tobytes(),
            "dims": np.fromiter(itertools.chain.from_iterable(self.shapes), _I64).tobytes(),
            "region": np.asarray(self.region, dtype=_I64).tobytes(),
            "offset": np.asarray(self.offset, dtype=_I64).tobytes(),
            "nbytes": np.asarray(self.nbytes, dtype=_I64).tobytes(),
            "checksum": np.asarray(self.checksum, dtype=_U64).tobytes(),
        }, use_bin_type=True)


class OfferHead(NamedTuple):
    """What a controller and the peer's check need of an offer: whose, which, which version (the
    table is not decoded)."""

    instance: str
    offer_id: int
    version: int
    agent: str

    @classmethod
    def decode(cls, raw: bytes, peer: str) -> OfferHead:
        """The head of the offer of `peer`; a malformed one is refused by name."""
        return cls(*_head(raw, f"the offer of peer {peer!r}")[:4])


@dataclass(frozen=True)
class PeerOffer:
    """A serving peer's offer of the version it holds (one per join; `offer_id` names it at the peer)."""

    instance: str
    """The peer process's id (random per start): an offer from before a restart names another one."""
    offer_id: int
    version: int
    agent: str
    metadata: bytes
    memory: str
    device_id: int
    regions: tuple[tuple[int, int], ...]
    """(address, bytes) of each memory region the peer registered (`elastic/regions.py`): a
    caching-allocator segment holding many tensors, or one storage (a slab, a tensor)."""
    tensors: OfferTable
    """In the order a joiner reads them: by region and offset, so tensors lying back to back at the
    peer come one after the other (a joiner whose copy lies the same way reads them in one read)."""

    def encode(self, table: bytes | None = None) -> bytes:
        """The offer's wire form; `table`: the tensors' encoded table when the caller kept it."""
        return msgpack.packb({
            "instance": self.instance, "offer_id": self.offer_id, "version": self.version, "agent": self.agent,
            "metadata": self.metadata, "memory": self.memory, "device_id": self.device_id,
            "table": table if table is not None else self.tensors.encode(self.regions),
        }, use_bin_type=True)

    @classmethod
    def decode(cls, raw: bytes, peer: str) -> PeerOffer:
        """The offer of `peer`, decoded once per join; a malformed one (a descriptor outside its
        region among them) is refused by name."""
        who = f"the offer of peer {peer!r}"
        instance, offer_id, version, agent, d = _head(raw, who)
        metadata, memory, device_id = d["metadata"], d["memory"], d["device_id"]
        if not isinstance(metadata, bytes) or not metadata:
            raise ValueError(f"{who} has no agent metadata")
        if memory not in ("DRAM", "VRAM") or not isinstance(memory, str) or not isinstance(device_id, int) or isinstance(device_id, bool):
            raise ValueError(f"{who} names memory {memory!r} on device {device_id!r} (DRAM or VRAM, an int device)")
        regions, table = _table(d["table"], who)
        return cls(instance, offer_id, version, agent, metadata, memory, device_id, regions, table)

    def check_for(self, version: int, held: Mapping[str, torch.Tensor]) -> None:
        """Refuse (ValueError naming what) an offer that does not carry `version` or does not
        describe exactly the tensors this engine holds: nothing is read or touched before this."""
        self.check_layout(version, {n: (str(t.dtype).removeprefix("torch."), tuple(t.shape), t.numel() * t.element_size()) for n, t in held.items()})

    def check_layout(self, version: int, held: Mapping[str, tuple[str, tuple[int, ...], int]]) -> None:
        """`check_for` against (dtype, shape, bytes) of each held tensor by name (no tensor needed)."""
        if self.version != version:
            raise ValueError(f"peer offers version {self.version}, but this engine was asked to pull version {version} (a peer advertising a version it does not hold?)")
        t = self.tensors
        offered = {n: i for i, n in enumerate(t.names)}
        if len(offered) != len(t):
            raise ValueError("the offer names a tensor twice")
        if offered.keys() != held.keys():
            missing, extra = sorted(held.keys() - offered.keys()), sorted(offered.keys() - held.keys())
            raise ValueError(
                f"the offer does not describe the tensors this engine holds (another model or layout?): "
                f"{len(missing)} missing ({', '.join(missing[:5])}), {len(extra)} not held here ({', '.join(extra[:5])})"
            )
        wrong = [
            f"{name}: offered {t.dtypes[i]}{list(t.shapes[i])} in {t.nbytes[i]} bytes, held {mine[0]}{list(mine[1])} in {mine[2]} bytes"
            for name, mine in held.items() if (t.dtypes[i := offered[name]], t.shapes[i], t.nbytes[i]) != mine
        ]
        if wrong:
            raise ValueError(f"the offer's memory descriptors do not match what this engine holds ({len(wrong)} tensor(s)): {'; '.join(wrong[:5])}")

    def slots(self) -> SlotOffer:
        """The offer as the NIXL agent's peer record: one 'slot' per region, read at (region, offset)."""
        return SlotOffer(self.agent, self.metadata, self.memory, self.device_id, self.regions)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _map(raw: object, keys: set[str], what: str) -> dict[str, Any]:
    """`raw` decoded as a msgpack map of exactly `keys`; ValueError naming `what` otherwise."""
    try:
        d = msgpack.unpackb(raw, raw=False) if isinstance(raw, bytes) else None
    except (ValueError, msgpack.UnpackException) as exc:
        raise ValueError(f"{what} is not msgpack: {exc}") from None
    if not isinstance(d, dict) or set(d) != keys:
        raise ValueError(f"{what} must be a map of {', '.join(sorted(keys))}; got {d!r:.200}")
    return d


def _head(raw: object, who: str) -> tuple[str, int, int, str, dict[str, object]]:
    d = _map(raw, _HEAD, who)
    if not all(isinstance(d[k], str) and d[k] for k in ("instance", "agent")) or not _is_int(d["offer_id"]):
        raise ValueError(f"{who} has no instance or agent name, or a bad offer id")
    version = check_version(d["version"], f"{who}: version")
    return d["instance"], d["offer_id"], version, d["agent"], d


def _column(c: dict[str, object], key: str, dtype: np.dtype, n: int | None, who: str) -> np.ndarray:
    v = c[key]
    if not isinstance(v, bytes) or len(v) % dtype.itemsize or (n is not None and len(v) != n * dtype.itemsize):
        raise ValueError(f"{who}: column {key!r} must be {n if n is not None else 'some'} {dtype.str} values as bytes, got {v!r:.80}")
    return np.frombuffer(v, dtype)


def _table(raw: object, who: str) -> tuple[tuple[tuple[int, int], ...], OfferTable]:
    """The regions and the tensor table, every descriptor checked (vectorised: no loop per tensor
    but the one building the shapes)."""
    c = _map(raw, _COLUMNS, f"{who}: its table")
    names, kinds = c["names"], c["dtypes"]
    if not isinstance(names, list) or not all(type(s) is str for s in names) or not isinstance(kinds, list) or not all(type(s) is str for s in kinds):
        raise ValueError(f"{who}: names and dtypes must be lists of strings")
    n = len(names)
    spans = _column(c, "regions", _U64, None, who).reshape(-1, 2)
    bad = np.flatnonzero((spans[:, 0] == 0) | (spans[:, 1] == 0))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{who}: region {i} has {int(spans[i, 1])} bytes at address {int(spans[i, 0]):#x} (a wrong memory descriptor)")
    dtype, ndim = _column(c, "dtype", _U8, n, who), _column(c, "ndim", _U8, n, who)
    dims = _column(c, "dims", _I64, int(ndim.sum()), who)
    region, offset, nbytes = (_column(c, k, _I64, n, who) for k in ("region", "offset", "nbytes"))
    checksums = _column(c, "checksum", _U64, n, who)
    if (dtype >= len(kinds)).any():
        raise ValueError(f"{who}: tensor {names[int(np.argmax(dtype >= len(kinds)))]!r} names dtype {int(dtype.max())} of the table's {len(kinds)}")
    negative = (region < 0) | (offset < 0) | (nbytes < 0)
    if negative.any() or (dims < 0).any():
        at = int(np.argmax(negative)) if negative.any() else int(np.searchsorted(np.cumsum(ndim), int(np.argmax(dims < 0)), side="right"))
        raise ValueError(f"{who}: tensor {names[at]!r}: shape, region, offset and bytes must be non-negative ints")
    full = nbytes > 0
    beyond = full & (region >= len(spans))
    if beyond.any():
        i = int(np.argmax(beyond))
        raise ValueError(f"{who}: tensor {names[i]!r}: {int(nbytes[i])} bytes at offset {int(offset[i])} lie outside region {int(region[i])} of the offer's {len(spans)} (a wrong memory descriptor)")
    sizes = spans[np.where(full, region, 0), 1] if len(spans) else np.zeros(n, _U64)
    outside = full & (offset.astype(_U64) + nbytes.astype(_U64) > sizes)
    if outside.any():
        i = int(np.argmax(outside))
        raise ValueError(f"{who}: tensor {names[i]!r}: {int(nbytes[i])} bytes at offset {int(offset[i])} lie outside region {int(region[i])} of {int(sizes[i])} bytes (a wrong memory descriptor)")
    flat, cuts = dims.tolist(), np.cumsum(ndim, dtype=np.int64).tolist()
    shapes = [tuple(flat[a:b]) for a, b in zip([0, *cuts[:-1]], cuts)]
    table = OfferTable(names, [kinds[k] for k in dtype.tolist()], shapes, region.tolist(), offset.tolist(), nbytes.tolist(), checksums.tolist())
    return tuple(map(tuple, spans.tolist())), table
