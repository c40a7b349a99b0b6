"""The two frames a delta sender has in flight at once: bucket k is posted while bucket k + 1 is
diffed, so each takes one of two slots.

A slot is half of the transport's second buffer (the patch), the diff's count and delta sum, a
pinned word the count is read back through and, on a transport ordered by streams, a header row
and pinned staging for the header's host-side words. All of it is allocated once per buffer set:
at 30B a sync posts a frame per ~300 expert tensors, and allocating, pinning and cloning per
frame cost more host time than the bucket's diff kernel. On such a transport a slot's patch and
header are posted from where they were written, and the next diff into the slot waits (on the
device) for that slot's last broadcast instead of the patch being cloned. Host transports (gloo)
read a posted tensor from another thread until their work completes, so there every frame's
header is fresh and its patch a copy.
"""

from __future__ import annotations

from typing import Any

import torch

from ckpt_engine.copies import put_int64s_
from ckpt_engine.delta import accel
from ckpt_engine.delta.direct import BucketDiff
from ckpt_engine.delta.layout import PATCH_HEADER_BYTES
from ckpt_engine.pipeline.delta_bases import FRAME_WORDS, PATCH
from ckpt_engine.transports.transport import Transport

__all__ = ["FrameSlots"]

_PATCH_HEAD_WORDS = PATCH_HEADER_BYTES // 8 - 1
"""A patch header's host-side words (all but its delta sum, which stays on the device)."""


class FrameSlots:
    """Slot memory and ordering for a delta sender's frames (see the module docstring)."""

    def __init__(self, transport: Transport) -> None:
        self.t = transport
        self._for: torch.Tensor | None = None  # the buffer the slots were cut from
        self.regions: list[torch.Tensor] = []
        self._state: torch.Tensor | None = None
        self._counts: torch.Tensor | None = None
        self._headers: torch.Tensor | None = None
        self._staging: torch.Tensor | None = None
        self._staged: list[Any] = [None, None]  # per slot: an event after its staging's last copy
        self._free: list[Any] = [None, None]  # per slot: an event after its last broadcast

    @property
    def in_place(self) -> bool:
        """Whether frames are posted from slot memory (a transport ordered by streams)."""
        return self.t.uses_streams

    def _ensure(self) -> None:
        buf = self.t.buffers[1]
        if self._for is buf:
            return
        half = buf.numel() // 16 * 8
        self.regions = [buf[:half], buf[half : 2 * half]]
        device = buf.device
        self._state = self._counts = self._headers = self._staging = None
        self._staged, self._free = [None, None], [None, None]
        if accel.triton_on(device):
            self._state = torch.zeros((2, 2), dtype=torch.int64, device=device)
            if device.type == "cuda":
                self._counts = torch.empty(2, dtype=torch.int32, pin_memory=True)
        if self.in_place:
            self._headers = torch.zeros((2, FRAME_WORDS), dtype=torch.int64, device=device)
            if device.type == "cuda":
                self._staging = torch.zeros((2, FRAME_WORDS + _PATCH_HEAD_WORDS), dtype=torch.int64, pin_memory=True)
        self._for = buf

    def diff(self, parity: int, nbytes: int, word_bytes: int, scatter_below: float) -> BucketDiff:
        """A BucketDiff into slot `parity % 2`, once the slot's last broadcast has read it."""
        self._ensure()
        p = parity % 2
        if self._free[p] is not None:
            self.t.wait_landed(self._free[p])
            self._free[p] = None
        state = self._state[p] if self._state is not None else None
        count = self._counts[p : p + 1] if self._counts is not None else None
        return BucketDiff(self.regions[p], nbytes, word_bytes, scatter_below, state=state, count_slot=count, staging=self._patch_staging(p))

    def wait_free(self) -> None:
        """Before the second buffer is written whole (the codec's patch): both slots' last
        broadcasts have read it."""
        for p in (0, 1):
            if self._free[p] is not None:
                self.t.wait_landed(self._free[p])
                self._free[p] = None

    def _patch_staging(self, p: int) -> torch.Tensor | None:
        return self._staging[p, FRAME_WORDS:] if self._staging is not None else None

    def staging_free(self, parity: int) -> None:
        """The host may rewrite slot `parity % 2`'s staging: its last copies to the device ran."""
        p = parity % 2
        if self._staged[p] is not None:
            self._staged[p].synchronize()
            self._staged[p] = None

    def header(self, parity: int | None, kind: int, size: int, checksum: torch.Tensor | None, payload: torch.Tensor) -> torch.Tensor:
        """(kind, bytes, checksum, the patch's own 32-byte header) of one bucket, one int64 row
        (FRAME_WORDS) on the transport's device, written without a host sync (which would wait
        for the queued diff kernels): the patch header rides along so that a receiver decodes the
        patch without reading its payload back. `parity` None: a frame outside the slots."""
        if parity is None or self._headers is None:
            header = torch.empty((1, FRAME_WORDS), dtype=torch.int64, device=self.t.device)
            put_int64s_(header[0], [kind, size] + [0] * (FRAME_WORDS - 2))
        else:
            p = parity % 2
            self.staging_free(p)
            header = self._headers[p : p + 1]
            staging = self._staging[p, :FRAME_WORDS] if self._staging is not None else None
            put_int64s_(header[0], [kind, size] + [0] * (FRAME_WORDS - 2), staging)
        if checksum is not None:
            header[0, 2].copy_(checksum.reshape(()))
        if kind == PATCH and payload.numel() >= PATCH_HEADER_BYTES:
            header[0, 3:].copy_(payload[:PATCH_HEADER_BYTES].view(torch.int64))
        return header

    def posted(self, parity: int | None, gid: int) -> None:
        """Slot `parity % 2`'s frame was posted on group `gid`: the slot is written again only after
        that broadcast (and its staging only after the copies queued so far)."""
        if parity is None or not self.in_place:
            return
        p = parity % 2
        self._free[p] = self.t.landed_event(gid)
        if self._staging is not None:
            ev = self.t.new_event()
            ev.record(self.t.current_stream())
            self._staged[p] = ev
