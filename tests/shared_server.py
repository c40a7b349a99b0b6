"""One engine that several test modules use in turn, instead of one start each (30-60 s of a 2-core
box per vLLM start): started at its first use, started again when a test left it dead (a killed
worker), stopped at the end of the session. Tests that share one take whatever version and weights
the last user left and seed their own (see tests/conftest.py for the engines shared this way)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from typing import Generic, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")


class SharedServer(Generic[T]):
    """`start()` enters a context manager that runs the engine and gives its handle; `alive(handle)`
    says (within its own timeout) whether the engine still serves."""

    def __init__(self, name: str, start: Callable[[], AbstractContextManager[T]], alive: Callable[[T], bool]) -> None:
        self.name = name
        self._start, self._alive = start, alive
        self._stack: ExitStack | None = None
        self._handle: T | None = None
        self.starts = 0

    def get(self) -> T:
        """The running engine's handle; a dead one is stopped and started again."""
        if self._handle is not None and self._alive(self._handle):
            return self._handle
        if self._handle is not None:
            logger.warning("shared engine %s no longer answers: starting it again", self.name)
        self.close()
        stack = ExitStack()
        try:
            self._handle = stack.enter_context(self._start())
        except BaseException:
            stack.close()
            raise
        self._stack = stack
        self.starts += 1
        return self._handle

    def discard(self) -> None:
        """Stop it now: a test changed it in a way the next user must not inherit (a replaced
        loader); the next `get()` starts a fresh one."""
        self.close()

    def close(self) -> None:
        stack, self._stack, self._handle = self._stack, None, None
        if stack is not None:
            stack.close()
