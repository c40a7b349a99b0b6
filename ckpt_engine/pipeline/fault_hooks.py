"""Where fault tests reach into a sender: the engine declares the hooks (no-ops), tests override them."""

from __future__ import annotations

from typing import Protocol

import torch

__all__ = ["FaultHooks"]


class FaultHooks(Protocol):
    def _tamper_hook(self, bucket_index: int, message: torch.Tensor) -> None:
        """Called after a bucket is packed (or encoded), before it is sent."""

    def _tamper_size_hook(self, bucket_index: int, kind: int, size: int) -> int:
        """The payload size a delta frame header announces (`size` unless a test lies)."""

    def _tamper_header_hook(self, bucket_index: int, header: torch.Tensor) -> None:
        """Called on a delta frame's header (sealed) before it is sent; a test corrupts it here."""
