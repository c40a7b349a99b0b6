"""An engine's check of a manifest against the block-FP8 layout it holds, before anything pauses.

Why its own check: a generic name/shape/dtype mismatch ("shape [28, 28] but the engine holds
[56, 56]") does not tell a user that the sender quantized in 64 x 64 blocks, sent scales
transposed, left a scale tensor out, or sent bf16 into an FP8 engine, nor which key fixes it. Each
problem here names the tensor, what disagrees and the setting to change; the names it reports are
not checked again generically.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ckpt_engine.fp8.layout import BLOCK, FLOAT_WIRE, FP8_NAME, SCALE_NAME, scale_name, weight_of
from ckpt_engine.manifest import TensorSpec

__all__ = ["fp8_problems"]

_SET_FP8 = "set checkpoint_engine.wire_dtype=fp8 (the sender then quantizes every linear weight into this layout)"
_UNSET_FP8 = (
    "unset checkpoint_engine.wire_dtype (this engine holds the weight in high precision: it takes bf16, and an engine "
    "that quantizes on load does so itself)"
)


def _block(size: int, blocks: int) -> int:
    """The block edge that cuts `size` into `blocks` (the smallest power of two that does, else the ceiling)."""
    if blocks <= 0:
        return 0
    least = -(-size // blocks)
    b = 1
    while b < least:
        b *= 2
    return b if -(-size // b) == blocks else least


def _blocks_of(weight: Sequence[int], scales: Sequence[int]) -> str:
    return f"{_block(weight[-2], scales[-2])} x {_block(weight[-1], scales[-1])}"


def fp8_problems(specs: Sequence[TensorSpec], expected: Mapping[str, TensorSpec]) -> tuple[list[str], set[str]]:
    """Problems with loading `specs` (a manifest's) into an engine holding `expected`, as far as the
    block-FP8 layout goes, and the names they cover ([] and set(): nothing FP8 disagrees)."""
    sent = {s.name: s for s in specs}
    problems: list[str] = []
    covered: set[str] = set()
    hinted: set[str] = set()

    def say(names: Sequence[str], text: str, fix: str) -> None:
        covered.update(names)
        problems.append(f"{text}; {'the same fix as above' if fix in hinted else fix}")
        hinted.add(fix)

    for name, want in expected.items():  # the engine's FP8 weights
        if want.dtype != FP8_NAME or len(want.shape) < 2:
            continue
        sname = scale_name(name)
        w_sent, s_sent, s_want = sent.get(name), sent.get(sname), expected.get(sname)
        if w_sent is None:
            continue
        if w_sent.dtype in FLOAT_WIRE:
            say([name, sname], f"{name}: the wire carries {w_sent.dtype} but the engine holds block-FP8 ({FP8_NAME} with {SCALE_NAME} {sname})", _SET_FP8)
        elif s_want is None:
            continue  # FP8 without block scales (per-tensor): the generic check compares what it holds
        elif s_sent is None:
            say([name], f"{name}: sent as {w_sent.dtype} without its scale tensor {sname} (a block-FP8 weight is loaded with its scales)", _SET_FP8)
        elif s_sent.dtype != s_want.dtype:
            say([sname], f"{sname}: scales sent as {s_sent.dtype} but the engine keeps {s_want.dtype} inverse scales", _SET_FP8)
        elif s_sent.shape != s_want.shape:
            if len(s_sent.shape) == len(s_want.shape) and tuple(s_sent.shape) == (*s_want.shape[:-2], s_want.shape[-1], s_want.shape[-2]):
                text = f"{sname}: scales sent transposed ({list(s_sent.shape)}; the engine holds {list(s_want.shape)}, blocks of rows x columns)"
            else:
                text = (
                    f"{sname}: scales {list(s_sent.shape)} mean {_blocks_of(want.shape, s_sent.shape)} blocks of {list(want.shape)}, but the "
                    f"engine's checkpoint uses {_blocks_of(want.shape, s_want.shape)} blocks ({list(s_want.shape)})"
                )
            say([sname], text, f"quantize in the engine's blocks: checkpoint_engine.wire_dtype=fp8 writes {BLOCK[0]} x {BLOCK[1]} row-major blocks")
    for name, spec in sent.items():  # FP8 into an engine holding the weight in high precision
        weight = weight_of(name)
        held = expected.get(weight if weight is not None else name)
        if held is None or held.dtype not in FLOAT_WIRE:
            continue
        if spec.dtype == FP8_NAME:
            say([name], f"{name}: the wire is block-FP8 but the engine holds {held.dtype}", _UNSET_FP8)
        elif weight is not None and name not in expected:
            say([name], f"{name}: FP8 scales, but the engine holds {weight} as {held.dtype}", _UNSET_FP8)
    return problems, covered
