"""Delta codec: a patch holds the words of a byte image that changed and their NEW values.

Pure functions over flat 1-D uint8 images (no transport). Words are compared as integers of
`word_bytes`, never as floats, so NaN payloads and -0.0 round-trip; new values, not additive
deltas, travel, so nothing drifts over a chain of patches. Each patch carries `delta_sum` = sum
over changed i of h(i) * (new_i - old_i) in wrapping int64, so a receiver checks `checksum(base) +
delta_checksum(base, patch)` against the sender's checksum without re-reading the image.
This module is the codec's public surface; the parts live beside it (layout, direct, decoder,
checksums, mixing, kernels).
"""

from __future__ import annotations

from ckpt_engine.delta.checksums import checksum, delta_checksum
from ckpt_engine.delta.decoder import apply, decode
from ckpt_engine.delta.direct import encode, encode_into_base, max_patch_bytes
from ckpt_engine.delta.layout import PATCH_HEADER_BYTES, DecodedPatch, PatchError, word_dtype

__all__ = [
    "PATCH_HEADER_BYTES",
    "DecodedPatch",
    "PatchError",
    "apply",
    "checksum",
    "decode",
    "delta_checksum",
    "encode",
    "encode_into_base",
    "max_patch_bytes",
    "word_dtype",
]
