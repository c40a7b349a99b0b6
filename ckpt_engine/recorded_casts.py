"""Hands a sender's cast recorder to a weight source that records its own casts (`delta_base: cast`).

A trainer that keeps fp32 masters and sends bf16 weights can write those weights through the
engine's cast recorder, so a delta sync sends the patches its optimizer step recorded and keeps
no base copy. Through `sync_rollout_weights()` the trainer never holds the engine, so before each
delta sync every sending rank offers its own engine's recorder to its own source, through the
source's optional hook

    record_casts(recorder_of: Callable[[], CastRecorder], *, pieces: bool) -> bool

`pieces`: this sync walks the source's `local_piece`s (many senders), else its `iter_weights()`.
The source binds, through `recorder_of()` (made on first call, one per plan), the (fp32 master,
bf16 weight) pairs of exactly the tensors that walk yields, calls `cast_()` after each optimizer
step, and returns True; or returns False, and its syncs go dense. The FSDP2 adapter binds its
pieces (`trainer_adapters/cast_shadows.py`); a custom single-sender source whose `iter_weights()`
yields its own bf16 weights (`stable_tensors`) binds those. A source without the hook, or an
engine that keeps its bases elsewhere, is left alone.
"""

from __future__ import annotations

import logging
from typing import Any

from ckpt_engine.manifest import BucketManifest

__all__ = ["offer_cast_recorder"]

logger = logging.getLogger(__name__)

_warned: set[str] = set()


def offer_cast_recorder(engine: Any, manifest: BucketManifest, source: Any, *, walks_pieces: bool) -> bool:
    """Before a delta sync's walk: offer `source` this engine's recorder of `manifest` when the
    engine records casts (`delta_base='cast'`); returns whether the source bound it. Binding
    errors (a master that cannot be recorded) propagate: the sync fails by name before anything
    is sent."""
    if getattr(engine, "delta_base", None) != "cast" or not getattr(engine, "is_sender", False):
        return False
    hook = getattr(source, "record_casts", None)
    if callable(hook) and hook(lambda: engine.cast_recorder(manifest), pieces=walks_pieces):
        return True
    if not callable(hook):
        why = "it has no record_casts hook"
    elif walks_pieces:
        why = "it declined the recorder for its pieces"
    else:
        why = "it declined the recorder for a walk of iter_weights() (a sharded trainer records its pieces: senders all)"
    key = f"{type(source).__name__}: {why}"
    if key not in _warned:
        _warned.add(key)
        logger.warning("delta_base='cast' with %s: %s, so every sync from it is dense (or use delta_base='device')", type(source).__name__, why)
    return False
