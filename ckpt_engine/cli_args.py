"""Command-line argument checks shared by every `ckpt-engine` subcommand.

Bad input gets one line naming the flag and what it accepts, and exit code 2, never a traceback:
`OneLineParser` prints argparse's errors that way, and the `type=` checkers below say the range.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import NoReturn

__all__ = ["OneLineParser", "above_zero", "at_least", "port_number", "seconds"]


class OneLineParser(argparse.ArgumentParser):
    """argparse, but an error is one line (`<prog>: <what>; see --help`) and exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see --help)\n")


def _checker(kind: type, ok: Callable[[float], bool], accepts: str) -> Callable[[str], int | float]:
    """A `type=` that parses `kind` and refuses a value `ok` rejects, saying what it `accepts`."""

    def check(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {accepts}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {accepts}, got {text!r}")
        return value

    return check


def at_least(low: int | float, kind: type = int) -> Callable[[str], int | float]:
    """A `type=` for ints (or finite floats) >= `low`."""
    return _checker(kind, lambda v: math.isfinite(v) and v >= low, f"{'an int' if kind is int else 'a finite number'} >= {low:g}")


above_zero = _checker(float, lambda v: math.isfinite(v) and v > 0, "a finite number > 0")
"""A `type=` for finite numbers > 0 (sizes)."""
seconds = _checker(float, lambda v: 0 < v <= 604800, "a number of seconds in (0, 604800]")
"""A `type=` for timeouts: finite seconds in (0, one week] (NaN fails the comparison)."""
port_number = _checker(int, lambda v: 0 <= v <= 65535, "an int in [0, 65535] (0 = a free port from the OS)")
"""A `type=` for TCP ports to listen on: 0 (a free port from the OS) to 65535."""

