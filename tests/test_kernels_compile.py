"""Every Triton kernel of the delta path compiles for an H100/H200 (sm_90) on this CPU machine.

Triton's CPU interpreter runs the kernels' logic (tests/test_delta_*_interpreted)
but not the compiler's type checks: a kernel the interpreter runs can still fail to compile on the
GPU (two returns of different types did, once). Compiling for a GPU target needs no GPU.
"""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from ckpt_engine.delta import direct_kernels, kernels  # noqa: E402

_TARGET = GPUTarget("cuda", 90, 32)
_DIFF = {"ROWS": kernels.DIFF_ROWS, "GROUP": 65536, "GROUP_BITS": 16}


def _compile(fn, signature: dict[str, str], constexprs: dict[str, object]) -> None:
    try:
        triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=_TARGET)
    except Exception as exc:  # a missing toolchain is not the kernel's fault
        if "ptxas" in str(exc) or isinstance(exc, (FileNotFoundError, RuntimeError)) and "not found" in str(exc):
            pytest.skip(f"no CUDA toolchain for Triton here: {exc}")
        raise


def _table_sig(words: dict[str, str]) -> dict[str, str]:
    return {"table_ptr": "*i64", "tile_piece_ptr": "*i32", **words, "counter_ptr": "*i32", "delta_ptr": "*i64", "pos_ptr": "*i32",
            "val_ptr": "*i16", "cap": "i32", "ROWS": "constexpr", "ALIGN": "constexpr", "GROUP": "constexpr", "GROUP_BITS": "constexpr"}


@pytest.mark.parametrize("align", [1, 8])
def test_the_one_launch_diff_compiles(align: int) -> None:
    _compile(direct_kernels._diff_pieces_kernel, _table_sig({"base_ptr": "*i16"}), {**_DIFF, "ALIGN": align})


@pytest.mark.parametrize("word", ["i8", "i16", "i32", "i64"])
def test_the_per_piece_diff_compiles(word: str) -> None:
    sig = {"new_ptr": f"*{word}", "base_ptr": f"*{word}", "n_words": "i64", "first": "i64", "counter_ptr": "*i32", "delta_ptr": "*i64",
           "pos_ptr": "*i32", "val_ptr": f"*{word}", "cap": "i32", "ROWS": "constexpr", "GROUP": "constexpr", "GROUP_BITS": "constexpr"}
    _compile(kernels._diff_sparse_kernel, sig, _DIFF)


@pytest.mark.parametrize("positions", ["*i32", "*i64"])
def test_the_in_place_apply_kernels_compile(positions: str) -> None:
    from ckpt_engine.delta import scatter_kernels as sk

    regions = {"pos_ptr": positions, "n": "i32", "starts_ptr": "*i64", "ends_ptr": "*i64", "rel_ptr": "*i64", "n_regions": "i32", "steps": "i32",
               "base_ptr": "*i16", "vals_ptr": "*i16"}
    _compile(sk._swap_read_kernel, {**regions, "old_ptr": "*i16", "bad_ptr": "*i32", "part_ptr": "*i64", "BLOCK": "constexpr",
                                        "GROUP": "constexpr", "GROUP_BITS": "constexpr"},
             {"BLOCK": sk.BLOCK, "GROUP": 65536, "GROUP_BITS": 16})
    for write in (True, False):
        _compile(sk._pieces_kernel, {**regions, "bad_ptr": "*i32", "BLOCK": "constexpr", "WRITE": "constexpr"}, {"BLOCK": sk.BLOCK, "WRITE": write})
