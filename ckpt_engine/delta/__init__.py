"""Delta sync: patches that carry only the words that changed since the receiver's version.

The codec lives in `ckpt_engine.delta.codec`; nothing is imported here, so that importing the
transfer core (which needs `delta.request`) does not load the codec's kernels (Triton) at start-up.
"""
