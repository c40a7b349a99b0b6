"""Delta sync: patches that carry only the words that changed since the receiver's version."""

from ckpt_engine.delta.codec import (
    PATCH_HEADER_BYTES,
    DecodedPatch,
    PatchError,
    apply,
    checksum,
    decode,
    delta_checksum,
    encode,
    encode_into_base,
    max_patch_bytes,
    word_dtype,
)

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
