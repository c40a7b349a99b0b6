"""Programs forked from the test session's preloaded fork server (tests/ranks.py) instead of run
as new interpreters: the same `main(argv)` a `python -m` would run, in a real process of its own
that tests kill, stop and restart, without importing torch again (seconds of CPU each on a 2-core
box). Its stdout lines come back over a pipe; its stderr can go to a file."""

from __future__ import annotations

import importlib
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import subprocess
import sys
import time

from ckpt_engine.trainer.ports import free_port  # noqa: F401 - the tests' port for a server they start (never hard-coded)


class ForkedProcess:
    """`subprocess.Popen`'s interface (pid, poll, wait, signals) over a forked process, so handles
    and tests kill, stop and reap it as they would a spawned one."""

    def __init__(self, process: mp.process.BaseProcess) -> None:
        self._process = process
        self.pid = process.pid
        self.args = process.name

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass  # it ended (and its parent, the fork server, reaped it) before its exit code reached us

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _LinesTo:
    """A stdout that sends each line it is given to the parent."""

    def __init__(self, conn: multiprocessing.connection.Connection) -> None:
        self.conn, self.pending = conn, ""

    def write(self, text: str) -> int:
        self.pending += text
        while "\n" in self.pending:
            line, self.pending = self.pending.split("\n", 1)
            try:
                self.conn.send_bytes(line.encode())
            except OSError:  # nobody reads any more
                pass
        return len(text)

    encoding = "utf-8"

    def flush(self) -> None:
        if self.pending:
            self.write("\n")

    def isatty(self) -> bool:
        return False


def _program(target: str, argv: list[str], env: dict[str, str], conn: multiprocessing.connection.Connection, stderr_path: str | None) -> None:
    if stderr_path is not None:
        fd = os.open(stderr_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(fd, 2)
        os.close(fd)
    os.environ.update(env)
    sys.stdout = _LinesTo(conn)  # type: ignore[assignment]
    module, func = target.split(":")
    try:
        code = getattr(importlib.import_module(module), func)(argv)
    finally:
        sys.stdout.flush()
    sys.exit(int(code or 0))


class ForkedProgram:
    """A running program: its process and the lines it printed."""

    def __init__(self, process: ForkedProcess, lines: multiprocessing.connection.Connection) -> None:
        self.process, self._lines = process, lines

    def read_line(self, prefix: str = "", timeout_s: float = 60.0) -> str | None:
        """The next printed line that starts with `prefix` (None if the program ended or took longer)."""
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                if self._lines.poll(min(0.2, max(0.0, deadline - time.monotonic()))):
                    line = self._lines.recv_bytes().decode()
                    if line.startswith(prefix):
                        return line
                elif self.process.poll() is not None:
                    return None
        except EOFError:
            return None
        return None

    def read_all(self, timeout_s: float = 60.0) -> list[str]:
        """Every line the program prints until it ends (killed after `timeout_s`)."""
        deadline, lines = time.monotonic() + timeout_s, []
        try:
            while time.monotonic() < deadline:
                if self._lines.poll(min(0.2, max(0.0, deadline - time.monotonic()))):
                    lines.append(self._lines.recv_bytes().decode())
                elif self.process.poll() is not None:
                    break
        except EOFError:
            pass
        if self.process.poll() is None:
            self.process.kill()
        return lines


def run_program(target: str, argv: list[str], name: str, *, env: dict[str, str] | None = None, timeout_s: float = 60.0) -> tuple[int, str, str]:
    """Run `module:function(argv)` forked to the end: (exit code, stdout, stderr)."""
    import tempfile

    with tempfile.NamedTemporaryFile("r", suffix=".err") as err:
        program = fork_program(target, argv, name, env=env, stderr_path=err.name)
        lines = program.read_all(timeout_s)
        code = program.process.wait(10)
        return code, "".join(line + "\n" for line in lines), err.read()


def fork_program(target: str, argv: list[str], name: str, *, env: dict[str, str] | None = None, stderr_path: str | None = None) -> ForkedProgram:
    """Run `module:function(argv)` in a process forked from the preloaded server; `env` is added
    to its environment (the server's, not this process's: pass what the program needs)."""
    from ranks import forkserver_context

    ctx = forkserver_context()
    recv, send = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_program, args=(target, argv, env or {}, send, stderr_path), name=name, daemon=True)
    process.start()
    send.close()
    return ForkedProgram(ForkedProcess(process), recv)
