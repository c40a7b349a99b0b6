"""The NIXL side of the pull transport: loading the package, one agent per rank, and the slot offer
a sender publishes through the rendezvous store (msgpack, never pickle).

A sender registers its rotating slots with its agent once, at join, and publishes a `SlotOffer`:
its agent's name and metadata (NIXL's own opaque bytes, carried as msgpack bin) and where each slot
lies. A receiver loads that metadata, checks the offer against what the plan needs (slot count and
size, the agent the metadata names) and from then on reads the slots with one-sided READs; the
sender's CPU takes no part in moving a byte.
"""

from __future__ import annotations

import bisect
import logging
import os
import secrets
import sys
import time
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import msgpack
import torch

__all__ = ["INSTALL_LINE", "NixlAgent", "SlotOffer", "load_nixl"]

logger = logging.getLogger(__name__)

INSTALL_LINE = "pip install nixl-cu12 (CUDA 12 hosts and CPU-only hosts; nixl-cu13 for CUDA 13), or ckpt-engine's nixl extra (pip install -e '.[nixl]')"

_MODULES = ("nixl", "nixl_cu12", "nixl_cu13")
"""The meta package `nixl` re-exports a CUDA variant's module; a variant installed alone is
importable under its own name."""


def load_nixl() -> ModuleType:
    """NIXL's Python API module (it holds `nixl_agent`, `nixl_agent_config`); an ImportError that
    names the package and gives the install line when none is installed."""
    import importlib

    failures: list[str] = []
    for name in _MODULES:
        try:
            module = importlib.import_module(f"{name}._api")
        except ImportError as exc:
            failures.append(f"{name}: {exc}")
            continue
        _quiet(logging.getLogger("nixl"))
        return module
    raise ImportError(f"the nixl backend needs the `nixl` package, which is not importable here ({'; '.join(failures)}); install it: {INSTALL_LINE}")


def _quiet(nixl_logger: logging.Logger) -> None:
    """NIXL's package logs every agent's start at INFO to stdout through a handler of its own, which
    broke `ckpt-engine bench --json -` and would interleave with any program's output: its handlers
    write to stderr instead, at WARNING unless NIXL_LOG_LEVEL asks for more."""
    for handler in nixl_logger.handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            handler.setStream(sys.stderr)
    if not os.environ.get("NIXL_LOG_LEVEL"):
        nixl_logger.setLevel(logging.WARNING)


def memory_kind(device: torch.device) -> tuple[str, int]:
    """NIXL's memory segment and device id for tensors on `device`."""
    if device.type == "cpu":
        return "DRAM", 0
    if device.type == "cuda":
        return "VRAM", device.index if device.index is not None else torch.cuda.current_device()
    raise ValueError(f"the nixl backend reads CPU or CUDA memory, got device {device}")


@dataclass(frozen=True)
class SlotOffer:
    """What a sender publishes once per join: its agent and its registered slots."""

    agent: str
    metadata: bytes
    memory: str
    """'DRAM' or 'VRAM'."""
    device_id: int
    slots: tuple[tuple[int, int], ...]
    """(address, bytes) of each rotating slot, in slot order."""

    def encode(self) -> bytes:
        d = {"agent": self.agent, "metadata": self.metadata, "memory": self.memory, "device_id": self.device_id, "slots": [list(s) for s in self.slots]}
        return msgpack.packb(d, use_bin_type=True)

    @classmethod
    def decode(cls, raw: bytes, *, sender: int, num_slots: int, slot_bytes: int) -> SlotOffer:
        """The offer of `sender`, checked against this plan's slots: a malformed one, or one whose
        slots do not match (another bucket size or buffer count) is refused by name."""
        who = f"the nixl offer of sender {sender}"
        try:
            d = msgpack.unpackb(raw, raw=False)
        except (ValueError, msgpack.UnpackException) as exc:
            raise ValueError(f"{who} is not msgpack: {exc}") from None
        if not isinstance(d, dict) or set(d) != {"agent", "metadata", "memory", "device_id", "slots"}:
            raise ValueError(f"{who} must be a map of agent, metadata, memory, device_id, slots; got {d!r:.200}")
        if not isinstance(d["agent"], str) or not d["agent"] or not isinstance(d["metadata"], bytes) or not d["metadata"]:
            raise ValueError(f"{who} has no agent name or no agent metadata")
        if d["memory"] not in ("DRAM", "VRAM") or not isinstance(d["device_id"], int) or isinstance(d["device_id"], bool):
            raise ValueError(f"{who} names memory {d['memory']!r} on device {d['device_id']!r} (DRAM or VRAM, an int device)")
        slots = d["slots"]
        if not isinstance(slots, list) or len(slots) != num_slots:
            raise ValueError(f"{who} describes {len(slots) if isinstance(slots, list) else slots!r} slots, this plan needs {num_slots}")
        out: list[tuple[int, int]] = []
        for i, s in enumerate(slots):
            if not (isinstance(s, list) and len(s) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in s)) or s[0] <= 0:
                raise ValueError(f"{who}: slot {i} must be [address, bytes] with a positive address, got {s!r}")
            if s[1] != slot_bytes:
                raise ValueError(f"{who}: slot {i} holds {s[1]} bytes, this plan's slots hold {slot_bytes} (another bucket size?)")
            out.append((s[0], s[1]))
        return cls(d["agent"], d["metadata"], d["memory"], d["device_id"], tuple(out))


class NixlAgent:
    """One rank's NIXL agent over UCX: its registered slots, the peers it reads from and the
    transfer requests it reuses (one per (slot, sender slot, bytes), reposted every sync)."""

    def __init__(self, api: ModuleType, label: str, buffers: list[torch.Tensor]) -> None:
        self.name = f"ckpt-{label}-{secrets.token_hex(6)}"
        """Unique per join: a restarted peer's old registration can never be taken for its new one."""
        # No progress thread: NIXL's polls without a pause (about 0.7 of a core per idle agent on the
        # CPU box, which starved the ranks' own threads on 2 cores). A receiver's reads progress when
        # it looks at them; a sender progresses while it waits for its receivers (`progress`), which
        # UCX needs where it emulates a READ over TCP (on RDMA or NVLink the target does nothing).
        config = api.nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=["UCX"])
        self.agent: Any = api.nixl_agent(self.name, config)
        if "UCX" not in self.agent.backends:
            raise RuntimeError(f"NIXL agent {self.name}: the UCX backend did not load (plugins found: {self.agent.plugin_list})")
        self.buffers: list[torch.Tensor] = []
        self.slots: list[tuple[int, int]] = []
        """(address, bytes) of everything registered, in order: the tensors of `register`, the
        regions of `register_regions`."""
        self._starts: list[tuple[int, int]] = []
        """(address, end) of every slot, sorted: what `covers` looks up."""
        self._regs: list[Any] = []
        self.memory, self.device_id = "DRAM", 0
        self.register(buffers)
        self.peers: dict[int, SlotOffer] = {}
        self._requests: dict[tuple[int, int, int, int, int], Any] = {}

    def register(self, buffers: list[torch.Tensor]) -> None:
        """Register more memory, of the one device this agent reads into (a joiner prepared before
        the peer's offer, whose offer named a tensor it had not registered). Deregistered at `close`."""
        if not buffers:
            return
        kind = memory_kind(buffers[0].device)
        if any(memory_kind(b.device) != kind for b in buffers) or (self.slots and kind != (self.memory, self.device_id)):
            raise ValueError(f"NIXL agent {self.name} registers the memory of one device, not of {sorted({str(b.device) for b in [*self.buffers, *buffers]})}")
        self._regs.append(self.agent.register_memory(buffers, backends=["UCX"]))
        self.buffers.extend(buffers)
        self._add_slots([(b.data_ptr(), b.numel() * b.element_size()) for b in buffers], kind)

    def register_regions(self, spans: list[tuple[int, int]], device: torch.device) -> None:
        """Register (address, bytes) regions of `device`'s memory, each holding many tensors (a
        peer join: `elastic/regions.py`). The caller keeps their memory alive until `close`."""
        if not spans:
            return
        kind = memory_kind(device)
        if self.slots and kind != (self.memory, self.device_id):
            raise ValueError(f"NIXL agent {self.name} registers the memory of one device ({self.memory} {self.device_id}), not {device}")
        if any(addr <= 0 or n <= 0 for addr, n in spans):
            raise ValueError(f"NIXL agent {self.name}: a region needs a positive address and size, got {[s for s in spans if s[0] <= 0 or s[1] <= 0][:3]}")
        self._regs.append(self.agent.register_memory([(addr, n, kind[1], "") for addr, n in spans], mem_type=kind[0], backends=["UCX"]))
        self._add_slots(list(spans), kind)

    def _add_slots(self, spans: list[tuple[int, int]], kind: tuple[str, int]) -> None:
        self.slots.extend(spans)
        self._starts = sorted([*self._starts, *((a, a + n) for a, n in spans)])
        self.memory, self.device_id = kind

    def covers(self, address: int, nbytes: int) -> bool:
        """Whether [address, address + nbytes) lies inside one registered slot (what a read's local
        side must: NIXL finds the one registration holding a descriptor)."""
        i = bisect.bisect_right(self._starts, (address, float("inf"))) - 1
        return i >= 0 and self._starts[i][0] <= address and address + nbytes <= self._starts[i][1]

    @property
    def registrations(self) -> int:
        """How many registrations this agent holds (0 once closed)."""
        return len(self._regs)

    def offer(self) -> SlotOffer:
        return SlotOffer(self.name, self.agent.get_agent_metadata(), self.memory, self.device_id, tuple(self.slots))

    def add_peer(self, sender: int, offer: SlotOffer) -> None:
        """Load a sender's metadata; the agent its metadata names must be the offer's."""
        if offer.memory != self.memory and self.memory == "DRAM" and offer.memory == "VRAM":
            logger.info("nixl: sender %d offers device memory and this rank reads into host memory", sender)
        loaded = self.agent.add_remote_agent(offer.metadata)
        loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if loaded != offer.agent:
            self.agent.remove_remote_agent(loaded)
            raise ValueError(f"the nixl offer of sender {sender} names agent {offer.agent!r} but its metadata is agent {loaded!r} (a stale registration?)")
        self.peers[sender] = offer
        self.agent.make_connection(offer.agent, ["UCX"])

    def read(self, sender: int, remote_slot: int, offset: int, local: torch.Tensor) -> Any:
        """Start one READ of `local.numel()` bytes at `offset` of sender slot `remote_slot` into
        `local` (a contiguous byte view of a registered slot); returns the request to poll."""
        return self.read_span(sender, remote_slot, offset, local.data_ptr(), local.numel() * local.element_size())

    def read_span(self, sender: int, remote_slot: int, offset: int, address: int, nbytes: int) -> Any:
        """`read` into [address, address + nbytes) of this agent's registered memory (a run of
        tensors lying back to back in it and in the sender's slot: one read for all of them)."""
        peer = self.peers[sender]
        addr, size = peer.slots[remote_slot]
        if offset < 0 or offset + nbytes > size:
            raise ValueError(f"a read of {nbytes} bytes at {offset} lies outside sender {sender}'s slot {remote_slot} of {size} bytes")
        key = (sender, remote_slot, offset, address, nbytes)
        req = self._requests.get(key)
        if req is None:
            a = self.agent
            local_descs = a.get_xfer_descs([(address, nbytes, self.device_id)], self.memory)
            remote_descs = a.get_xfer_descs([(addr + offset, nbytes, peer.device_id)], peer.memory)
            req = self._requests[key] = a.initialize_xfer("READ", local_descs, remote_descs, peer.agent, backends=["UCX"])
        state = self.agent.transfer(req)
        if state == "ERR":
            raise RuntimeError(f"NIXL refused to post a read from sender {sender}'s slot {remote_slot}")
        return req

    def touch(self, sender: int, deadline: float) -> None:
        """Read 8 bytes of each of `sender`'s slots into this rank's first slot and wait for them:
        UCX maps the peer's memory at its first read (a CUDA IPC handle opened, a remote key
        unpacked), which otherwise lands in the first sync's first buckets; and a descriptor that
        cannot be read fails the join, named, instead of the first sync. The sender must progress
        meanwhile (it does, waiting for its receivers' joins)."""
        peer = self.peers[sender]
        local = self.buffers[0][:8]
        a = self.agent
        local_descs = a.get_xfer_descs([(local.data_ptr(), 8, self.device_id)], self.memory)
        for i, (addr, _size) in enumerate(peer.slots):
            remote_descs = a.get_xfer_descs([(addr, 8, peer.device_id)], peer.memory)
            req = a.initialize_xfer("READ", local_descs, remote_descs, peer.agent, backends=["UCX"])
            state = "ERR"
            try:
                state = a.transfer(req)
                while state == "PROC" and time.monotonic() < deadline:
                    time.sleep(1e-4)
                    state = a.check_xfer_state(req)
                if state != "DONE":
                    raise RuntimeError(f"a first read of sender {sender}'s slot {i} (agent {peer.agent}) ended {state}")
            finally:
                if state == "PROC":  # still in flight: close waits for it before the slots go
                    self._requests[(sender, i, -1, -1, 8)] = req
                else:
                    a.release_xfer_handle(req)

    def progress(self) -> None:
        """Let this agent's UCX worker serve the reads in flight against its memory."""
        self.agent.get_new_notifs()  # progresses the worker; this transport sends no notifications

    def state(self, req: Any) -> str:
        """'DONE', 'PROC' or 'ERR'."""
        return str(self.agent.check_xfer_state(req))

    def close(self) -> None:
        """Release the requests, forget the peers, deregister the slots (best effort: a broken peer
        may make any of it fail, and the agent goes with its last reference anyway)."""
        a, self.agent = self.agent, None
        if a is None:
            return
        deadline = time.monotonic() + 5.0  # reads left in flight by a failure must not land in freed slots (5 s for all, not each)
        for req in self._requests.values():
            try:
                while a.check_xfer_state(req) == "PROC" and time.monotonic() < deadline:
                    time.sleep(1e-3)
                a.release_xfer_handle(req)
            except Exception as exc:  # a request still in flight after a failure
                logger.debug("nixl: releasing a transfer request: %s", exc)
        self._requests = {}
        for offer in self.peers.values():
            try:
                a.remove_remote_agent(offer.agent)
            except Exception as exc:
                logger.debug("nixl: forgetting agent %s: %s", offer.agent, exc)
        self.peers = {}
        self.slots, self._starts = [], []
        regs, self._regs = self._regs, []
        for reg in regs:
            try:
                a.deregister_memory(reg, backends=["UCX"])
            except Exception as exc:
                logger.debug("nixl: deregistering the slots: %s", exc)
