"""Block-FP8 on the wire: the quantize kernel, the checkpoint layout it produces, and the checks
an engine runs on a manifest against the layout it holds (docs/fp8.md)."""

from ckpt_engine.fp8.layout import BLOCK, FP8_DTYPE, SCALE_DTYPE, SCALE_SUFFIX, fp8_specs, quantizes, scale_name, scale_shape
from ckpt_engine.fp8.quantize import quantize_block_fp8

__all__ = ["BLOCK", "FP8_DTYPE", "SCALE_DTYPE", "SCALE_SUFFIX", "fp8_specs", "quantize_block_fp8", "quantizes", "scale_name", "scale_shape"]
