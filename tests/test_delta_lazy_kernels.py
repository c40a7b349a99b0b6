"""Importing a CPU transport loads no GPU kernels and no compiled CPU loops: Triton and numba are
imported only when a CUDA tensor or a CPU patch is processed (delta/accel.py). Each check runs in
a fresh interpreter, where nothing else imported them first."""

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
def test_importing_a_cpu_transport_imports_no_triton_and_no_numba(module: str) -> None:
    out = _run(f"""
        import sys
        import {module}
        print(sorted(m for m in sys.modules if m.split(".")[0] in ("triton", "numba")))
    """)
    assert out == "[]", f"import {module} loaded {out}"


def test_a_cpu_patch_loads_numba_and_never_triton() -> None:
    """The first CPU patch imports the compiled loops (when numba is installed); Triton stays out."""
    pytest.importorskip("numba")
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
        print("numba" in sys.modules, "triton" in sys.modules)
    """)
    assert out == "True False"


def test_the_numpy_switch_keeps_numba_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """CKPT_ENGINE_NUMBA=0: the CPU path runs on numpy alone (what `bench --delta` compares)."""
    monkeypatch.setenv("CKPT_ENGINE_NUMBA", "0")
    out = _run("""
        import sys
        import torch
        from ckpt_engine.delta import accel, codec
        base = torch.zeros(4096, dtype=torch.uint8)
        new = base.clone()
        new[8] = 1
        out = torch.empty(codec.max_patch_bytes(4096, 2), dtype=torch.uint8)
        n = codec.encode(base, new, 2, out)
        codec.apply(base, codec.decode(out[:n], 4096, 2, check_range=False))
        assert torch.equal(base, new)
        print(accel.numba_on(), "numba" in sys.modules)
    """)
    assert out == "False False"
