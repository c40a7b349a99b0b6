"""Which quantize path each weight of an FP8 walk takes (`Fp8WireSource.last_walk`), on the CPU.

Why: a 30B-A3B walk has 18,432 expert weights; one launch each costs more host time than the whole
bf16 sync, so they must go through the grouped kernel wherever that is safe, and only there: a
weight waits for its group's launch while later ones are read, so a source that reuses its memory
(a gathering walk) must not be grouped. The grouped kernel is CUDA's (Triton); here a stand-in with
its interface quantizes each group with the eager recipe when the group is launched, so a weight
overwritten before its launch would show up as wrong bytes.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence

import pytest
import torch

import ckpt_engine.sources.fp8 as wire
from ckpt_engine.benchmark.presets import checkpoint_specs, load_preset_config
from ckpt_engine.fp8.layout import FP8_DTYPE, fp8_specs, quantizes, scale_name, scale_shape
from ckpt_engine.fp8.quantize import quantize_block_fp8_reference
from ckpt_engine.manifest import TensorSpec
from ckpt_engine.sources.base import StateDictSource, WeightSource
from ckpt_engine.sources.wire import torch_dtype


class EagerGroups:
    """The grouped kernel's interface (`fp8/quantize_kernel.py`), quantizing with the eager recipe
    when a launch runs; records each run's size."""

    MAX_GROUP = 65535

    def __init__(self) -> None:
        self.launches: list[int] = []

    def groupable(self, w: torch.Tensor) -> bool:
        return w.dim() in (2, 3) and w.is_contiguous() and w.numel() > 0 and w.shape[-1] % 16 == 0

    def plan_group(self, ws: Sequence[torch.Tensor], *, checked: bool = False) -> EagerLaunch:
        return EagerLaunch(self, ws)

    def plan_into(self, ws: Sequence[torch.Tensor], codes_at: Sequence[int], scales_at: Sequence[int]) -> EagerInto:
        return EagerInto(self, ws, codes_at, scales_at)


class EagerLaunch:
    """A launch of `EagerGroups`: made for its weights' addresses, results in the weights' order."""

    def __init__(self, kernel: EagerGroups, ws: Sequence[torch.Tensor]) -> None:
        self.kernel, self.ptrs, self.pos = kernel, [w.data_ptr() for w in ws], list(range(len(ws)))

    def run(self, ws: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        assert [w.data_ptr() for w in ws] == self.ptrs, "a launch ran for weights it was not made for"
        self.kernel.launches.append(len(ws))
        if ws and ws[0].is_meta:  # shapes only (a whole preset's walk)
            made = [(torch.empty(w.shape, dtype=FP8_DTYPE, device="meta"), torch.empty(scale_shape(w.shape), device="meta")) for w in ws]
        else:
            made = [quantize_block_fp8_reference(w) for w in ws]
        return [q for q, _ in made] + [s for _, s in made]


class EagerInto:
    """A launch of `EagerGroups` into a bucket's buffer: each weight's codes and scales written, by
    the eager recipe, at its byte offsets when the launch runs."""

    def __init__(self, kernel: EagerGroups, ws: Sequence[torch.Tensor], codes_at: Sequence[int], scales_at: Sequence[int]) -> None:
        self.kernel, self.ws, self.at = kernel, [weakref.ref(w) for w in ws], list(zip(codes_at, scales_at))
        self.ptrs = [w.data_ptr() for w in ws]

    def run(self, out: torch.Tensor) -> None:
        ws = [r() for r in self.ws]
        assert all(w is not None for w in ws) and [w.data_ptr() for w in ws] == self.ptrs, "a launch ran for weights that are gone"  # type: ignore[union-attr]
        self.kernel.launches.append(len(ws))
        for w, (q_at, s_at) in zip(ws, self.at):
            q, s = quantize_block_fp8_reference(w)
            out[q_at : q_at + q.numel()].copy_(q.reshape(-1).view(torch.uint8))
            out[s_at : s_at + 4 * s.numel()].copy_(s.reshape(-1).view(torch.uint8))


@pytest.fixture
def groups(monkeypatch: pytest.MonkeyPatch) -> EagerGroups:
    kernel = EagerGroups()
    monkeypatch.setattr(wire, "_group_kernel", lambda w: kernel)
    return kernel


class ReusedBuffer(WeightSource):
    """A gathering walk's shape: every weight is copied into one buffer that the next one overwrites
    (not `stable_tensors`, not `fresh_tensors`), as FSDP2's and Megatron's walks may do."""

    def __init__(self, weights: dict[str, torch.Tensor], yield_dtype: torch.dtype) -> None:
        self.weights, self.yield_dtype = weights, yield_dtype
        self._buf = torch.empty(max(t.numel() for t in weights.values()), dtype=yield_dtype)

    def metadata(self) -> list[TensorSpec]:
        return [TensorSpec(n, "bfloat16", tuple(t.shape)) for n, t in self.weights.items()]

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self.weights.items():
            view = self._buf[: t.numel()].view(t.shape)
            view.copy_(t)
            yield name, view


def _model() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out: dict[str, torch.Tensor] = {}
    for i in range(2):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = torch.randn(256, generator=g)
        for proj, shape in [("self_attn.q_proj", (256, 256)), ("self_attn.o_proj", (256, 200)), ("mlp.up_proj", (384, 256)), ("mlp.down_proj", (256, 384))]:
            out[p + proj + ".weight"] = torch.randn(shape, generator=g) * 0.02
    return out


def _eager(weights: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """The walk's tensors by the eager recipe, one weight at a time: what every path must give."""
    out: list[tuple[str, torch.Tensor]] = []
    for name, t in weights.items():
        if not quantizes(TensorSpec(name, "bfloat16", tuple(t.shape))):
            out.append((name, t))
            continue
        q, s = quantize_block_fp8_reference(t.bfloat16())
        out += [(name, q), (scale_name(name), s)]
    return out


def _same(a: list[tuple[str, torch.Tensor]], b: list[tuple[str, torch.Tensor]]) -> None:
    assert [n for n, _ in a] == [n for n, _ in b]
    for (n, x), (_, y) in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)), n


def test_the_cpu_walk_quantizes_each_weight_alone_with_the_eager_recipe() -> None:
    src = wire.Fp8WireSource(StateDictSource(_model(), dtype=torch.bfloat16))
    list(src.iter_weights())
    assert src.last_walk == wire.WalkCounts(launches=0, grouped=0, alone=8)


def test_a_stable_source_is_grouped_across_unquantized_tensors(groups: EagerGroups) -> None:
    model = {n: t.bfloat16() for n, t in _model().items()}
    src = wire.Fp8WireSource(StateDictSource(model))
    walked = list(src.iter_weights())
    _same(walked, _eager(model))
    # o_proj's 200 columns are not groupable: it goes alone and ends the group before it. The next
    # layer's norm does not end one (held, sent in its place): up+down of layer 0 go with q of layer 1
    assert src.last_walk == wire.WalkCounts(launches=3, grouped=6, alone=2) and groups.launches == [1, 3, 2]


def test_a_source_that_reuses_its_memory_is_never_grouped(groups: EagerGroups) -> None:
    model = {n: t.bfloat16() for n, t in _model().items()}
    src = wire.Fp8WireSource(ReusedBuffer(model, torch.bfloat16))
    walked = [(n, t.clone()) for n, t in src.iter_weights()]  # unquantized tensors are the reused buffer's too
    _same(walked, _eager(model))
    assert src.last_walk == wire.WalkCounts(launches=0, grouped=0, alone=8) and groups.launches == []


def test_weights_the_walk_casts_itself_are_grouped_even_from_a_reused_buffer(groups: EagerGroups) -> None:
    """fp32 masters on a bf16 wire: the cast is the walk's own memory, valid until its launch."""
    model = _model()
    src = wire.Fp8WireSource(ReusedBuffer(model, torch.float32))
    walked = [(n, t.clone()) for n, t in src.iter_weights()]
    _same(walked, _eager(model))
    assert src.last_walk == wire.WalkCounts(launches=4, grouped=6, alone=2)


def test_a_qwen3_moe_walk_launches_once_per_group_not_per_expert(groups: EagerGroups) -> None:
    """Qwen3-30B-A3B, 12 layers (the region bench's `--layers 12`): 4,656 quantized weights, 4,608
    of them experts, in a few launches a layer (cut at each unquantized tensor and every
    GROUP_BYTES), shapes only."""
    specs = checkpoint_specs(load_preset_config("qwen3-30b-a3b"), num_layers=12)
    weights = {s.name: torch.empty(s.shape, dtype=torch_dtype(s.dtype), device="meta") for s in specs}
    src = wire.Fp8WireSource(StateDictSource(weights))
    walked = list(src.iter_weights())
    quantized = [s for s in specs if quantizes(s)]
    assert [n for n, _ in walked] == [s.name for s in fp8_specs(specs)] and len(walked) == 9375
    assert len(quantized) == 4656 and sum(".experts." in s.name for s in quantized) == 4608
    expert_bytes = sum(s.nbytes for s in quantized if ".experts." in s.name)
    assert src.last_walk.grouped == 4656 and src.last_walk.alone == 0
    assert src.last_walk.launches <= 12 * 2 + expert_bytes // (wire.GROUP_BYTES - 4 * 768 * 2048) + 12, src.last_walk


@pytest.mark.gpu
def test_on_a_gpu_a_moe_layer_walks_through_the_grouped_kernel() -> None:
    """The real walk on CUDA (Triton's grouped kernel, no stand-in): one Qwen3-30B-A3B layer's 384
    expert weights in a few launches, each weight's bytes those of the CPU reference. Prints the
    replayed walk's host time a weight (launches queued, not waited for), the figure issue 41 is about."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    import time

    device = torch.device("cuda", 0)
    specs = checkpoint_specs(load_preset_config("qwen3-30b-a3b"), num_layers=1)
    g = torch.Generator(device=device).manual_seed(0)
    weights = {s.name: torch.randn(s.shape, generator=g, device=device, dtype=torch.bfloat16) * 0.02 for s in specs if ".layers.0." in s.name}
    src = wire.Fp8WireSource(StateDictSource(weights))
    list(src.iter_weights())  # loads the kernels
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    walked = list(src.iter_weights())
    host = time.perf_counter() - t0
    torch.cuda.synchronize(device)
    walks = src.last_walk  # the second walk of the same tensors replays the first's launches
    assert walks.grouped == 388 and walks.alone == 0 and walks.launches <= 8 and walks.replayed == walks.launches, walks
    print(f"\nwalk host time: {host / 388 * 1e6:.1f} us a quantized weight, {src.last_walk}")
    got = dict(walked)
    for name in [s.name for s in specs if quantizes(s)][::97]:
        q, s = quantize_block_fp8_reference(weights[name].cpu())
        assert torch.equal(got[name].cpu().view(torch.uint8), q.view(torch.uint8)) and torch.equal(got[scale_name(name)].cpu(), s), name


@pytest.mark.gpu
def test_on_a_gpu_a_filled_walk_writes_the_slots_with_the_references_bytes() -> None:
    """The walk that writes a sender's buckets into its slot itself (`sources/fp8_fill.py`, issue 41)
    on CUDA with the real kernel: one Qwen3-30B-A3B layer in 64 MiB buckets, pulled as `Sender`
    pulls it (each bucket of whole entries offered). The first walk records, the second makes the
    fills, the third replays them: every third bucket's slot bytes equal the CPU reference, at
    both. Prints the replaying walk's host time a quantized weight (no views, nothing to pack)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    host, replayed = filled_walks(torch.device("cuda", 0))
    print(f"\nfilled walk host time: {host / 388 * 1e6:.2f} us a quantized weight, {replayed}")


def filled_walks(device: torch.device) -> tuple[float, wire.WalkCounts]:
    """`test_on_a_gpu_a_filled_walk_writes_the_slots_with_the_references_bytes` on `device` (the
    grouped kernel: CUDA's, or a stand-in the caller put in place): the replaying walk's host
    seconds and counts."""
    import time

    from ckpt_engine.fp8.direct import FILLED, OFFER, Ask, Offer
    from ckpt_engine.pipeline.wire_views import entry_view
    from ckpt_engine.planning.buckets import plan_buckets

    specs = checkpoint_specs(load_preset_config("qwen3-30b-a3b"), num_layers=1)
    g = torch.Generator(device=device).manual_seed(1)
    weights = {s.name: torch.randn(s.shape, generator=g, device=device, dtype=torch.bfloat16) * 0.02 for s in specs if ".layers.0." in s.name}
    manifest = plan_buckets(wire.Fp8WireSource(StateDictSource(weights)).metadata(), 64 << 20)
    assert all(e.is_whole for b in manifest.buckets for e in b.entries) and len(manifest.buckets) > 3
    slot = torch.empty((64 << 20) + 256, dtype=torch.uint8, device=device)
    views = [[entry_view(slot, e) for e in b.entries] for b in manifest.buckets]

    def check(b_index: int) -> None:
        for e, d in zip(manifest.buckets[b_index].entries, views[b_index]):
            name = e.name.removesuffix("_scale_inv")
            w = weights[name].cpu()
            if name == e.name and not quantizes(TensorSpec(name, "bfloat16", tuple(w.shape))):
                want = w
            else:
                q, s = quantize_block_fp8_reference(w)
                want = q if name == e.name else s
            assert torch.equal(d.cpu().reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), e.name

    def walk(checked: bool) -> tuple[float, wire.WalkCounts]:
        src, offer = wire.Fp8WireSource(StateDictSource(weights)), Offer("filled walks")
        src.fill_slots = True
        token = OFFER.set(offer)
        try:
            it = src.iter_weights()
            t0 = time.perf_counter()
            for b in manifest.buckets:
                offer.ask = Ask(b.index, b.entries, views[b.index], slot)
                assert next(it)[0] == FILLED
                offer.ask = None
                if checked and b.index % 3 == 0:
                    check(b.index)
            host = time.perf_counter() - t0
            assert next(it, None) is None
        finally:
            OFFER.reset(token)
        return host, src.last_walk

    list(wire.Fp8WireSource(StateDictSource(weights)).iter_weights())  # records the walk (and loads the kernels)
    _, made = walk(checked=True)
    host, replayed = walk(checked=False)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    walk(checked=True)
    n = len(manifest.buckets)
    assert made.filled == replayed.filled == n and made.replayed == 0, made
    assert replayed.grouped == 388 and replayed.alone == 0 and replayed.replayed == replayed.launches == n, replayed
    return host, replayed


def test_the_wire_layout_is_derived_once_per_metadata_and_anew_when_it_changes() -> None:
    """A sync wraps the trainer's source anew (`fp8_wire`); what the wire derives from its metadata
    (0.1-0.4 s of host for Qwen3-30B-A3B) is kept for equal metadata, and never for other metadata."""
    model = {n: t.bfloat16() for n, t in _model().items()}
    first = wire.Fp8WireSource(StateDictSource(model)).metadata()
    again = wire.Fp8WireSource(StateDictSource(dict(model))).metadata()
    assert again == first and all(a is b for a, b in zip(again, first))  # the same spec objects: derived once
    changed = dict(model)
    changed["model.layers.1.mlp.up_proj.weight"] = model["model.layers.1.mlp.up_proj.weight"][:256].clone()
    src = wire.Fp8WireSource(StateDictSource(changed))
    specs = {s.name: s for s in src.metadata()}
    assert specs["model.layers.1.mlp.up_proj.weight"].shape == (256, 256) and specs["model.layers.1.mlp.up_proj.weight_scale_inv"].shape == (2, 2)
    _same(list(src.iter_weights()), _eager(changed))


def test_the_next_walk_of_the_same_tensors_replays_the_last_and_quantizes_their_new_values(groups: EagerGroups) -> None:
    """A sync wraps the trainer's source anew; a stable source yields the same tensors every sync,
    so the second walk replays the first's launches (no grouping or launch tables worked out
    again), on the values the tensors hold now."""
    model = {n: t.bfloat16() for n, t in _model().items()}
    list(wire.Fp8WireSource(StateDictSource(model)).iter_weights())
    for t in model.values():
        t.mul_(-3.0)  # an optimizer step, in place
    src = wire.Fp8WireSource(StateDictSource(model))
    _same(list(src.iter_weights()), _eager(model))
    assert src.last_walk == wire.WalkCounts(launches=3, grouped=6, alone=2, replayed=3) and groups.launches == [1, 3, 2] * 2


@pytest.mark.parametrize("change", ["replaced", "moved", "transposed", "renamed"])
def test_a_walk_of_other_tensors_leaves_the_replay_where_they_differ(groups: EagerGroups, change: str) -> None:
    """Another tensor object, the same object on other memory (`.data` swapped), the same memory
    seen through other strides, or another name (other metadata): the replay stops there and the rest walks as usual
    (right bytes, counted as not replayed); the walk after it is recorded anew and replays."""
    model = {n: t.bfloat16() for n, t in _model().items()}
    list(wire.Fp8WireSource(StateDictSource(model)).iter_weights())
    name = "model.layers.1.self_attn.q_proj.weight"  # 256 x 256: its transpose has its shape
    if change == "replaced":
        model[name] = model[name].clone()
    elif change == "moved":
        model[name].data = model[name].data.clone()
    elif change == "transposed":
        model[name].data = model[name].data.t()
    else:
        model = {("model.layers.1.self_attn.k_proj.weight" if n == name else n): t for n, t in model.items()}
    for t in model.values():
        t.add_(0.5)
    for replayed in ((0, 3) if change == "renamed" else (1, 3)):  # up to the changed tensor's group (other metadata: none), then all
        src = wire.Fp8WireSource(StateDictSource(model))
        _same(list(src.iter_weights()), _eager(model))
        assert src.last_walk.replayed == replayed and src.last_walk.grouped + src.last_walk.alone == 8, src.last_walk
