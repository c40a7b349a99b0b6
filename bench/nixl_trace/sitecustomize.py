"""Per-bucket timeline of the nixl transport in every process of a bench (docs/nixl.md, "Where a
sync's time goes"): with this folder on PYTHONPATH and CKPT_NIXL_TRACE_DIR set, each process writes
the transport's DEBUG trace lines to DIR/trace-<pid>.log; `python bench/nixl_trace/merge.py DIR`
merges them by time."""

import logging
import os

_DIR = os.environ.get("CKPT_NIXL_TRACE_DIR")
if _DIR:
    os.makedirs(_DIR, exist_ok=True)
    _log = logging.getLogger("ckpt_engine.transports.nixl")
    _handler = logging.FileHandler(os.path.join(_DIR, f"trace-{os.getpid()}.log"))
    _handler.setFormatter(logging.Formatter("%(message)s"))
    _log.addHandler(_handler)
    _log.setLevel(logging.DEBUG)
    _log.propagate = False
