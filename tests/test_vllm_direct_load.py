"""A vLLM model's direct loads (`rollout_adapters/vllm/direct_load.py`) land every recorded box
where the dry run saw the loader write it, whether the box is copied alone (16 MiB and up: one
`copy_` each) or in the batched copy of the small ones, and hand back what the record does not
cover for vLLM's own loader.

The record is written by hand here (a vLLM dry run needs a model that loads in place, i.e. CUDA):
the copies are real, into a plain module's parameters.
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Iterator

import pytest
import torch

from ckpt_engine.manifest import TensorSpec
from ckpt_engine.copies import ALONE_BYTES
from ckpt_engine.pipeline.plan_state import SharedBucket
from ckpt_engine.rollout_adapters.vllm.direct_load import DirectLoads, with_direct
from ckpt_engine.rollout_adapters.vllm.installed import Landing
from ckpt_engine.rollout_adapters.vllm.regions import PlanRecording

pytestmark = pytest.mark.fast

BIG_ROWS = ALONE_BYTES // (4 * 256)  # float32 rows of 256: one half of `big` is ALONE_BYTES


class Layout(torch.nn.Module):
    """vLLM-like fused parameters: q, k and v rows in one `qkv`; `big` split over two parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.zeros(12, 16), requires_grad=False)
        self.big_a = torch.nn.Parameter(torch.zeros(BIG_ROWS, 256), requires_grad=False)
        self.big_b = torch.nn.Parameter(torch.zeros(BIG_ROWS, 256), requires_grad=False)
        self.norm = torch.nn.Parameter(torch.zeros(16), requires_grad=False)


def rows(name: str, root: tuple[int, int], lo: int, hi: int, target: str, target_shape: tuple[int, int], at: int) -> Landing:
    """Rows [lo, hi) of checkpoint tensor `name` copied into rows from `at` of `target`."""
    cols = root[1]
    return Landing(name, ((lo, hi), (0, cols)), root, target, target_shape, (hi - lo, cols), (cols, 1), at * cols)


def recording() -> PlanRecording:
    specs = {
        "q.weight": TensorSpec("q.weight", "float32", (8, 16)),
        "k.weight": TensorSpec("k.weight", "float32", (2, 16)),
        "v.weight": TensorSpec("v.weight", "float32", (2, 16)),
        "big.weight": TensorSpec("big.weight", "float32", (2 * BIG_ROWS, 256)),
        "norm.weight": TensorSpec("norm.weight", "float32", (16,)),
    }
    landings = [
        rows("q.weight", (8, 16), 0, 8, "qkv", (12, 16), 0),
        rows("k.weight", (2, 16), 0, 2, "qkv", (12, 16), 8),
        rows("v.weight", (2, 16), 0, 2, "qkv", (12, 16), 10),
        rows("big.weight", (2 * BIG_ROWS, 256), 0, BIG_ROWS, "big_a", (BIG_ROWS, 256), 0),
        rows("big.weight", (2 * BIG_ROWS, 256), BIG_ROWS, 2 * BIG_ROWS, "big_b", (BIG_ROWS, 256), 0),
        Landing("norm.weight", ((0, 16),), (16,), "norm", (16,), (16,), (1,), 0),
    ]
    touched = {"q.weight": {"qkv"}, "k.weight": {"qkv"}, "v.weight": {"qkv"}, "big.weight": {"big_a", "big_b"}, "norm.weight": {"norm"}}
    return PlanRecording(specs, landings=landings, touched=touched)


def weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "q.weight": torch.randn(8, 16, generator=g), "k.weight": torch.randn(2, 16, generator=g), "v.weight": torch.randn(2, 16, generator=g),
        "big.weight": torch.randn(2 * BIG_ROWS, 256, generator=g), "norm.weight": torch.randn(16, generator=g),
    }


def assert_holds(model: Layout, w: dict[str, torch.Tensor]) -> None:
    assert torch.equal(model.qkv, torch.cat([w["q.weight"], w["k.weight"], w["v.weight"]]))
    assert torch.equal(model.big_a, w["big.weight"][:BIG_ROWS]) and torch.equal(model.big_b, w["big.weight"][BIG_ROWS:])
    assert torch.equal(model.norm, w["norm.weight"])


def test_every_box_lands_where_recorded_alone_or_batched() -> None:
    model = Layout()
    direct = DirectLoads(model, recording())
    assert len(direct) == 5
    for seed in (1, 2):  # a second sync into the same live views
        w = weights(seed)
        names = list(w)
        # two buckets, as a receive hands them: the big one (two boxes of ALONE_BYTES, each copied alone) and the rest
        assert direct.load([(n, w[n]) for n in names[:2]]) == []
        assert direct.load([(n, w[n]) for n in names[2:]]) == []
        assert_holds(model, w)
    assert direct.copied == 10


def test_what_the_record_does_not_cover_goes_to_vllms_loader() -> None:
    model = Layout()
    direct = DirectLoads(model, recording())
    w = weights(3)
    other_dtype = w["k.weight"].to(torch.bfloat16)  # not as recorded: vLLM's loader converts it
    other_shape = torch.zeros(4, 16)
    unknown = torch.ones(3)
    rest = direct.load([("q.weight", w["q.weight"]), ("k.weight", other_dtype), ("v.weight", other_shape), ("extra", unknown), ("big.weight", w["big.weight"])])
    assert [(n, t) for n, t in rest] == [("k.weight", other_dtype), ("v.weight", other_shape), ("extra", unknown)]
    assert torch.equal(model.qkv[:8], w["q.weight"]) and not model.qkv[8:].any()  # the refused ones wrote nothing
    assert torch.equal(model.big_a, w["big.weight"][:BIG_ROWS]) and torch.equal(model.big_b, w["big.weight"][BIG_ROWS:])
    assert direct.copied == 2


def test_only_what_is_left_enters_vllms_loader_and_its_config() -> None:
    """`with_direct`: a bucket the record covers whole is copied without entering vLLM's config;
    one with names left hands only those to vLLM's loader, inside it."""
    model = Layout()
    direct = DirectLoads(model, recording())
    entered: list[int] = []
    loaded: list[list[str]] = []

    @contextlib.contextmanager
    def loading() -> Iterator[None]:
        entered.append(1)
        yield

    def load_weights(pairs: list[tuple[str, torch.Tensor]]) -> None:
        assert entered, "vLLM's loader ran outside its config"
        loaded.append([n for n, _ in pairs])

    load = with_direct(load_weights, direct, loading)
    w = weights(4)
    load([(n, w[n]) for n in ("q.weight", "k.weight", "v.weight")])
    assert entered == [] and loaded == []
    load([("norm.weight", w["norm.weight"]), ("extra", torch.ones(2)), ("big.weight", w["big.weight"])])
    assert entered == [1] and loaded == [["extra"]]
    assert_holds(model, w)
    everything = with_direct(load_weights, None, loading)  # no direct copies: every pair goes to vLLM's loader
    everything([("q.weight", w["q.weight"])])
    assert loaded[-1] == ["q.weight"] and entered == [1, 1]


def test_a_colocated_senders_kept_buckets_replay_their_copies() -> None:
    """A `SharedBucket` (a stable colocated sender's mapped tensors: the same objects every sync,
    written in place by the trainer) the record covered whole is copied from its kept pairs at the
    next syncs, landing each sync's values; a bucket with a name left for vLLM's loader is worked out
    every time; a new bucket (a new offer) lands its own tensors, never the old bucket's."""
    model = Layout()
    direct = DirectLoads(model, recording())
    w = weights(5)
    covered = SharedBucket([("q.weight", w["q.weight"]), ("k.weight", w["k.weight"]), ("v.weight", w["v.weight"]), ("big.weight", w["big.weight"])])
    extra = torch.ones(3)
    partial = SharedBucket([("norm.weight", w["norm.weight"]), ("extra", extra)])
    for seed in (6, 7, 8):
        assert direct.load(covered) == []
        assert direct.load(partial) == [("extra", extra)]
        assert_holds(model, w)
        for name, t in weights(seed).items():  # the trainer's step, in place: the next sync's values
            w[name].copy_(t)
    assert direct.replayed == 2  # the covered bucket at its second and third sight, never the partial one
    moved = weights(9)
    again = SharedBucket([(n, moved[n]) for n, _ in covered])  # a new offer's bucket: other tensors, same names
    assert direct.load(again) == [] and direct.load(partial) == [("extra", extra)]
    assert torch.equal(model.qkv, torch.cat([moved["q.weight"], moved["k.weight"], moved["v.weight"]]))
    assert torch.equal(model.big_a, moved["big.weight"][:BIG_ROWS]) and torch.equal(model.big_b, moved["big.weight"][BIG_ROWS:])
    assert direct.replayed == 2
    held = weakref.ref(w["q.weight"])
    del covered, again, w
    gc.collect()
    assert held() is None  # a bucket gone takes its kept copies, and the tensors they read, with it
