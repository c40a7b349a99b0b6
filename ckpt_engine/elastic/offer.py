"""What a serving peer advertises to an engine that joins from it: the version it holds, its NIXL
agent, and where each held tensor lies with a checksum of its bytes (msgpack, never pickle).

The joiner checks an offer against what it holds before it touches anything (`check_for`): the
version it was asked for, every tensor it holds offered with the same dtype, shape and size, and
each descriptor well formed. What it then reads is checked against the advertised checksums, so a
tensor read while the peer moved on (a sync landed in it mid-pull) or from a wrong address is
refused instead of served.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import msgpack
import torch

from ckpt_engine.delta import accel
from ckpt_engine.delta.checksums import checksum
from ckpt_engine.transports.nixl_agent import SlotOffer
from ckpt_engine.versions import check_version

__all__ = ["PeerOffer", "TensorOffer", "tensor_bytes", "tensor_checksums"]

_MASK64 = (1 << 64) - 1
_KEYS = {"instance", "offer_id", "version", "agent", "metadata", "memory", "device_id", "regions", "tensors"}


def tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (what a one-sided read moves); a strided tensor is
    refused (its reshape would be a copy, and a read would land in the copy)."""
    if not t.is_contiguous():
        raise ValueError(f"a peer join reads and registers contiguous tensors only, got one of shape {list(t.shape)} with strides {list(t.stride())}")
    return t.reshape(-1).view(torch.uint8)


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
        data = tensor_bytes(t.detach().contiguous())
        n = data.numel()
        if n == 0:
            continue
        word = next(w for w in (8, 4, 2, 1) if n % w == 0)
        if data.data_ptr() % word:  # a view at an odd offset: its words need an aligned copy
            data = data.clone()
        where, views, words = pending.setdefault(data.device, ([], [], []))
        where.append(i)
        views.append(data)
        words.append(word)
    for device, (where, views, words) in pending.items():
        if accel.triton_on(device):
            from ckpt_engine.elastic import checksum_kernel

            sums = checksum_kernel.checksums(views, words)
        else:
            sums = torch.stack([checksum(v, w) for v, w in zip(views, words)])
        for i, value in zip(where, sums.tolist()):
            out[i] = value & _MASK64
    return out


@dataclass(frozen=True)
class TensorOffer:
    """One held tensor as a peer offers it: where its bytes lie in the peer's registered memory
    (`offset` bytes into region `region` of the offer; an empty tensor lies nowhere: 0, 0)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    region: int
    offset: int
    nbytes: int
    checksum: int

    def to_wire(self) -> list[object]:
        return [self.name, self.dtype, list(self.shape), [self.region, self.offset], self.nbytes, self.checksum]


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
    tensors: tuple[TensorOffer, ...]
    """In the order a joiner reads them: by region and offset, so tensors lying back to back at the
    peer come one after the other (a joiner whose copy lies the same way reads them in one read)."""

    def encode(self) -> bytes:
        d = {k: getattr(self, k) for k in _KEYS - {"tensors", "regions"}}
        d["regions"] = [list(r) for r in self.regions]
        d["tensors"] = [t.to_wire() for t in self.tensors]
        return msgpack.packb(d, use_bin_type=True)

    @classmethod
    def decode(cls, raw: bytes, peer: str) -> PeerOffer:
        """The offer of `peer`; a malformed one (a descriptor outside its region among them) is refused by name."""
        who = f"the offer of peer {peer!r}"
        try:
            d = msgpack.unpackb(raw, raw=False) if isinstance(raw, bytes) else None
        except (ValueError, msgpack.UnpackException) as exc:
            raise ValueError(f"{who} is not msgpack: {exc}") from None
        if not isinstance(d, dict) or set(d) != _KEYS:
            raise ValueError(f"{who} must be a map of {', '.join(sorted(_KEYS))}; got {d!r:.200}")
        if not all(isinstance(d[k], str) and d[k] for k in ("instance", "agent")) or not isinstance(d["metadata"], bytes) or not d["metadata"]:
            raise ValueError(f"{who} has no instance, agent name or agent metadata")
        if d["memory"] not in ("DRAM", "VRAM") or not _is_int(d["device_id"]) or not _is_int(d["offer_id"]):
            raise ValueError(f"{who} names memory {d['memory']!r} on device {d['device_id']!r} (DRAM or VRAM, an int device) or a bad offer id")
        try:
            version = check_version(d["version"], f"{who}: version")
        except ValueError as exc:
            raise ValueError(str(exc)) from None
        if not isinstance(d["tensors"], list) or not isinstance(d["regions"], list):
            raise ValueError(f"{who}: regions and tensors must be lists")
        regions = tuple(_region(i, r, who) for i, r in enumerate(d["regions"]))
        return cls(d["instance"], d["offer_id"], version, d["agent"], d["metadata"], d["memory"], d["device_id"], regions,
                   tuple(_tensor(t, regions, who) for t in d["tensors"]))

    def check_for(self, version: int, held: Mapping[str, torch.Tensor]) -> None:
        """Refuse (ValueError naming what) an offer that does not carry `version` or does not
        describe exactly the tensors this engine holds: nothing is read or touched before this."""
        if self.version != version:
            raise ValueError(f"peer offers version {self.version}, but this engine was asked to pull version {version} (a peer advertising a version it does not hold?)")
        offered = {t.name: t for t in self.tensors}
        if len(offered) != len(self.tensors):
            raise ValueError("the offer names a tensor twice")
        missing, extra = sorted(set(held) - set(offered)), sorted(set(offered) - set(held))
        if missing or extra:
            raise ValueError(
                f"the offer does not describe the tensors this engine holds (another model or layout?): "
                f"{len(missing)} missing ({', '.join(missing[:5])}), {len(extra)} not held here ({', '.join(extra[:5])})"
            )
        wrong: list[str] = []
        for name, t in held.items():
            o = offered[name]
            mine = (str(t.dtype).removeprefix("torch."), tuple(t.shape), t.numel() * t.element_size())
            if (o.dtype, o.shape, o.nbytes) != mine:
                wrong.append(f"{name}: offered {o.dtype}{list(o.shape)} in {o.nbytes} bytes, held {mine[0]}{list(mine[1])} in {mine[2]} bytes")
        if wrong:
            raise ValueError(f"the offer's memory descriptors do not match what this engine holds ({len(wrong)} tensor(s)): {'; '.join(wrong[:5])}")

    def slots(self) -> SlotOffer:
        """The offer as the NIXL agent's peer record: one 'slot' per region, read at (region, offset)."""
        return SlotOffer(self.agent, self.metadata, self.memory, self.device_id, self.regions)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _region(i: int, r: object, who: str) -> tuple[int, int]:
    if not (isinstance(r, list) and len(r) == 2 and all(_is_int(v) and v >= 0 for v in r)):
        raise ValueError(f"{who}: region {i} must be [address, bytes] of non-negative ints, got {r!r:.120}")
    if r[0] == 0 or r[1] == 0:
        raise ValueError(f"{who}: region {i} has {r[1]} bytes at address {r[0]:#x} (a wrong memory descriptor)")
    return r[0], r[1]


def _tensor(t: object, regions: tuple[tuple[int, int], ...], who: str) -> TensorOffer:
    if not (isinstance(t, list) and len(t) == 6 and isinstance(t[0], str) and isinstance(t[1], str) and isinstance(t[2], list) and isinstance(t[3], list) and len(t[3]) == 2):
        raise ValueError(f"{who}: a tensor must be [name, dtype, shape, [region, offset], nbytes, checksum], got {t!r:.120}")
    name, dtype, shape, (region, offset), nbytes, checksum = t
    if not all(_is_int(v) and v >= 0 for v in (*shape, region, offset, nbytes, checksum)):
        raise ValueError(f"{who}: tensor {name!r}: shape, region, offset, bytes and checksum must be non-negative ints, got {t!r:.120}")
    if nbytes > 0 and (region >= len(regions) or offset + nbytes > regions[region][1]):
        held = f"region {region} of {regions[region][1]} bytes" if region < len(regions) else f"region {region} of the offer's {len(regions)}"
        raise ValueError(f"{who}: tensor {name!r}: {nbytes} bytes at offset {offset} lie outside {held} (a wrong memory descriptor)")
    return TensorOffer(name, dtype, tuple(shape), region, offset, nbytes, checksum)
