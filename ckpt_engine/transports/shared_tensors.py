"""A sender's own tensors, mapped by a receiver on the same device so it copies straight out of them.

On CUDA each tensor travels as the fields of `torch.multiprocessing.reductions.reduce_tensor`
(IPC handles, sizes, strides, offsets), encoded by name for msgpack and rebuilt with
`rebuild_cuda_tensor`, as vLLM's IPC weight transfer does. On the host only a tensor whose storage
already lives in shared memory can be mapped (the receiver opens the sender's file descriptor
through /proc), so nothing is copied or moved on the sender. Never pickle.

CUDA IPC cannot open a handle in the process that made it ("invalid device context"): a receiver
in the sender's own process (vLLM's engine core inside the trainer's process with
`VLLM_ENABLE_V1_MULTIPROCESSING=0`, as hybrid-engine trainers run it) takes the sender's tensors
themselves, found by the token the description carries (`in_process.py`).
"""

from __future__ import annotations

import operator
import os
from collections.abc import Sequence
from typing import Any

import torch

from ckpt_engine.transports import in_process

__all__ = [
    "Placement", "can_share", "describe_tensors", "map_tensors", "placement", "probe_host_sharing",
]

_CUDA_FIELDS = ("size", "stride", "offset", "dtype", "handle", "storage_bytes", "storage_offset", "ref_handle", "ref_offset", "event", "event_sync")
_HOST_FIELDS = ("size", "stride", "offset", "dtype", "fd", "storage_bytes")


Placement = tuple[list[int], list[torch.Size], list[tuple[int, ...]], list[torch.dtype]]
"""Where and as a list of tensors lies: data pointers, shapes, strides, dtypes (`placement`)."""

_SHAPE = operator.attrgetter("shape")
_DTYPE = operator.attrgetter("dtype")


def placement(tensors: Sequence[torch.Tensor]) -> Placement:
    """Each tensor's data pointer, shape, strides and dtype, read in four C-level passes: a sender
    compares a walk with its last one this way (Qwen3-30B-A3B's 9,435 tensors one by one in Python
    cost more host time than copying their bytes on one H200). Two layouts compare with `==`."""
    with torch._C.DisableTorchFunctionSubclass():  # a parameter subclass would answer each read in Python
        return (list(map(torch.Tensor.data_ptr, tensors)), list(map(_SHAPE, tensors)), list(map(torch.Tensor.stride, tensors)),
                list(map(_DTYPE, tensors)))


def can_share(t: torch.Tensor, device: torch.device) -> bool:
    """Whether a receiver on `device` can map `t` where it lies (no copy, no move on the sender)."""
    if t.device != device or t.numel() == 0:
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and t.untyped_storage().is_shared()


def _dtype(name: Any) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"shared tensor descriptor names no torch dtype: {name!r}")
    return dtype


def describe_tensors(tensors: Sequence[torch.Tensor], device: torch.device) -> dict[str, Any]:
    """The msgpack-able description of `tensors` (each `can_share` on `device`) that `map_tensors`
    turns back into tensors over the same memory in another process."""
    if device.type == "cuda":
        from torch.multiprocessing.reductions import reduce_tensor

        out = []
        for t in tensors:
            _, args = reduce_tensor(t.detach())
            (_cls, size, stride, offset, _storage_cls, dtype, _dev, handle, storage_bytes, storage_offset, _grad,
             ref_handle, ref_offset, event, event_sync) = args
            out.append(dict(zip(_CUDA_FIELDS, (
                list(size), list(stride), int(offset), str(dtype).removeprefix("torch."), bytes(handle), int(storage_bytes),
                int(storage_offset), bytes(ref_handle), int(ref_offset), bytes(event) if event is not None else None, bool(event_sync),
            ))))
        return {"kind": "cuda", "uuid": str(torch.cuda.get_device_properties(device).uuid), "tensors": out, "local": in_process.publish(list(tensors))}
    if device.type != "cpu":
        raise ValueError(f"tensors on {device} cannot be shared with another process (cpu or cuda only)")
    out = []
    for t in tensors:
        fd, nbytes = t.untyped_storage()._share_fd_cpu_()  # already shared: its own descriptor, nothing moves
        fields: tuple[Any, ...] = (list(t.shape), list(t.stride()), t.storage_offset(), str(t.dtype).removeprefix("torch."), int(fd), int(nbytes))
        out.append(dict(zip(_HOST_FIELDS, fields)))
    return {"kind": "cpu", "pid": os.getpid(), "tensors": out}


def _check(desc: Any, fields: tuple[str, ...]) -> None:
    if not isinstance(desc, dict) or set(desc) != set(fields):
        raise ValueError(f"malformed shared tensor descriptor (fields {sorted(fields)} expected): {desc!r:.200}")


def map_tensors(info: Any, device: torch.device) -> list[torch.Tensor]:
    """The receiver's tensors over the sender's memory, in the order described (nothing copied)."""
    if not isinstance(info, dict) or not isinstance(info.get("tensors"), list):
        raise ValueError(f"malformed shared tensors message: {info!r:.200}")
    kind = info.get("kind")
    if kind == "cuda":
        if device.type != "cuda":
            raise ValueError(f"the sender shares CUDA tensors; this receiver is on {device}")
        here = str(torch.cuda.get_device_properties(device).uuid)
        if info.get("uuid") != here:
            raise ValueError(f"the sender's tensors are on GPU {info.get('uuid')}, this receiver is on GPU {here}: not colocated")
        local = in_process.find(info.get("local"))
        if local is not None:
            return list(local)
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        out = []
        for d in info["tensors"]:
            _check(d, _CUDA_FIELDS)
            out.append(rebuild_cuda_tensor(
                torch.Tensor, tuple(d["size"]), tuple(d["stride"]), d["offset"], torch.storage.TypedStorage, _dtype(d["dtype"]),
                device.index, d["handle"], d["storage_bytes"], d["storage_offset"], False, d["ref_handle"], d["ref_offset"],
                d["event"], d["event_sync"],
            ))
        return out
    if kind != "cpu":
        raise ValueError(f"unknown shared tensors kind {kind!r}")
    if device.type != "cpu":
        raise ValueError(f"the sender shares host tensors; this receiver is on {device}")
    pid = info.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        raise ValueError(f"malformed shared tensors message (pid): {pid!r}")
    storages: dict[int, Any] = {}  # torch.UntypedStorage.from_file's
    out = []
    for d in info["tensors"]:
        _check(d, _HOST_FIELDS)
        fd = d["fd"]
        if not isinstance(fd, int) or isinstance(fd, bool) or fd < 0:
            raise ValueError(f"malformed shared tensor descriptor (fd): {fd!r}")
        if fd not in storages:
            storages[fd] = torch.UntypedStorage.from_file(f"/proc/{pid}/fd/{fd}", shared=True, nbytes=d["storage_bytes"])
        out.append(torch.empty(0, dtype=_dtype(d["dtype"])).set_(storages[fd], d["offset"], tuple(d["size"]), tuple(d["stride"])))
    return out


def probe_host_sharing() -> tuple[torch.Tensor, dict[str, Any]]:
    """A small shared host tensor and its description: a receiver that maps it proves it can map
    the sender's shared tensors (same host, same process namespace)."""
    t = torch.zeros(8, dtype=torch.uint8).share_memory_()
    return t, describe_tensors([t], torch.device("cpu"))
