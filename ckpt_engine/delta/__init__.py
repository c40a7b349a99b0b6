"""Delta sync: patches that carry only the words that changed since the receiver's version.

The codec's public surface is `ckpt_engine.delta.codec`; nothing is imported here. The compiled
kernels (Triton on CUDA) load only when a patch is first processed there (accel.py); every other
device runs plain torch ops.
"""
