"""Command-line argument checks shared by every `ckpt-engine` subcommand.

Bad input gets one line naming the flag and what it accepts, and exit code 2, never a traceback:
`OneLineParser` prints argparse's errors that way, and the `type=` checkers below say the range.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from typing import NoReturn

__all__ = ["OneLineParser", "above_zero", "at_least", "fail", "port_number", "seconds"]


class OneLineParser(argparse.ArgumentParser):
    """argparse, but an error is one line (`<prog>: <what>; see --help`) and exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see --help)\n")


def at_least(low: int | float, kind: type = int) -> Callable[[str], int | float]:
    """A `type=` for ints (or floats) >= `low`."""

    def check(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {'an int' if kind is int else 'a number'} >= {low:g}, got {text!r}") from None
        if kind is float and not math.isfinite(value) or value < low:
            raise argparse.ArgumentTypeError(f"must be {'an int' if kind is int else 'a finite number'} >= {low:g}, got {text!r}")
        return value

    return check


def above_zero(text: str) -> float:
    """A `type=` for finite numbers > 0 (sizes)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def seconds(text: str) -> float:
    """A `type=` for timeouts: finite seconds in (0, one week]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds in (0, 604800], got {text!r}") from None
    if not math.isfinite(value) or not 0 < value <= 604800:
        raise argparse.ArgumentTypeError(f"must be a number of seconds in (0, 604800], got {text!r}")
    return value


def port_number(text: str) -> int:
    """A `type=` for TCP ports to listen on: 0 (a free port from the OS) to 65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an int in [0, 65535] (0 = a free port from the OS), got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be an int in [0, 65535] (0 = a free port from the OS), got {text!r}")
    return value


def fail(prog: str, message: object) -> NoReturn:
    """One line on stderr, exit code 2."""
    print(f"{prog}: {message}", file=sys.stderr)
    raise SystemExit(2)
