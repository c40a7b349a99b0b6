"""Hands a sender's cast recorder to a weight source that records its own casts (`delta_base: cast`).

A trainer adapter that keeps fp32 masters and sends bf16 pieces can write those pieces through
the engine's cast recorder (`record_casts(recorder)`, e.g. the FSDP2 adapter), so a delta sync
sends the patches its optimizer step recorded and keeps no base copy. Every sending rank offers
its own engine's recorder to its own source before it walks its pieces; a source without the hook,
or an engine that keeps its bases elsewhere, is left alone (its syncs diff or go dense as before).
"""

from __future__ import annotations

import logging
from typing import Any

from ckpt_engine.manifest import BucketManifest

__all__ = ["offer_cast_recorder"]

logger = logging.getLogger(__name__)

_warned: set[str] = set()


def offer_cast_recorder(engine: Any, manifest: BucketManifest, source: Any, *, walks_pieces: bool) -> bool:
    """Before a delta sync's walk: give `source` this engine's recorder of `manifest` when the
    engine records casts (`delta_base='cast'`) and the source can write through one; returns
    whether it did. `walks_pieces`: the sync sends the source's own pieces (many senders); a
    gathered `iter_weights()` is not what a trainer rank casts. Binding errors (a master that
    cannot be recorded) propagate: the sync fails by name before anything is sent."""
    if getattr(engine, "delta_base", None) != "cast" or not getattr(engine, "is_sender", False):
        return False
    hook = getattr(source, "record_casts", None)
    if not callable(hook) or not walks_pieces:
        why = "it does not write its weights through the engine's cast recorder" if not callable(hook) else (
            "this sync gathers whole tensors on one rank; recording needs every rank to send its own pieces (senders: all)"
        )
        key = f"{type(source).__name__}: {why}"
        if key not in _warned:
            _warned.add(key)
            logger.warning(
                "delta_base='cast' with %s: %s, so every sync from it is dense (a custom trainer binds "
                "engine.cast_recorder(manifest) itself; otherwise use delta_base='device')", type(source).__name__, why,
            )
        return False
    hook(engine.cast_recorder(manifest))
    return True
