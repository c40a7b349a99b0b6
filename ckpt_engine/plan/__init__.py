"""Sync-time planner (`ckpt-engine plan`): predict one sync's stages on clusters we cannot rent.

Pure Python (no torch): model bytes from an HF config, cluster layouts and links, a pipelined
cost model calibrated on our own bench files, validated against them and against published runs.
"""
