"""Running a kernel test's cases in a fresh Python process, compiled on a GPU or in Triton's CPU
interpreter (`TRITON_INTERPRET` is read when Triton is imported, so it cannot be set in-process)."""

from __future__ import annotations

import os
import subprocess
import sys


def run_cases(code: str, interpret: bool, timeout_s: float = 600) -> None:
    """Run `code` (which prints a last line ending in "ok") and fail with its output otherwise."""
    env = dict(os.environ, TRITON_INTERPRET="1" if interpret else "0")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-2000:] + proc.stderr[-4000:]
