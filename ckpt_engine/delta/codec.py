"""Delta codec: a patch holds the words of a byte image that changed and their NEW values.

Pure functions over flat 1-D uint8 images (no transport, no process groups). Words are compared
as integers of `word_bytes`, never as floats, so NaN payloads and -0.0 round-trip. New values, not
additive deltas, travel, so nothing drifts over a chain of patches. Each patch carries
`delta_sum` = sum over changed i of h(i) * (new_i - old_i) in wrapping int64, where
`checksum(x) = sum_i x_i * h(i)`: a receiver checks `checksum(base) + delta_checksum(base, patch)`
against the sender's checksum of the new image without re-reading the whole image.

This module is the codec's public surface; the parts live beside it: the patch format
(layout.py), the one diff (direct.py), decode and apply (decoder.py), the checksums (checksums.py),
h(i) (mixing.py), and the CUDA kernels (kernels.py; plain torch ops on every other device).
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
