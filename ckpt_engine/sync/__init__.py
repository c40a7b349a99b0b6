"""One sync end to end: the session (validate, pause, stream, finalize, resume), many senders,
the report, claims on engines, and `sync_rollout_weights()` (`api.py`)."""
