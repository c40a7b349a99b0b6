"""`ruff check ckpt_engine` passes under the rules in pyproject.toml ([tool.ruff]): unused and
undefined names, syntax and whitespace errors; `mypy` passes on the whole package ([tool.mypy]
`files`). The fast tier runs
both (mypy's first run in a fresh clone reads torch's stubs, ~30 s; later runs use .mypy_cache)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tool(name: str) -> list[str]:
    """The tool beside this interpreter (the venv's, from the `test` extra), else one on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), name)
    found = here if os.path.exists(here) else shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed (it comes with the `test` extra: pip install -e '.[test]')")
    return [found]


def test_ruff_passes_on_the_library() -> None:
    proc = subprocess.run([*_tool("ruff"), "check", "--no-cache", "--output-format", "concise", "ckpt_engine"], cwd=_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"ruff check ckpt_engine:\n{proc.stdout[-6000:]}{proc.stderr[-2000:]}"


def test_mypy_passes_on_the_package() -> None:
    proc = subprocess.run([*_tool("mypy")], cwd=_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"mypy (files from pyproject.toml's [tool.mypy]):\n{proc.stdout[-6000:]}{proc.stderr[-2000:]}"
