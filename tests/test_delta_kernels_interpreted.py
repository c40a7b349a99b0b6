"""The codec's two-pass Triton encode (kernels.compare_pack + kernels.compact, encoder._encode_triton)
run by Triton's CPU interpreter: its patches equal the numpy path's byte for byte and its base
update is exact, for every word size, sparse to full changes, partial last blocks and several
2**16-word groups of h. On a GPU, tests/test_gpu_delta_codec.py runs the same kernels compiled."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

_INTERPRETED = textwrap.dedent(
    """
    import torch
    from ckpt_engine.delta import codec, encoder, kernels

    g = torch.Generator().manual_seed(5)
    n = 2 * 65536 + 4099  # three groups of h, a partial last block, a partial last mask byte
    cases = 0
    # (block words, delta sum in compact, set bits each row peels per compact round): the knobs
    # bench/delta_codec_bench.py sweeps; large blocks keep the interpreter's cost low
    settings = [(8192, True, 2), (32768, False, 1), (2048, True, 1), (16384, True, 2), (8192, False, 2)]
    for wb in (1, 2, 4, 8):
        dt = codec.word_dtype(wb)
        for k, frac in enumerate((0.0, 0.003, 0.02, 0.13, 0.6, 1.0)):
            block, late, walk = settings[(k + wb) % len(settings)]
            kernels.BLOCK_WORDS, kernels.DELTA_IN_COMPACT, kernels.WALK_BITS = block, late, walk
            size = n if block > 2048 else 65536 + 999
            base = torch.randint(0, 256, (size * wb,), dtype=torch.uint8, generator=g)
            new = base.clone()
            changed = torch.rand(size, generator=g) < frac
            new.view(dt)[changed] ^= torch.randint(1, 127, (int(changed.sum()),), generator=g).to(dt)
            for kind in (None, "bitmask" if frac < 0.03 else "positions32"):  # None picks the other
                want_out = torch.empty(size * wb, dtype=torch.uint8)
                m = codec.encode(base, new, wb, want_out, kind=kind, impl="host")
                want = None if m is None else bytes(want_out[:m].numpy())
                out = torch.full((size * wb,), 0xAB, dtype=torch.uint8)
                kept = base.clone()
                got_n = encoder._encode_triton(kept.view(dt), new.view(dt), wb, out, kind, kind is None)
                got = None if got_n is None else bytes(out[:got_n].numpy())
                assert got == want, (wb, frac, block, late, walk, kind, got_n, m)
                if kind is None and got_n is not None:  # encode_into_base: the base is now `new`
                    assert torch.equal(kept, new), (wb, frac, block)
                cases += 1
    print("interpreted ok", cases)
    """
)


def test_the_two_pass_triton_encode_run_by_the_interpreter_matches_the_host_bytes() -> None:
    """Sorted positions, the LSB-first bitmask written as int32 row masks, the values, and the
    delta sum whichever pass computes it: all equal to the numpy encoder's patch."""
    pytest.importorskip("triton")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", _INTERPRETED], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "interpreted ok 48" in proc.stdout, proc.stderr[-3000:]
