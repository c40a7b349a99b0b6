"""How a sender lets a replayed FP8 walk fill a bucket's send buffer itself (issue 41).

Why: on 2xH200 a Qwen3-30B-A3B FP8 sync was bound by host time per quantized weight: the walk's
two result views a weight, then the pipeline's checks and pack copy of each. A stable source's
walk is the same every sync, and so is the bucket layout, so a grouped launch can write each
weight's codes and scales at their offsets in the bucket's slot; the sender then packs nothing.

The walk is a generator the sender pulls through wrappers it does not know (the session's tap,
`WatchedWeights`), so the offer travels beside it, in a context variable the sender sets for its
walk (a generator runs in its caller's context): before pulling a bucket's first item it puts the
bucket in `Offer.ask`; a walk that filled the bucket yields one item named `FILLED` in place of
the bucket's items. A walk that cannot (another source, a first walk, a changed tensor) ignores
the ask and yields the bucket's items as usual. The wire's bytes are the same either way.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch

from ckpt_engine.manifest import TensorMeta

__all__ = ["FILLED", "OFFER", "Ask", "Offer"]

FILLED = "\x00ckpt-engine: bucket filled in place"
"""The name of the item a walk yields for a bucket it wrote into the send buffer itself (never a
tensor name: the sender takes it for the bucket's entries)."""


@dataclass
class Ask:
    """One bucket the sender is about to send: its index, entries, the views of its slot it would
    pack into (one per entry) and the slot's bytes. `lend`: the sender posts this bucket a message
    per entry (a coalesced group, or its one whole tensor), so an entry whose tensor already has the
    wire layout on the slot's device may travel from its own memory: the fill then puts it in `lent`
    (entry index -> tensor) instead of copying it into the slot (a 7B FP8 bucket's bf16 embedding:
    1.09 GB copied before the first byte moved)."""

    index: int
    entries: Sequence[TensorMeta]
    dsts: Sequence[torch.Tensor]
    slot: torch.Tensor
    lend: bool = False
    lent: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class Offer:
    """A sender's offer for one walk: `key` names the bucket layout (the manifest's digest and the
    sender's rank: fill plans made for one layout are not used for another); `ask` is the bucket
    asked for by the next pull, None between buckets."""

    key: str
    ask: Ask | None = None


OFFER: ContextVar[Offer | None] = ContextVar("ckpt_engine_fp8_direct_offer", default=None)
"""The offer of the sender now pulling the walk (None: no sender offers; the walk yields as usual)."""

