"""Rotating buffers that another process on the same device maps, and how a rank names its device.

A sender that shares its device with a receiver allocates its buffers here (CUDA IPC on GPU, a
file-backed mapping under /dev/shm on CPU) and publishes their descriptors (msgpack-able dicts);
`device_identity` is what two ranks compare to learn that they share a device.
"""

from __future__ import annotations

import os
import socket
import tempfile
from typing import Any

import torch

__all__ = ["device_identity", "map_buffers", "share_buffers", "unlink_files", "validate_descriptors"]


def device_identity(device: torch.device) -> str:
    """Host name plus the device's UUID on CUDA (stable across CUDA_VISIBLE_DEVICES orderings), or
    plus "cpu" for host memory, which every process of a host can share."""
    host = socket.gethostname()
    if device.type == "cuda":
        return f"{host}/cuda/{torch.cuda.get_device_properties(device).uuid}"
    if device.type == "cpu":
        return f"{host}/cpu"
    return f"{host}/{device}/{os.getpid()}"  # a device we cannot share: unique per process


def share_buffers(device: torch.device, count: int, size: int) -> tuple[list[torch.Tensor], list[dict[str, Any]], list[str]]:
    """`count` uint8 buffers of `size` bytes that a receiver may map: (buffers, descriptors, shm
    files the caller unlinks when it leaves, if the receiver has not done so on mapping them)."""
    buffers: list[torch.Tensor] = []
    descs: list[dict[str, Any]] = []
    paths: list[str] = []
    for _ in range(count):
        if device.type == "cpu":
            fd, path = tempfile.mkstemp(prefix="ckpt-engine-handoff-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
            os.close(fd)
            paths.append(path)
            buffers.append(torch.from_file(path, shared=True, size=size, dtype=torch.uint8))
            descs.append({"path": path})
        elif device.type == "cuda":
            buf = torch.empty(size, dtype=torch.uint8, device=device)
            buffers.append(buf)
            descs.append({"cuda_ipc": list(buf.untyped_storage()._share_cuda_()), "uuid": str(torch.cuda.get_device_properties(device).uuid)})
        else:
            raise ValueError(f"buffers on {device} cannot be shared with another process (cpu or cuda only)")
    return buffers, descs, paths


def validate_descriptors(info: Any, count: int, size: int, whose: str) -> list[dict[str, Any]]:
    """The decoded descriptor message, checked: `count` buffers of `size` bytes each."""
    if not isinstance(info, dict) or info.get("size") != size or not isinstance(info.get("buffers"), list):
        raise ValueError(f"{whose} publishes shared buffers of another size than this rank's ({size} bytes): {info!r:.200}")
    descs = info["buffers"]
    if len(descs) != count or not all(isinstance(d, dict) and set(d) in ({"path"}, {"cuda_ipc", "uuid"}) for d in descs):
        raise ValueError(f"{whose} publishes {len(descs)} shared buffers; this rank expects {count} (same num_buffers on every rank)")
    return descs


def map_buffers(device: torch.device, descs: list[dict[str, Any]], size: int) -> list[torch.Tensor]:
    """The receiver's views of a sender's shared buffers (the same memory, nothing copied). Host
    buffers' files are unlinked once mapped; the memory lives until both sides drop it."""
    out = []
    for desc in descs:
        if "path" in desc:
            if device.type != "cpu" or not isinstance(desc["path"], str):
                raise ValueError(
                    f"the colocated sender's buffers are in host memory but this receiver is on {device}: both sides must "
                    f"be on one device (the sender takes its weight source's device, or engine_kwargs.colocated.device)"
                )
            if not os.path.isfile(desc["path"]):  # from_file would create an empty file instead
                raise ValueError(f"shared buffer {desc['path']!r} is not on this host: is the sender really local?")
            out.append(torch.from_file(desc["path"], shared=True, size=size, dtype=torch.uint8))
            os.unlink(desc["path"])  # both sides hold the mapping now: a crash leaves nothing in /dev/shm
        else:
            if device.type != "cuda":
                raise ValueError(
                    f"the colocated sender's buffers are on a CUDA device but this receiver is on {device}: both sides "
                    f"must be on one device"
                )
            torch.cuda.init()  # opening an IPC handle needs this process's CUDA context
            torch.cuda.set_device(device)
            here = str(torch.cuda.get_device_properties(device).uuid)
            if desc["uuid"] != here:
                raise ValueError(f"the colocated sender's buffers are on GPU {desc['uuid']}, this receiver is on GPU {here} ({device}): not one GPU")
            # The handle names the sender's device index; this process may see that GPU under another
            # (a `vllm serve` started with CUDA_VISIBLE_DEVICES=1 sees the trainer's cuda:1 as cuda:0).
            index = device.index if device.index is not None else torch.cuda.current_device()
            storage = torch.UntypedStorage._new_shared_cuda(index, *desc["cuda_ipc"][1:])
            out.append(torch.empty(0, dtype=torch.uint8, device=device).set_(storage))
    return out


def unlink_files(paths: list[str]) -> None:
    """Remove the shm files `share_buffers` made (those a receiver has not unlinked already)."""
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    paths.clear()
