"""Importing a CPU transport loads no GPU kernels, and neither does a CPU patch: Triton is imported
only when a CUDA tensor is processed (delta/accel.py); a CPU runs plain torch ops. Each check runs
in a fresh interpreter, where nothing else imported it first."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(code: str) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [_ROOT, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip()


@pytest.mark.parametrize("module", ["ckpt_engine", "ckpt_engine.transports.gloo", "ckpt_engine.delta.codec"])
def test_importing_a_cpu_transport_imports_no_triton(module: str) -> None:
    out = _run(f"""
        import sys
        import {module}
        print(sorted(m for m in sys.modules if m.split(".")[0] == "triton"))
    """)
    assert out == "[]", f"import {module} loaded {out}"


def test_a_cpu_patch_never_loads_triton() -> None:
    """A CPU patch is encoded, decoded and applied with torch ops alone."""
    out = _run("""
        import sys
        import torch
        from ckpt_engine.delta import codec
        base = torch.zeros(4096, dtype=torch.uint8)
        new = base.clone()
        new[8] = 1
        out = torch.empty(codec.max_patch_bytes(4096, 2), dtype=torch.uint8)
        n = codec.encode(base, new, 2, out)
        patch = codec.decode(out[:n], 4096, 2, check_range=False)
        codec.apply(base, patch)
        assert torch.equal(base, new)
        print("triton" in sys.modules)
    """)
    assert out == "False"
