"""The transfer pipeline: one sender and one receiver over any Transport, and the per-plan state they keep."""
