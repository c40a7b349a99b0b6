"""Descriptors from 1024 on (a trainer sharing thousands of host tensors holds that many) can be
waited on: starting a child that announces itself, and telling a live control connection from one
the peer closed. `select.select` refused them ("filedescriptor out of range in select()")."""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from ckpt_engine.rollout_adapters.torch_ref.rollout import read_ready_line
from ckpt_engine.readable import readable

pytestmark = pytest.mark.fast

HIGH = 1100


@pytest.fixture
def high_fds() -> Iterator[None]:
    """Hold descriptors up to past HIGH, so the next ones opened are numbered above 1023."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < HIGH + 64:
        pytest.skip(f"the hard descriptor limit ({hard}) is below {HIGH + 64}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, HIGH + 64), hard))
    held = []
    try:
        while not held or held[-1] < HIGH:
            held.append(os.open(os.devnull, os.O_RDONLY))
        yield
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_child_announcing_itself_on_a_high_descriptor_is_read(high_fds: None) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "print('noise'); print('READY port=4242', flush=True)"], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.fileno() >= 1024
    try:
        assert read_ready_line(proc, "READY port=", "the child", timeout_s=60) == "4242"
    finally:
        proc.wait(60)


def test_readable_tells_waiting_bytes_and_a_closed_peer_on_high_descriptors(high_fds: None) -> None:
    a, b = socket.socketpair()
    try:
        assert a.fileno() >= 1024
        assert not readable(a)
        b.sendall(b"x")
        assert readable(a, 60)
        assert a.recv(1) == b"x"
        assert not readable(a)
        b.close()
        assert readable(a, 60) and a.recv(1, socket.MSG_PEEK) == b""  # end of file: the peer closed
    finally:
        a.close()
        b.close()
