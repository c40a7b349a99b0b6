"""`ruff check ckpt_engine` passes under the rules in pyproject.toml ([tool.ruff]): unused and
undefined names, syntax and whitespace errors (the fast tier runs it)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ruff() -> list[str] | None:
    """The ruff beside this interpreter (the venv's, from the `test` extra), else one on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "ruff")
    if os.path.exists(here):
        return [here]
    found = shutil.which("ruff")
    return [found] if found else None


def test_ruff_passes_on_the_library() -> None:
    ruff = _ruff()
    if ruff is None:
        pytest.skip("ruff is not installed (it comes with the `test` extra: pip install -e '.[test]')")
    proc = subprocess.run([*ruff, "check", "--no-cache", "--output-format", "concise", "ckpt_engine"], cwd=_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"ruff check ckpt_engine:\n{proc.stdout[-6000:]}{proc.stderr[-2000:]}"
