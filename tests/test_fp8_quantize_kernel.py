"""The Triton block-FP8 quantize (`fp8/quantize_kernel.py`) equals the eager reference
(`quantize_block_fp8_reference` on the CPU) byte for byte, weights and scales: every bf16 value in
e4m3's range and every rounding tie, all-zero / subnormal / negative-zero blocks, values at amax,
odd, 3-D and 4-D shapes, strided views, bf16 / fp16 / fp32. Runs in Triton's interpreter on the
CPU and, marked `gpu`, on a GPU (there also the shapes of `test_gpu_fp8.py`)."""

from __future__ import annotations


import pytest
import torch

from helpers_triton import run_cases

CASES = r"""
import functools
import torch
from ckpt_engine.fp8.quantize import quantize_block_fp8, quantize_block_fp8_reference
from ckpt_engine.fp8.quantize_kernel import quantize_block_fp8_triton

device = DEVICE
g = torch.Generator().manual_seed(5)
bad = []


def check(label, w):
    # w: a CPU tensor (any view); the kernel reads the same view on `device`
    rq, rs = quantize_block_fp8_reference(w)
    wd = w if device == "cpu" else _same_view(w)
    for how, fn in PATHS:
        q, s = fn(wd)
        same = q.shape == rq.shape and s.shape == rs.shape and torch.equal(q.cpu().view(torch.uint8), rq.view(torch.uint8))
        same = same and torch.equal(s.cpu().view(torch.int32), rs.view(torch.int32))
        if not same:
            bad.append(f"{how} {label} {w.dtype} {tuple(w.shape)} stride {w.stride()}")


def _same_view(w):
    base = w
    while base._base is not None:
        base = base._base
    dev = base.to(device)
    return dev.as_strided(w.shape, w.stride(), w.storage_offset() - base.storage_offset())


PATHS = [("kernel", quantize_block_fp8_triton), ("dispatch", quantize_block_fp8)]
if device != "cpu":  # the integer rounding too where the default is the hardware's
    PATHS.append(("kernel, integer rounding", functools.partial(quantize_block_fp8_triton, hw_cvt=False)))


def in_blocks(values, amax=448.0):
    # values into [n, 128] rows, each 128 x 128 block holding `amax` once, so inv = 448 / amax
    pad = (-values.numel()) % (128 * 127)
    v = torch.cat([values, torch.zeros(pad)]).view(-1, 127, 128)
    head = torch.zeros(v.shape[0], 1, 128)
    head[:, 0, 0] = amax
    return torch.cat([head, v], dim=1).reshape(-1, 128)


# every bf16 bit pattern of magnitude <= 448 (and its negative), as y exactly (inv = 1)
bits = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
finite = bits[bits.abs() <= 448]
check("every bf16 value, inv 1", in_blocks(finite))
check("every bf16 value, as bf16", in_blocks(finite).bfloat16())
# every tie between neighbouring e4m3 values (subnormals included), one float32 ulp either side
codes = torch.arange(0, 0x7F, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
mid = (codes[:-1] + codes[1:]) / 2
ulp = (torch.nextafter(mid, torch.tensor(1e9)), torch.nextafter(mid, torch.tensor(-1e9)))
ties = torch.cat([mid, ulp[0], ulp[1], codes, torch.tensor([464.0, 463.99, 2.0 ** -10, 2.0 ** -11, 3 * 2.0 ** -10])])
check("e4m3 ties, inv 1", in_blocks(torch.cat([ties, -ties])))
# random float32 magnitudes against scales that make inv inexact
rnd = torch.randn(128 * 512, generator=g) * torch.exp2(torch.randint(-30, 10, (128 * 512,), generator=g).float())
for amax in (1000.0, 3.3e-3, 1.7e-4, 7.0):
    check(f"random, amax {amax}", in_blocks(rnd.clamp(-amax, amax), amax))

for dtype in (torch.bfloat16, torch.float16, torch.float32):
    for shape in SHAPES:
        w = (torch.randn(shape, generator=g) * 0.02).to(dtype)
        w[..., :128, :128] = 0
        check("random weight", w)
    w = (torch.randn(300, 260, generator=g) * 0.02).to(dtype)
    w[:128, :128] = 0                                   # an all-zero block (amax floored at 1e-4)
    w[:128, 128:256] = -0.0                             # all negative zero
    w[128:256, :128] = torch.randn(128, 128, generator=g) * 1e-6   # below the floor
    w[128:256, 128:256] = 0.3
    w[128:256, 128:256][5, 7] = -0.3                    # values at +-amax
    w[256:, :128] = torch.finfo(dtype).tiny / 4         # subnormal inputs (fp16 subnormals in fp32 are normal)
    w[256:, 128:192] = torch.finfo(dtype).max if dtype != torch.float32 else 3e38
    check("edge blocks", w)
    base = (torch.randn(390, 517, generator=g) * 0.05).to(dtype)
    check("transposed", base.t())
    check("column slice", base[:, 3:300])
    check("row step", base[::3])
    check("stride 0", base[:1].expand(260, 517))
    for shape in [(1, 1), (1, 300), (129, 1), (127, 129), (3, 130, 257), (2, 2, 130, 128)]:
        check("odd shape", (torch.randn(shape, generator=g) * 3).to(dtype))
    check("3-D slice of experts", (torch.randn(4, 256, 384, generator=g) * 0.02).to(dtype)[1:3, :, 128:])

# many weights in one launch, as Fp8WireSource groups them on CUDA
from ckpt_engine.fp8.quantize_kernel import quantize_block_fp8_group
group = [(torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16) for shape in [(300, 256), (4, 130, 272), (128, 128), (1, 16), (257, 48)]]
group[0][:128, :128] = 0
for w, (q, s) in zip(group, quantize_block_fp8_group([w.to(device) for w in group])):
    rq, rs = quantize_block_fp8_reference(w)
    if not (torch.equal(q.cpu().view(torch.uint8), rq.view(torch.uint8)) and s.shape == rs.shape and torch.equal(s.cpu(), rs)):
        bad.append(f"group {tuple(w.shape)}")
# an MoE layer's experts: shapes interleave (gate, up, down), the buffers hold each shape's weights together
group = [(torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16) for _ in range(3) for shape in [(256, 128), (256, 128), (128, 256)]]
group += [(torch.randn(2, 130, 144, generator=g) * 0.02).to(torch.bfloat16) for _ in range(2)]
for i, (w, (q, s)) in enumerate(zip(group, quantize_block_fp8_group([w.to(device) for w in group], checked=True))):
    rq, rs = quantize_block_fp8_reference(w)
    if not (q.shape == w.shape and q.is_contiguous() and torch.equal(q.cpu().view(torch.uint8), rq.view(torch.uint8)) and s.shape == rs.shape and torch.equal(s.cpu(), rs)):
        bad.append(f"interleaved group, weight {i} {tuple(w.shape)}")

# Fp8WireSource's walk: names in order, each weight's bytes as the reference gives them, through
# groups cut by size, by tensors that are not quantized and by weights the group kernel does not take
import ckpt_engine.sources.fp8 as wire
from ckpt_engine.sources.base import StateDictSource
wire.GROUP_BYTES = 300 * 1024
sd = {}
for i in range(3):
    p = f"model.layers.{i}."
    sd[p + "input_layernorm.weight"] = torch.randn(256, generator=g)
    for proj, shape in [("self_attn.q_proj", (256, 256)), ("self_attn.k_proj", (128, 256)), ("self_attn.o_proj", (256, 200)), ("mlp.up_proj", (512, 256)), ("mlp.down_proj", (256, 512))]:
        sd[p + proj + ".weight"] = torch.randn(shape, generator=g) * 0.02
want = list(wire.Fp8WireSource(StateDictSource(sd, dtype=torch.bfloat16)).iter_weights())  # the CPU: one weight at a time, eager
import ckpt_engine.fp8.quantize_kernel as qk
wire._group_kernel = lambda w: qk  # in Triton's interpreter the CPU's walk takes the grouped kernel too
src = wire.Fp8WireSource(StateDictSource({k: v.to(device) for k, v in sd.items()}, dtype=torch.bfloat16))
walked = list(src.iter_weights())
if not (src.last_walk.grouped == 12 and src.last_walk.alone == 3 and src.last_walk.launches > 3):  # o_proj's 200 columns: alone
    bad.append(f"walk paths {src.last_walk}")
if [n for n, _ in walked] != [n for n, _ in want]:
    bad.append("walk order")
for (n, a), (_, b) in zip(walked, want):
    a = a.cpu()
    if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
        bad.append(f"walk {n}")
# a stable bf16 source: its walk is recorded, and the next one replays its launches (tables made
# once) on the weights' new values, in place
held = {k: v.to(device=device, dtype=torch.bfloat16) for k, v in sd.items()}
first = [(n, t.clone()) for n, t in wire.Fp8WireSource(StateDictSource(held)).iter_weights()]
for t in held.values():
    t.mul_(-3.0)
src = wire.Fp8WireSource(StateDictSource(held))
again = list(src.iter_weights())
want = []
for n, t in held.items():
    want += [(n, t.cpu())] if not n.endswith("proj.weight") else zip([n, n + "_scale_inv"], quantize_block_fp8_reference(t.cpu()))
if not (src.last_walk.replayed == src.last_walk.launches > 3 and src.last_walk.alone == 3):
    bad.append(f"replayed walk paths {src.last_walk}")
if [n for n, _ in again] != [n for n, _ in want] or [n for n, _ in first] != [n for n, _ in want]:
    bad.append("replayed walk order")
for (n, a), (_, b), (_, c) in zip(again, want, first):
    a = a.cpu()
    if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
        bad.append(f"replayed walk {n}")
    if n.endswith("proj.weight") and "o_proj" not in n and torch.equal(a.view(torch.uint8), c.cpu().view(torch.uint8)):
        bad.append(f"replayed walk {n}: the old bytes")

# a launch into a buffer (issue 41): each weight's codes and scales at its offsets, nothing else written
from ckpt_engine.fp8.quantize_kernel import plan_into
ws = [(torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16) for shape in [(256, 128), (2, 130, 144), (128, 256), (300, 256)]]
out = torch.full((1 << 20,), 0xA5, dtype=torch.uint8, device=device)
codes_at, scales_at = [4096, 40960, 200192, 300032], [1024, 2048, 2304, 2560]
plan_into([w.to(device) for w in ws], codes_at, scales_at).run(out)
mask = torch.ones(out.numel(), dtype=torch.bool)
for w, q_at, s_at in zip(ws, codes_at, scales_at):
    rq, rs = quantize_block_fp8_reference(w)
    got_q, got_s = out[q_at : q_at + rq.numel()].cpu(), out[s_at : s_at + 4 * rs.numel()].cpu()
    mask[q_at : q_at + rq.numel()] = mask[s_at : s_at + 4 * rs.numel()] = False
    if not (torch.equal(got_q, rq.reshape(-1).view(torch.uint8)) and torch.equal(got_s.view(torch.float32), rs.reshape(-1))):
        bad.append(f"into a buffer {tuple(w.shape)}")
if not bool((out.cpu()[mask] == 0xA5).all()):
    bad.append("into a buffer: bytes outside the weights' written")

# a replayed walk fills a sender's buckets in place (sources/fp8_fill.py), as `Sender` offers them:
# each bucket's slot bytes are those of the reference, at the first fills and at their replay
from ckpt_engine.fp8.direct import FILLED, OFFER, Ask, Offer
from ckpt_engine.pipeline.wire_views import entry_view
from ckpt_engine.planning.buckets import plan_buckets
manifest = plan_buckets(wire.Fp8WireSource(StateDictSource(held)).metadata(), 256 * 1024)
slot = torch.empty(256 * 1024 + 256, dtype=torch.uint8, device=device)
offer = Offer("kernel test")
token = OFFER.set(offer)
for sync in range(2):
    for t in held.values():
        t.mul_(-0.5)
    ref = {}
    for n, t in held.items():
        ref.update([(n, t.cpu())] if not n.endswith("proj.weight") else zip([n, n + "_scale_inv"], quantize_block_fp8_reference(t.cpu())))
    src = wire.Fp8WireSource(StateDictSource(held))
    src.fill_slots = True
    it = src.iter_weights()
    for b in manifest.buckets:
        whole = all(e.is_whole for e in b.entries)
        dsts = [entry_view(slot, e) for e in b.entries] if whole else []
        offer.ask = Ask(b.index, b.entries, dsts, slot) if whole else None
        first = next(it)
        offer.ask = None
        if first[0] == FILLED:
            got = [(e.name, d) for e, d in zip(b.entries, dsts)]
        else:
            got = [first] + [next(it) for _ in b.entries[1:]]
        for e, (n, t) in zip(b.entries, got):
            want = ref[e.name].reshape(-1).view(torch.uint8)[e.chunk_offset : e.chunk_offset + e.chunk_size] if not e.is_whole else ref[e.name]
            t = t.cpu() if e.is_whole else t.cpu().reshape(-1).view(torch.uint8)[e.chunk_offset : e.chunk_offset + e.chunk_size]
            if n != e.name or not torch.equal(t.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)):
                bad.append(f"filled walk, sync {sync}: {e.name}")
    if next(it, None) is not None:
        bad.append("filled walk: items left")
    whole = sum(all(e.is_whole for e in b.entries) for b in manifest.buckets)
    if not (src.last_walk.filled == whole and src.last_walk.alone == 3 and src.last_walk.replayed == (src.last_walk.launches if sync else 0) and src.last_walk.launches > 0):
        bad.append(f"filled walk paths, sync {sync}: {src.last_walk} ({whole} buckets of whole entries)")
OFFER.reset(token)
assert not bad, bad
print("ok")
"""

SMALL = [(300, 260), (2, 256, 384), (256, 128)]
GPU_SHAPES = [(3584, 3584), (18944, 3584), (300, 260), (8, 768, 2048)]


def _run(device: str, interpret: bool, shapes: list[tuple[int, ...]]) -> None:
    run_cases(CASES.replace("DEVICE", repr(device)).replace("SHAPES", repr(shapes)), interpret, timeout_s=900)


def test_kernel_equals_the_reference_in_tritons_interpreter() -> None:
    pytest.importorskip("triton")
    _run("cpu", True, SMALL)


@pytest.mark.gpu
def test_kernel_equals_the_cpu_reference_on_a_gpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    _run("cuda", False, GPU_SHAPES)


@pytest.mark.parametrize("hw_cvt", [True, False])
def test_the_sm90_build_rounds_as_the_reference_does(hw_cvt: bool) -> None:
    """What the interpreter cannot show, read from the kernel compiled for an H100/H200 (sm_90,
    ahead of time with Triton's own ptxas, no GPU needed): the scale and its reciprocal are
    correctly rounded divisions, the multiply is not fused into an FMA, no denormal flushing, e4m3
    by the hardware's round-to-nearest-even conversion (or none: the integer path), and 16-byte
    loads (the kernel reads the weight once, vectorized)."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ckpt_engine.fp8.quantize_kernel import _FLOOR_BITS, _quantize_blocks

    names = ["w_ptr", "q_ptr", "s_ptr", "rows", "cols", "sw_e", "sw_r", "sw_c", "bc", "nb", "BR", "BC", "FLOOR_BITS", "HW_CVT"]
    types = ["*bf16", "*u8", "*fp32", "i32", "i32", "i32", "i32", "constexpr", "i32", "i32", "constexpr", "constexpr", "constexpr", "constexpr"]
    consts = {"sw_c": 1, "BR": 128, "BC": 128, "FLOOR_BITS": _FLOOR_BITS, "HW_CVT": hw_cvt}
    try:
        src = ASTSource(
            fn=_quantize_blocks, signature=dict(zip(names, types)), constexprs={(names.index(k),): v for k, v in consts.items()},
            attrs={(i,): [["tt.divisibility", 16]] for i in range(7)},  # what a launch on typical weights specializes
        )
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8, "enable_fp_fusion": False}).asm["ptx"]
    except Exception as exc:  # noqa: BLE001 - no CUDA toolchain in this Triton build, or another compile API
        pytest.skip(f"Triton {triton.__version__} cannot build for sm_90 here this way: {exc!r}")
    assert ptx.count("div.rn.f32") == 2 and "mul.rn.f32" in ptx and "mul.f32" not in ptx  # .rn: never contracted by ptxas
    assert "fma." not in ptx and ".ftz" not in ptx and "div.approx" not in ptx and "div.full" not in ptx
    assert (ptx.count("cvt.rn.satfinite.e4m3x2.f32") > 0) == hw_cvt
    assert "ld.global.v4" in ptx


def test_bad_input_is_refused_by_name() -> None:
    pytest.importorskip("triton")
    from ckpt_engine.fp8.quantize_kernel import quantize_block_fp8_triton

    with pytest.raises(ValueError, match="bf16/fp16/fp32 matrices"):
        quantize_block_fp8_triton(torch.zeros(4))
    with pytest.raises(ValueError, match="bf16/fp16/fp32 matrices"):
        quantize_block_fp8_triton(torch.zeros(4, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="power-of-two"):
        quantize_block_fp8_triton(torch.zeros(4, 4), (96, 128))


def test_a_group_refuses_weights_it_cannot_take_by_index() -> None:
    """Unless the caller says it asked `groupable` of each (`checked`), the grouped launch checks
    every weight and names the ones it cannot read with 16-byte loads or in one dtype."""
    pytest.importorskip("triton")
    from ckpt_engine.fp8.quantize_kernel import quantize_block_fp8_group

    ok = torch.zeros(128, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"not weight\(s\) \[1, 3\]"):
        quantize_block_fp8_group([ok, ok.t(), ok, ok.float()])  # transposed (not contiguous), another dtype
    with pytest.raises(ValueError, match=r"not weight\(s\) \[0\]"):
        quantize_block_fp8_group([torch.zeros(64, 200, dtype=torch.bfloat16)])  # 200 columns: no 16-byte rows
