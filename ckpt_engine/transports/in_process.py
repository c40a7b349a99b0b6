"""What a colocated sender hands a receiver that lives in its own process: found by pid and token.

vLLM's engine core inside the trainer's process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, as
hybrid-engine trainers run it) puts both ends of a colocated sync in one process. There the
receiver takes the sender's objects themselves rather than their descriptions:

- its tensors and buffers (CUDA IPC cannot open a handle in the process that made it, "invalid
  device context"; `shared_tensors.describe_tensors`);
- its flag store ("offered", "taken", a bucket ready or released): a torch `HashStore` with the
  same calls and bounds as the rendezvous TCPStore, whose waits release the interpreter lock. One
  thread answers another through it in ~11 us on the 2-core CPU box, against ~140-210 us for a
  TCPStore `wait` and `get` (three round trips to its server thread).
"""

from __future__ import annotations

import os
import secrets
from typing import Any

__all__ = ["find", "forget", "publish"]

_HERE: dict[str, Any] = {}
"""What senders in this process published, by token (one entry per live description)."""


def publish(obj: Any) -> dict[str, Any]:
    """The description by which a receiver in this very process finds `obj` (`find`); `obj` is held
    until `forget`."""
    token = secrets.token_hex(16)
    _HERE[token] = obj
    return {"pid": os.getpid(), "token": token}


def find(desc: Any) -> Any:
    """What `publish` described, when its sender is this process (else None)."""
    if not isinstance(desc, dict) or desc.get("pid") != os.getpid():
        return None
    return _HERE.get(desc.get("token"))  # type: ignore[arg-type]


def forget(desc: Any) -> None:
    """Let go what `publish` holds for `desc` (the sender's next description, or its close)."""
    if isinstance(desc, dict):
        _HERE.pop(desc.get("token"), None)  # type: ignore[arg-type]
