"""The block-FP8 quantize as one Triton launch per weight: the CUDA path of `quantize_block_fp8`.

The eager recipe (`quantize.quantize_block_fp8_reference`) makes ~6 passes over float32 copies of
the weight (abs, float, amax, multiply, cast: ~27 bytes of memory traffic per element); on 2xH200
that made a 7B FP8 sync 2.35 x slower than its bf16 sync. Here one program owns one 128 x 128 block
(any `[..., out, in]`, strided or not): it reads the block once in its own dtype, writes its e4m3
codes and its float32 scale once (3 bytes per bf16 element).

Bit-exact with the reference (`tests/test_fp8_quantize_kernel.py`, in Triton's interpreter on the
CPU and on a GPU), step by step:
- amax: the maximum of the float32 magnitudes taken as integer bit patterns (for non-negative
  floats the order is the same; exact, whatever the reduction order), floored at float32(1e-4);
- scale = amax / 448 and inv = 1 / scale with `div_rn` (Triton's `/` on float32 is approximate);
- y = w * inv: one correctly rounded multiply (no add follows it, so nothing fuses into an FMA);
- e4m3: round to nearest even, as torch's conversion (c10 `fp8e4m3fn_from_fp32_value`). On sm_89+
  the hardware's `cvt.rn.satfinite.e4m3x2.f32` (what `.to(tl.float8e4nv)` lowers to): it differs
  from torch only at |y| >= 464 (saturates where torch gives NaN), and |y| <= 448 (1 + 2^-22)
  here for every finite block. Elsewhere (older GPUs, Triton's interpreter, whose conversion rounds
  half up on one guard bit) torch's conversion written in integer ops, the same on every device:
  ~20 integer ops per element, which may cost bandwidth on a GPU (test_gpu_fp8 prints both rates).
Subnormal inputs cannot change a code either way (|y| <= 4.48e6 x 2^-126, far below e4m3's 2^-9).
Not covered: NaN or Inf in a weight (NaN payloads and signs differ between devices even for the
eager recipe).
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl

from ckpt_engine.delta.kernels import on_device_of
from ckpt_engine.fp8.layout import BLOCK, FP8_DTYPE

__all__ = ["MAX_GROUP", "GroupLaunch", "IntoLaunch", "groupable", "plan_group", "plan_into", "quantize_block_fp8_group", "quantize_block_fp8_triton"]

_FLOOR_BITS = struct.unpack("<i", struct.pack("<f", 1e-4))[0]
"""float32(1e-4) as its bit pattern: the reference's `clamp(1e-4)` on a float32 amax."""
_NUM_WARPS = 8
_HW_CVT: dict[torch.device, bool] = {}


def _hw_cvt(device: torch.device) -> bool:
    """Whether `device` rounds to e4m3 with its own conversion (CUDA, compute capability 8.9+);
    asked of the driver once per device: a walk whose weights go alone asks 18,432 times a sync."""
    known = _HW_CVT.get(device)
    if known is None:
        known = _HW_CVT[device] = device.type == "cuda" and torch.version.hip is None and torch.cuda.get_device_capability(device) >= (8, 9)
    return known


@triton.jit(do_not_specialize=["bc", "nb"])  # only index the scales: fewer compiled variants per model
def _quantize_blocks(
    w_ptr, q_ptr, s_ptr, rows, cols, sw_e, sw_r, sw_c, bc, nb,
    BR: tl.constexpr, BC: tl.constexpr, FLOOR_BITS: tl.constexpr, HW_CVT: tl.constexpr,
):
    """One weight: program (pc, pr, pe) quantizes block (pr, pc) of matrix pe, read through strides."""
    pc = tl.program_id(0)
    pr = tl.program_id(1)
    pe = tl.program_id(2).to(tl.int64)
    r = (pr * BR + tl.arange(0, BR)).to(tl.int64)
    c = (pc * BC + tl.arange(0, BC)).to(tl.int64)
    mask = (r[:, None] < rows) & (c[None, :] < cols)
    w = tl.load(w_ptr + pe * sw_e + r[:, None] * sw_r + c[None, :] * sw_c, mask=mask, other=0.0)
    code, sf = _block(w, FLOOR_BITS, HW_CVT)
    tl.store(q_ptr + pe * rows * cols + r[:, None] * cols + c[None, :], code, mask=mask)
    tl.store(s_ptr + pe * nb + pr * bc + pc, sf)


@triton.jit
def _quantize_many(table, q_base, s_base, DTYPE: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, FLOOR_BITS: tl.constexpr, HW_CVT: tl.constexpr):
    """Many contiguous weights of one dtype: program (b, t) quantizes block b of weight t (its
    table row: input address, codes and scales offsets from `q_base` / `s_base`, rows, cols, block
    columns, blocks per matrix, blocks in all); programs past a weight's blocks store nothing. Every
    address is 16-byte aligned and every `cols` a multiple of 16 (`groupable`), so the loads are 16
    bytes wide."""
    row = table + tl.program_id(1) * 8
    w_ptr = tl.multiple_of(tl.load(row).to(tl.pointer_type(DTYPE)), 16)
    q_ptr = tl.multiple_of(q_base + tl.load(row + 1), 16)
    s_ptr = s_base + tl.load(row + 2)
    rows = tl.load(row + 3)
    cols = tl.multiple_of(tl.load(row + 4), 16)
    bc = tl.load(row + 5)
    nb = tl.load(row + 6)
    b = tl.program_id(0).to(tl.int64)
    live = b < tl.load(row + 7)
    rows_live = tl.where(live, rows, 0)  # a program past the weight's blocks: nothing to read or write
    pe = b // nb
    pr = (b % nb) // bc
    pc = b % bc
    r = pr * BR + tl.arange(0, BR).to(tl.int64)
    c = pc * BC + tl.arange(0, BC).to(tl.int64)
    mask = (r[:, None] < rows_live) & (c[None, :] < cols)
    at = pe * rows * cols + r[:, None] * cols + c[None, :]
    w = tl.load(w_ptr + at, mask=mask, other=0.0)
    code, sf = _block(w, FLOOR_BITS, HW_CVT)
    tl.store(q_ptr + at, code, mask=mask)
    tl.store(s_ptr + b, sf, mask=live)


@triton.jit
def _block(w_in, FLOOR_BITS: tl.constexpr, HW_CVT: tl.constexpr):
    """One block (padding loaded as zeros): its e4m3 codes (uint8) and its float32 scale."""
    w = w_in.to(tl.float32)
    mag = w.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    amax = tl.maximum(tl.max(mag), FLOOR_BITS).to(tl.float32, bitcast=True)
    sf = tl.math.div_rn(amax, tl.full([], 448.0, tl.float32))
    inv = tl.math.div_rn(tl.full([], 1.0, tl.float32), sf)
    if HW_CVT:
        code = (w * inv).to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
    else:
        code = _e4m3_bits(w * inv).to(tl.uint8)
    return code, sf


@triton.jit
def _e4m3_bits(y_f32):
    """c10's float32 -> float8_e4m3fn, in integer ops: the code as int32 (0..255)."""
    y = y_f32.to(tl.int32, bitcast=True)
    sign = (y >> 24) & 0x80
    a = y & 0x7FFFFFFF
    # normal e4m3 (|y| >= 2^-6): c10's round-to-nearest-even on the top 4 mantissa bits
    normal = (a + (((7 - 127) << 23) + 0x7FFFF) + ((a >> 20) & 1)) >> 20
    # subnormal e4m3 (|y| < 2^-6): round(|y| / 2^-9) to nearest even, from the integer mantissa
    e = a >> 23
    m = (a & 0x7FFFFF) | 0x800000  # (an fp32 subnormal or zero gets shift 31: code 0, as it should)
    shift = tl.minimum(141 - e, 31)
    qs = m >> shift
    rem = m & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    up = (rem > half) | ((rem == half) & ((qs & 1) == 1))
    sub = qs + up.to(tl.int32)
    return tl.where(a >= (1087 << 20), 0x7F, tl.where(a < (121 << 23), sub, normal)) | sign


def quantize_block_fp8_triton(
    w: torch.Tensor, block: tuple[int, int] = BLOCK, *, hw_cvt: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_block_fp8` in one launch on `w`'s device (CUDA, or the CPU under
    `TRITON_INTERPRET=1`): `w` is read through its strides, no contiguous copy, except for more
    than one leading dimension that does not flatten into a view. `hw_cvt`: round to e4m3 with the
    GPU's conversion (default: on CUDA devices of compute capability 8.9 and above)."""
    if w.dim() < 2 or w.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"the block-FP8 kernel quantizes bf16/fp16/fp32 matrices ([out, in] or [experts, out, in]), got {w.dtype} {tuple(w.shape)}")
    block_rows, block_cols = block
    if block_rows & (block_rows - 1) or block_cols & (block_cols - 1):
        raise ValueError(f"the block-FP8 kernel needs power-of-two block sides, got {block}")
    *lead, rows, cols = w.shape
    w3 = w.reshape(-1, rows, cols) if lead else w.unsqueeze(0)
    experts = w3.shape[0]
    br, bc = -(-rows // block_rows), -(-cols // block_cols)
    q = torch.empty((*lead, rows, cols), dtype=FP8_DTYPE, device=w.device)
    s = torch.empty((*lead, br, bc), dtype=torch.float32, device=w.device)
    if q.numel() == 0:
        return q, s
    if experts > 65535 or br > 65535:
        raise ValueError(f"the block-FP8 kernel's grid takes at most 65535 experts and block rows, got {tuple(w.shape)}")
    if hw_cvt is None:
        hw_cvt = _hw_cvt(w.device)
    with on_device_of(w):
        _quantize_blocks[(bc, br, experts)](
            w3, q.view(torch.uint8), s, rows, cols, *w3.stride(), bc, br * bc,
            BR=block_rows, BC=block_cols, FLOOR_BITS=_FLOOR_BITS, HW_CVT=hw_cvt, num_warps=_NUM_WARPS, enable_fp_fusion=False,  # no FMA: y = w * inv rounds once
        )
    return q, s


_GROUP_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
MAX_GROUP = 65535
"""Weights one `quantize_block_fp8_group` launch takes at most (the grid's second dimension)."""


def groupable(w: torch.Tensor) -> bool:
    """Whether `quantize_block_fp8_group` takes `w`: a contiguous, non-empty bf16/fp16/fp32
    [out, in] or [experts, out, in] whose address and row length allow 16-byte loads. Asked per
    weight of a walk (18,432 a 30B-A3B sync): the shape and dtype part is answered once per layout."""
    return w.is_contiguous() and w.data_ptr() % 16 == 0 and _groupable_layout(w.shape, w.dtype)


@functools.cache
def _groupable_layout(shape: torch.Size, dtype: torch.dtype) -> bool:
    return len(shape) in (2, 3) and dtype in _GROUP_DTYPES and shape[-1] % 16 == 0 and shape.numel() > 0


def quantize_block_fp8_group(
    ws: Sequence[torch.Tensor], *, checked: bool = False
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`quantize_block_fp8` of every weight in `ws` (each `groupable`, one dtype, one device) in one
    launch: a launch costs ~10-30 us of host time, and Qwen3-30B-A3B quantizes 18,432 expert
    weights per sync. The results are views of one buffer made for the group (`GroupLaunch`)."""
    if not ws:
        return []
    launch = GroupLaunch(ws, checked=checked)
    views, n = launch.run(ws), len(ws)
    return [(views[p], views[n + p]) for p in launch.pos]


def plan_group(ws: Sequence[torch.Tensor], *, checked: bool = False) -> GroupLaunch:
    """`GroupLaunch(ws, checked=checked)`: the walk's way in (`sources/fp8.py`'s `GroupKernel`)."""
    return GroupLaunch(ws, checked=checked)


class GroupLaunch:
    """One grouped launch's host work, done once for a set of weights and replayed by `run` while
    they stay where they are (a stable source yields the same tensors every sync: `Fp8WireSource`
    keeps its launches across syncs). On 2xH200 the walk's host work bounded a 30B-A3B FP8 sync.

    The work is per shape, not per weight: the buffer holds each shape's weights in one stretch, in
    order of first appearance (an MoE layer's gate, up and down experts interleave), so a shape's
    table rows and result views (one `unbind`) are a few calls each. The table holds the inputs'
    addresses and the outputs' offsets in the group's buffer (its address is the launch's argument),
    so it is made and copied to the device once. `checked`: the caller asked `groupable` of each
    weight and gives one dtype and device (a walk that groups them does): not asked again."""

    def __init__(self, ws: Sequence[torch.Tensor], *, checked: bool = False) -> None:
        if not ws:
            raise ValueError("a grouped launch needs at least one weight")
        dtype, device, index = ws[0].dtype, ws[0].device, ws[0].get_device()
        by_shape: dict[torch.Size, list[int]] = {}
        for i, w in enumerate(ws):
            by_shape.setdefault(w.shape, []).append(i)
        bad = [] if checked else [i for i, w in enumerate(ws) if not groupable(w) or w.dtype is not dtype or w.get_device() != index]
        if bad or len(ws) > MAX_GROUP or dtype not in _GROUP_DTYPES:
            raise ValueError(f"quantize_block_fp8_group takes up to {MAX_GROUP} groupable weights of one dtype and device; not weight(s) {bad[:8]}")
        self.ptrs = [w.data_ptr() for w in ws]
        """The inputs' addresses the table holds: `run` is only for weights at these."""
        self.dtype, self.device = dtype, device
        self._shapes: list[tuple[Any, ...]] = []  # per shape: (its shape, its scales', weights, codes a weight, blocks a weight, table columns 3-7)
        q_total = s_total = widest = 0
        for shape, idx in by_shape.items():
            meta = _meta(shape)
            _, _, bc, per_matrix, blocks = meta
            self._shapes.append((shape, (*shape[:-2], per_matrix // bc, bc), len(idx), shape.numel(), blocks, meta))
            q_total += len(idx) * self._shapes[-1][3]  # a multiple of 16 (`cols` is): every weight's codes start 16-byte aligned
            s_total += len(idx) * blocks
            widest = max(widest, blocks)
        self._q_total, self._s_total = q_total, s_total
        order = [i for idx in by_shape.values() for i in idx]  # table rows and buffer stretches: by shape
        self.pos = [0] * len(ws)
        """Weight i's place in `run`'s codes (and, after all of them, scales)."""
        for j, i in enumerate(order):
            self.pos[i] = j
        self._launches = _by_width(_table(self._shapes, self.ptrs if len(self._shapes) == 1 else [self.ptrs[i] for i in order]), device)
        self._hw_cvt = _hw_cvt(device)

    def run(self, ws: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Quantize `ws` (the weights this launch was made for, at `ptrs`) in one launch: every
        weight's codes, then every weight's scales, in the buffer's order (weight i's at `pos[i]`)."""
        q_buf = torch.empty(self._q_total + 4 * self._s_total, dtype=torch.uint8, device=self.device)
        s_buf = q_buf[self._q_total :].view(torch.float32)  # `_q_total` is a multiple of 16
        for grid, table in self._launches:
            _launch(grid, table, q_buf, s_buf, self.dtype, self._hw_cvt)
        codes = q_buf[: self._q_total].view(FP8_DTYPE)
        qs: list[torch.Tensor] = []
        ss: list[torch.Tensor] = []
        q_at = s_at = 0
        for shape, s_shape, n, numel, blocks, _ in self._shapes:
            qs += codes[q_at : q_at + n * numel].view(n, *shape).unbind(0)
            ss += s_buf[s_at : s_at + n * blocks].view(n, *s_shape).unbind(0)
            q_at, s_at = q_at + n * numel, s_at + n * blocks
        return qs + ss


def plan_into(ws: Sequence[torch.Tensor], codes_at: Sequence[int], scales_at: Sequence[int]) -> IntoLaunch:
    """`IntoLaunch(ws, codes_at, scales_at)`: the walk's way in for a bucket it fills in place."""
    return IntoLaunch(ws, codes_at, scales_at)


class IntoLaunch:
    """One launch that quantizes `ws` (each `groupable`, one dtype and device: the caller asked)
    straight into a bucket's send buffer: weight i's codes at byte `codes_at[i]` of the buffer,
    its scales at byte `scales_at[i]` (the wire's layout, so the sender packs nothing: issue 41).
    The table is made once, with the offsets in it; `run` takes the buffer, so one launch serves
    whichever slot the bucket goes through. Codes offsets must be multiples of 16 (16-byte stores),
    scales offsets of 4."""

    def __init__(self, ws: Sequence[torch.Tensor], codes_at: Sequence[int], scales_at: Sequence[int]) -> None:
        if not ws or len(ws) != len(codes_at) or len(ws) != len(scales_at) or len(ws) > MAX_GROUP:
            raise ValueError(f"a launch into a buffer takes 1 to {MAX_GROUP} weights, each with a codes and a scales offset")
        bad = [i for i, (q, s) in enumerate(zip(codes_at, scales_at)) if q % 16 or s % 4 or q < 0 or s < 0]
        if bad or ws[0].dtype not in _GROUP_DTYPES:
            raise ValueError(f"a launch into a buffer needs codes at multiples of 16 bytes and scales at multiples of 4; not weight(s) {bad[:8]}")
        self.dtype, self.device = ws[0].dtype, ws[0].device
        self.ptrs = [w.data_ptr() for w in ws]
        metas = [_meta(w.shape) for w in ws]
        table = np.empty((len(ws), 8), dtype=np.int64)
        table[:, 0] = self.ptrs
        table[:, 1] = codes_at
        table[:, 2] = np.asarray(scales_at, dtype=np.int64) // 4
        table[:, 3:] = metas
        self._end = max(q + w.numel() for q, w in zip(codes_at, ws)), max(s + 4 * m[4] for s, m in zip(scales_at, metas))
        self._launches = _by_width(table, self.device)
        self._hw_cvt = _hw_cvt(self.device)

    def run(self, out: torch.Tensor) -> None:
        """Quantize the weights (still at `ptrs`) into `out`, a uint8 buffer on their device."""
        if out.dtype != torch.uint8 or out.dim() != 1 or out.numel() < max(self._end) or out.device != self.device:
            raise ValueError(f"a launch into a buffer writes up to byte {max(self._end)} of a uint8 buffer on {self.device}, got {out.dtype} {tuple(out.shape)} on {out.device}")
        scales = out[: out.numel() // 4 * 4].view(torch.float32)
        for grid, table in self._launches:
            _launch(grid, table, out, scales, self.dtype, self._hw_cvt)


def _by_width(table: np.ndarray, device: torch.device) -> list[tuple[tuple[int, int], torch.Tensor]]:
    """The launches of `table`'s weights (grid, table on `device`): one per count of blocks a weight.
    A launch's grid is its widest weight's blocks times its weights, and a program past its
    weight's blocks still runs a block's arithmetic (on zeros): one launch of a Qwen3-30B-A3B bucket,
    a few 512-block attention weights beside ~700 96-block experts, ran ~80 % idle programs and
    quantized no faster than the link moved the codes (2xH200: 3.1 ms a 1 GiB bucket against 1.9 ms
    for 7B's). Each weight's row is the same in whichever launch, so the bytes are too."""
    blocks = table[:, 7]
    return [((int(b), int((blocks == b).sum())), _on(np.ascontiguousarray(table[blocks == b]), device)) for b in np.unique(blocks)]


def _on(table: np.ndarray, device: torch.device) -> torch.Tensor:
    """A launch table on `device`, copied once by the launch that keeps it (pinned: a copy from
    pageable memory would make the host wait for the stream)."""
    t = torch.from_numpy(table)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def _launch(grid: tuple[int, int], table: torch.Tensor, q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype, hw_cvt: bool) -> None:
    """One `_quantize_many` launch over `table`'s weights into codes buffer `q` and scales `s`, on
    their GPU (not the current one)."""
    with on_device_of(q):
        _quantize_many[grid](
            table, q, s, DTYPE=_GROUP_DTYPES[dtype], BR=BLOCK[0], BC=BLOCK[1], FLOOR_BITS=_FLOOR_BITS,
            HW_CVT=hw_cvt, num_warps=_NUM_WARPS, enable_fp_fusion=False,
        )


def _meta(shape: torch.Size) -> tuple[int, int, int, int, int]:
    """Table columns 3-7 of a weight of `shape`: rows, cols, block columns, blocks a matrix, blocks."""
    *lead, rows, cols = shape
    br, bc = -(-rows // BLOCK[0]), -(-cols // BLOCK[1])
    return rows, cols, bc, br * bc, br * bc * (lead[0] if lead else 1)


def _table(shapes: list[tuple[Any, ...]], ptrs: list[int]) -> np.ndarray:
    """`_quantize_many`'s table, weights by shape as `shapes` lists them, `ptrs` their inputs'
    addresses in that order, then their codes' and scales' offsets in the group's buffer: a few
    array ops a shape, not a Python row a weight (numpy: a torch op on a tiny CPU tensor costs
    several times as much host time)."""
    table = np.empty((len(ptrs), 8), dtype=np.int64)
    table[:, 0] = ptrs
    at = q_at = s_at = 0
    for _, _, n, numel, blocks, meta in shapes:
        k = np.arange(n, dtype=np.int64)
        rows = table[at : at + n]
        rows[:, 1] = q_at + k * numel
        rows[:, 2] = s_at + k * blocks
        rows[:, 3:] = meta
        at, q_at, s_at = at + n, q_at + n * numel, s_at + n * blocks
    return table
