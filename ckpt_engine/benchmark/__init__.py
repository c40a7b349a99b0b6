"""`ckpt-engine bench`: raw broadcast vs naive per-tensor vs ckpt-engine sync, measured in one run."""
